#pragma once
/// \file state_access.hpp
/// The replicated engines' only view of a user's state (`deepclone::state<T>`): its layout,
/// each tensor's bytes and memory space, and the metadata. It is type-erased so that
/// `source_engine` and `clone_engine` are not compiled per tensor type: only the thin
/// `engine<...>::source<T>` / `clone<T>` shells and this byte access are (issue 11, item 2;
/// the compile times are in docs/performance.md). The engines call it per tensor, per piece
/// or per round of progress, never per byte.

#include <cstddef>
#include <span>
#include <vector>

#include "../layout.hpp"
#include "../metadata.hpp"
#include "../state.hpp"
#include "../tensor.hpp"

namespace deepclone::detail {

class state_access {
 public:
  /// The layout as of now (sizes and dtypes read through the tensor traits).
  virtual layout describe() const = 0;
  /// Bytes of the tensor with flat index `flat` (layer order, then tensor order), as of now.
  virtual std::span<std::byte> bytes(std::size_t flat) = 0;
  virtual memory_space space(std::size_t flat) const = 0;
  /// Every tensor's bytes as of now, in flat order, in one walk over the live state (which
  /// may have gained or lost tensors since its layout was taken). `out` is reused.
  virtual void all_bytes(std::vector<std::span<std::byte>>& out) = 0;
  virtual deepclone::metadata& metadata() = 0;
  virtual const deepclone::metadata& metadata() const = 0;

 protected:
  state_access() = default;
  state_access(const state_access&) = default;
  state_access& operator=(const state_access&) = default;
  ~state_access() = default;  // never owned through this interface
};

/// `state_access` over a `deepclone::state<T>` the user keeps alive.
template <tensor T>
class state_access_of final : public state_access {
 public:
  explicit state_access_of(deepclone::state<T>& s) : state_(s) {}
  layout describe() const override { return state_.describe(); }
  std::span<std::byte> bytes(std::size_t flat) override { return state_.bytes(flat); }
  memory_space space(std::size_t flat) const override { return state_.space(flat); }
  void all_bytes(std::vector<std::span<std::byte>>& out) override {
    out.clear();
    for (std::size_t l = 0; l < state_.layer_count(); ++l)
      for (auto& t : state_.layer_tensors(l)) out.push_back(tensor_bytes(*t.ref));
  }
  deepclone::metadata& metadata() override { return state_.metadata(); }
  const deepclone::metadata& metadata() const override { return state_.metadata(); }

 private:
  deepclone::state<T>& state_;
};

/// Holds a shell's `state_access_of<T>`. The shells derive from it ahead of the engine, so
/// that it is built before the engine that refers to it (and destroyed after).
template <tensor T>
struct state_access_holder {
  explicit state_access_holder(deepclone::state<T>& s) : access(s) {}
  state_access_of<T> access;
};

}  // namespace deepclone::detail

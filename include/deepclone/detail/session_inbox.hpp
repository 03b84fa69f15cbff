#pragma once
/// \file detail/session_inbox.hpp
/// What clone ranks send a source during a session: cancels, layer acknowledgements and
/// refetch requests, one posted receive per clone rank and kind, decoded here. A message
/// naming another session is kept for it: a clone rank may already be one session ahead
/// of this source (it completed session i with the other sources' data and requested
/// i + 1 while this source, a step behind, still closes i), so its acknowledgements,
/// refetches and cancels of i + 1 can arrive here first, and dropping them would leave this
/// source waiting for acknowledgements that never come again. Undecodable bytes (a peer's
/// garbage) are dropped. Templated on the communicator only: every source engine over the
/// same transport shares this code.

#include <array>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <optional>
#include <span>
#include <variant>
#include <vector>

#include "../error.hpp"
#include "outbox.hpp"
#include "wire.hpp"

namespace deepclone::detail {

/// One decoded message from clone index `from`.
struct clone_message {
  std::uint32_t from = 0;
  std::variant<cancel_msg, ack_msg, refetch_msg> body;
  std::uint64_t session() const {
    return std::visit([](auto& m) { return m.session; }, body);
  }
};

template <class Comm>
class session_inbox {
 public:
  /// Opens session `id`: posts the receives from every rank of `clones`, and returns the
  /// messages of `id` that arrived while another session was open (the rest kept is dropped).
  std::vector<clone_message> open(Comm& c, const std::vector<int>& clones, int tag_base, std::uint64_t id) {
    clones_ = clones;
    base_ = tag_base;
    id_ = id;
    slots_.assign(clones.size(), {});
    for (std::uint32_t j = 0; j < clones.size(); ++j)
      for (std::size_t k = 0; k < kinds; ++k) slots_[j][k].post(c, clones_[j], base_ + tags[k], control_bytes);
    std::vector<clone_message> mine;
    for (auto& m : early_)
      if (m.session() == id) mine.push_back(std::move(m));
    early_.clear();  // what names an older session is stale now
    return mine;
  }

  /// The messages of the open session that arrived since the last call, clone by clone
  /// (cancel, acknowledgement, refetch); the receives are posted again.
  std::vector<clone_message> poll(Comm& c) {
    std::vector<clone_message> got;
    for (std::uint32_t j = 0; j < slots_.size(); ++j)
      for (std::size_t k = 0; k < kinds; ++k)
        if (auto b = slots_[j][k].test(c)) {
          sort(decode(k, j, *b), got);
          slots_[j][k].post(c, clones_[j], base_ + tags[k], control_bytes);
        }
    return got;
  }

  /// Closes the session: withdraws the receives, keeping what matched meanwhile and
  /// names another session (what names the closed one is dropped).
  void close(Comm& c) {
    std::vector<clone_message> late;
    for (std::uint32_t j = 0; j < slots_.size(); ++j)
      for (std::size_t k = 0; k < kinds; ++k)
        if (auto b = slots_[j][k].withdraw(c)) sort(decode(k, j, *b), late);
    slots_.clear();
    id_.reset();
  }

 private:
  static constexpr std::size_t kinds = 3;  // cancel, acknowledgement, refetch
  static constexpr std::array<int, kinds> tags{tag_cancel, tag_ack, tag_refetch};
  static constexpr std::size_t max_early = 64;

  static std::optional<clone_message> decode(std::size_t kind, std::uint32_t j, std::span<const std::byte> b) {
    try {
      switch (kind) {
        case 0: return clone_message{j, cancel_msg::decode(b)};
        case 1: return clone_message{j, ack_msg::decode(b)};
        default: return clone_message{j, refetch_msg::decode(b)};
      }
    } catch (const error&) {
      return std::nullopt;
    }
  }
  /// A message of the open session goes to `mine`; one of another session is kept for it
  /// (the oldest kept is dropped beyond `max_early`).
  void sort(std::optional<clone_message> m, std::vector<clone_message>& mine) {
    if (!m) return;
    if (id_ && m->session() == *id_) return mine.push_back(std::move(*m));
    early_.push_back(std::move(*m));
    if (early_.size() > max_early) early_.pop_front();
  }

  std::vector<int> clones_;
  int base_ = 0;
  std::optional<std::uint64_t> id_;
  std::vector<std::array<inbox_slot<Comm>, kinds>> slots_;
  std::deque<clone_message> early_;
};

}  // namespace deepclone::detail

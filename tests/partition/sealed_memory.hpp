#pragma once
// A stand-in for device memory in tests of the partitioned transfer's Memory policy
// (part_memory.hpp). `sealed` gives a host buffer a second address, in a mapping with no
// access at all (PROT_NONE): a part handed to the transfer at that address faults at once if
// the transfer reads or writes it itself. `sealed_memory` (host_addressable = false) reaches
// the buffer behind the address, as a device policy reaches device memory, and counts its
// copies.
#include <deepclone/part_memory.hpp>

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <stdexcept>
#include <type_traits>
#include <vector>

namespace partition_test {

/// Every sealed address range and the host buffer behind it.
class sealed_table {
 public:
  static sealed_table& get() {
    static sealed_table t;
    return t;
  }
  void add(const std::byte* at, std::size_t n, std::byte* real) {
    std::lock_guard g(mu_);
    entries_.push_back({reinterpret_cast<std::uintptr_t>(at), n, real});
  }
  void remove(const std::byte* at) {
    std::lock_guard g(mu_);
    std::erase_if(entries_, [&](const entry& e) { return e.begin == reinterpret_cast<std::uintptr_t>(at); });
  }
  /// The host bytes behind the sealed range [p, p + n); throws if it lies in no sealed range.
  std::byte* real(const std::byte* p, std::size_t n) {
    const auto a = reinterpret_cast<std::uintptr_t>(p);
    std::lock_guard g(mu_);
    for (const auto& e : entries_)
      if (a >= e.begin && a - e.begin <= e.size && n <= e.size - (a - e.begin)) return e.real + (a - e.begin);
    throw std::logic_error("sealed_memory: a run outside every sealed part");
  }

 private:
  struct entry {
    std::uintptr_t begin;
    std::size_t size;
    std::byte* real;
  };
  std::mutex mu_;
  std::vector<entry> entries_;
};

/// A sealed address for the host buffer `real` while this lives.
class sealed {
 public:
  explicit sealed(std::span<std::byte> real) : size_(real.size()) {
    const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
    mapped_ = std::max<std::size_t>((size_ + page - 1) / page * page, page);
    void* p = ::mmap(nullptr, mapped_, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) throw std::runtime_error("sealed: mmap failed");
    base_ = static_cast<std::byte*>(p);
    sealed_table::get().add(base_, size_, real.data());
  }
  sealed(const sealed&) = delete;
  sealed& operator=(const sealed&) = delete;
  ~sealed() {
    sealed_table::get().remove(base_);
    ::munmap(base_, mapped_);
  }
  std::span<std::byte> bytes() const { return {base_, size_}; }

 private:
  std::size_t size_, mapped_ = 0;
  std::byte* base_ = nullptr;
};

/// Sealed aliases of a rank's own tensors, and their spans as the transfer takes them.
class sealed_parts {
 public:
  explicit sealed_parts(std::vector<std::vector<std::byte>>& own) {
    for (auto& t : own) aliases_.push_back(std::make_unique<sealed>(std::span<std::byte>(t)));
  }
  template <class Byte>
  std::vector<std::span<Byte>> spans() const {
    std::vector<std::span<Byte>> out;
    for (const auto& a : aliases_) out.emplace_back(a->bytes().data(), a->bytes().size());
    return out;
  }

 private:
  std::vector<std::unique_ptr<sealed>> aliases_;
};

/// The Memory policy for sealed parts: copies through the buffers behind them, counted.
struct sealed_memory {
  static constexpr bool host_addressable = false;
  static inline std::atomic<std::uint64_t> gathers{0}, scatters{0};
  static inline std::atomic<int> failing_scatters{0};  ///< this many scatters throw, as a failed device copy would

  void gather(std::span<const std::span<const std::byte>> runs, std::span<std::byte> out) const {
    std::size_t at = 0;
    for (auto r : runs) {
      if (!r.empty()) std::memcpy(out.data() + at, sealed_table::get().real(r.data(), r.size()), r.size());
      at += r.size();
    }
    if (at != out.size()) throw std::logic_error("sealed_memory::gather: a buffer of another size than the runs");
    ++gathers;
  }
  void scatter(std::span<const std::byte> in, std::span<const std::span<std::byte>> runs) const {
    if (failing_scatters.fetch_sub(1) > 0) throw std::runtime_error("sealed_memory: a device copy failed");
    failing_scatters.fetch_add(1);
    std::size_t at = 0;
    for (auto r : runs) {
      if (!r.empty()) std::memcpy(sealed_table::get().real(r.data(), r.size()), in.data() + at, r.size());
      at += r.size();
    }
    if (at != in.size()) throw std::logic_error("sealed_memory::scatter: a buffer of another size than the runs");
    ++scatters;
  }
};
static_assert(deepclone::part_memory<sealed_memory>);

/// A rank's own tensors as its Memory policy reaches them: sealed for sealed_memory, else as
/// they are (the host's memory is Thrust's device memory on its CPU back-ends).
template <class Byte>
struct placed_parts {
  std::optional<sealed_parts> aliases;
  std::vector<std::span<Byte>> spans;
};
template <class Memory, class Byte>
placed_parts<Byte> parts_in(std::vector<std::vector<std::byte>>& own) {
  placed_parts<Byte> p;
  if constexpr (std::is_same_v<Memory, sealed_memory>) {
    p.aliases.emplace(own);
    p.spans = p.aliases->template spans<Byte>();
  } else {
    for (auto& t : own) p.spans.emplace_back(t.data(), t.size());
  }
  return p;
}

}  // namespace partition_test

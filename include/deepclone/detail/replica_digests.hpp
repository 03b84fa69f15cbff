#pragma once
/// \file detail/replica_digests.hpp
/// settings.verify_replicas, clone side: every source's digest of its whole replica of the
/// fork iteration (`digest_msg`: the fold of the checksums of every piece of the plan, in
/// plan order), compared with the fold of the piece checksums this clone rank verified.
/// Equal digests mean the replicas the sources train on agree, not only the bytes sent.
/// Templated on the communicator only.

#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "../error.hpp"
#include "outbox.hpp"
#include "wire.hpp"

namespace deepclone::detail {

template <class Comm>
class replica_digests {
 public:
  /// Starts a session; with `on` (the decision's flag_verify_replicas) posts a receive
  /// from every rank of `sources`.
  void open(Comm& c, const std::vector<int>& sources, int tag_base, bool on) {
    sources_ = sources;
    tag_ = tag_base + tag_digest;
    on_ = on;
    verified_ = 0;
    got_.assign(sources.size(), std::nullopt);
    slots_.resize(on ? sources.size() : 0);
    for (std::uint32_t i = 0; i < slots_.size(); ++i) slots_[i].post(c, sources_[i], tag_, control_bytes);
  }
  bool on() const noexcept { return on_; }
  /// Source index `i` has not sent its digest (and one is expected).
  bool awaited(std::uint32_t i) const { return on_ && !got_[i]; }
  /// Replicas found equal to the received state by the last `compare`.
  std::uint32_t verified() const noexcept { return verified_; }

  /// Takes the digests of `session` that arrived; true if any. Throws
  /// `errc::corrupt_message` for one that names another iteration or source.
  bool poll(Comm& c, std::uint64_t session, std::uint64_t k) {
    bool any = false;
    for (std::uint32_t i = 0; i < slots_.size(); ++i) {
      auto m = take_control<digest_msg>(c, slots_[i], session);
      if (!m) continue;
      any = true;
      if (m->iteration != k || m->source_index != i)
        throw error(errc::corrupt_message, "replica digest from source rank " + std::to_string(sources_[i]) + " names iteration " +
                                               std::to_string(m->iteration) + " and source " + std::to_string(m->source_index) +
                                               "; expected " + std::to_string(k) + " and " + std::to_string(i));
      got_[i] = *m;
    }
    return any;
  }

  /// True once every source not `failed` sent its digest and each equals `mine`, the
  /// received state's; true at once when the session does not verify replicas. Throws
  /// `errc::replica_mismatch` naming the sources that differ, or `errc::source_failed` when
  /// every source failed before sending one.
  bool agree(std::uint64_t mine, std::uint64_t k, const std::vector<char>& failed) {
    if (!on_) return true;
    for (std::uint32_t i = 0; i < got_.size(); ++i)
      if (!got_[i] && !failed[i]) return false;
    std::string differ, agree;
    verified_ = 0;
    for (std::uint32_t i = 0; i < got_.size(); ++i) {
      if (!got_[i]) continue;
      std::string who = "source " + std::to_string(i) + " (rank " + std::to_string(sources_[i]) + ")";
      if (got_[i]->digest == mine) {
        ++verified_;
        agree += (agree.empty() ? "" : ", ") + who;
      } else {
        differ += (differ.empty() ? "" : ", ") + who + " has " + hex(got_[i]->digest);
      }
    }
    if (!differ.empty())
      throw error(errc::replica_mismatch, "the sources' replicas of iteration " + std::to_string(k) + " differ: the received state has digest " +
                                              hex(mine) + (agree.empty() ? "" : " (as " + agree + ")") + ", but " + differ);
    if (verified_ == 0)
      throw error(errc::source_failed, "settings.verify_replicas: every source failed before sending the digest of its replica");
    return true;
  }

  void cancel(Comm& c) noexcept {
    for (auto& s : slots_) s.cancel(c);
  }

 private:
  static std::string hex(std::uint64_t v) {
    char b[19];
    std::snprintf(b, sizeof b, "0x%016llx", static_cast<unsigned long long>(v));
    return b;
  }

  std::vector<int> sources_;
  int tag_ = 0;
  bool on_ = false;
  std::uint32_t verified_ = 0;
  std::vector<inbox_slot<Comm>> slots_;
  std::vector<std::optional<digest_msg>> got_;
};

}  // namespace deepclone::detail

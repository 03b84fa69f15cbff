#pragma once
/// \file detail/source_pipeline_context.hpp
/// What the source engine offers a pipeline policy (`pipeline::context`, pipeline.hpp) over
/// the session in flight, with every argument and call checked against the context's rules:
/// a pipeline that names a layer, piece or clone rank that does not exist, posts a piece
/// under another layer, or calls on after the session ended breaks a rule, and the engine
/// fails the session and throws. The session's bookkeeping is `source_session`; what
/// depends on the user's tensors and the engine's policies (the pieces' live bytes, their
/// checksum, progress under the session's deadline) the engine provides through
/// `source_pipeline_host`. Templated on the communicator only.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "../layout.hpp"
#include "../pipeline.hpp"
#include "../plan.hpp"
#include "../roles.hpp"
#include "source_session.hpp"

namespace deepclone::detail {

/// The source engine as the pipeline's context sees it.
class source_pipeline_host {
 public:
  /// This source's pieces of layer `l` (empty, and the session ended, when a tensor of `l`
  /// was resized).
  virtual std::vector<pipeline::context::outgoing> pieces_of(std::size_t l) = 0;
  /// The engine's checksum of `bytes`.
  virtual std::uint64_t checksum_of(std::span<const std::byte> bytes) const = 0;
  /// Session progress until `done()`; false if the session ended meanwhile.
  virtual bool progress_while_waiting(const std::function<bool()>& done, const std::string& what) = 0;
  /// Every send of the session completed and every clone rank verified every layer.
  virtual bool session_delivered() = 0;
  /// The pipeline broke a rule of its context: the session fails and the hook throws.
  [[noreturn]] virtual void pipeline_broke_rule(const std::string& what) = 0;

 protected:
  ~source_pipeline_host() = default;
};

template <class Comm>
class source_pipeline_context final : public pipeline::context {
 public:
  using session = source_session<Comm>;

  /// References to the engine's own members, read at each call: its layout, plan, roles and
  /// index; `s` and `last_step`: the session in flight and the last ended iteration;
  /// `memory`: what the pipeline reserved.
  source_pipeline_context(Comm& comm, const layout& lay, const deepclone::plan& p, const roles& r, const std::uint32_t& index,
                          std::optional<session>& s, const std::optional<std::uint64_t>& last_step, std::vector<std::byte>& memory,
                          source_pipeline_host& host)
      : comm_(comm), layout_(lay), plan_(p), roles_(r), index_(index), session_(s), last_step_(last_step), memory_(memory), host_(host) {}

  std::size_t layers() const override { return layout_.layer_count(); }
  std::uint64_t fork_iteration() const override { return in_session("fork_iteration").k; }
  bool fork_iteration_ended() const override { return last_step_ && *last_step_ >= in_session("fork_iteration_ended").k; }
  bool active() const override { return session_.has_value(); }
  std::uint64_t bytes_of_source() const override { return plan_.bytes_of_source(index_); }
  std::span<std::byte> memory() override { return memory_; }
  std::vector<outgoing> pieces(std::size_t l) override { return host_.pieces_of(layer(l, "pieces")); }
  void summed(std::uint32_t pi, std::span<const std::byte> bytes) override {
    auto& s = in_session("summed");
    s.piece_sums[piece(pi, "summed")] = host_.checksum_of(bytes);
    s.summed[pi] = 1;
  }
  request post(const data_send& d) override {
    auto& s = in_session("post");
    auto& p = plan_.pieces()[piece(d.piece, "post")];
    if (p.layer != layer(d.layer, "post"))
      host_.pipeline_broke_rule("context::post: piece " + std::to_string(d.piece) + " belongs to layer " + std::to_string(p.layer) +
                                ", not to layer " + std::to_string(d.layer));
    clone(d.to, "post");
    return s.post_data(comm_, d.layer, d.to, d.bytes);
  }
  void send_headers(std::size_t l) override { in_session("send_headers").send_headers(comm_, layer(l, "send_headers")); }
  bool done(request r) override { return in_session("done").out.done(comm_, r); }
  bool sends_done(std::size_t l) override {
    auto& s = in_session("sends_done");
    return s.sends_done(comm_, s.layer_reqs[layer(l, "sends_done")]);
  }
  bool refetches_done(std::size_t l) override {
    auto& s = in_session("refetches_done");
    return s.sends_done(comm_, s.refetch_reqs[layer(l, "refetches_done")]);
  }
  bool verified(std::size_t l) const override { return in_session("verified").verified(layer(l, "verified")); }
  bool verified_by(std::size_t l, std::uint32_t j) const override {
    return in_session("verified_by").acked[clone(j, "verified_by")][layer(l, "verified_by")] != 0;
  }
  bool released(std::size_t l) const override { return in_session("released").released[layer(l, "released")]; }
  bool delivered() override {
    in_session("delivered");
    return host_.session_delivered();
  }
  bool wait_until(const std::function<bool()>& done, const std::string& what) override {
    return host_.progress_while_waiting(done, what);
  }
  using pipeline::context::done;

 private:
  /// The session in flight; a pipeline that calls on after it ended breaks the context's rule.
  session& in_session(const char* call) const {
    if (!session_)
      host_.pipeline_broke_rule(std::string("context::") + call + " after the session ended (a pipeline checks active() after "
                                                                  "every call that may end it, and returns at once when it is false)");
    return *session_;
  }
  std::size_t layer(std::size_t l, const char* call) const {
    if (l >= layout_.layer_count())
      host_.pipeline_broke_rule(std::string("context::") + call + ": layer " + std::to_string(l) + ", but the state has " +
                                std::to_string(layout_.layer_count()) + " layers");
    return l;
  }
  std::uint32_t piece(std::uint32_t pi, const char* call) const {
    if (pi >= plan_.pieces().size())
      host_.pipeline_broke_rule(std::string("context::") + call + ": piece " + std::to_string(pi) + ", but the plan has " +
                                std::to_string(plan_.pieces().size()) + " pieces");
    return pi;
  }
  std::uint32_t clone(std::uint32_t j, const char* call) const {
    if (j >= roles_.clone_count())
      host_.pipeline_broke_rule(std::string("context::") + call + ": clone index " + std::to_string(j) + ", but there are " +
                                std::to_string(roles_.clone_count()) + " clone ranks");
    return j;
  }

  Comm& comm_;
  const layout& layout_;
  const deepclone::plan& plan_;
  const roles& roles_;
  const std::uint32_t& index_;
  std::optional<session>& session_;
  const std::optional<std::uint64_t>& last_step_;
  std::vector<std::byte>& memory_;
  source_pipeline_host& host_;
};

}  // namespace deepclone::detail

#pragma once
/// \file error.hpp
/// The one exception type deepclone throws, with an error-code enum so that callers can
/// branch on the kind of failure and log a message that names what went wrong.

#include <string>
#include <system_error>
#include <type_traits>

namespace deepclone {

/// What went wrong. Messages always name the tensor, rank, byte range or iteration
/// involved; the code says which kind of failure it was. Each code's identifier is also
/// its stable, searchable name in messages (`errc_name`).
enum class errc {
  invalid_argument = 1,  ///< bad roles, N or M of zero, a rank outside the communicator
  hook_order,            ///< source hooks called out of order (before/after/end_iteration)
  busy,                  ///< a second request while a clone is in flight
  layout_mismatch,       ///< clone and sources disagree on tensors (count, names, sizes, dtypes), or a tensor was resized
  plan_mismatch,         ///< clone and sources disagree on policies or settings
  timeout,               ///< a deadline passed; the message says what was still missing
  corrupt_message,       ///< a message failed its checks (checksum, header, size)
  fork_agreement,        ///< a source learned the fork iteration too late to serve it
  source_failed,         ///< a source stopped or failed before delivering its part
  cancelled,             ///< the clone was cancelled (by this clone rank or a peer clone rank)
  not_ready,             ///< state queried before it is complete
  unsupported,           ///< a combination the chosen policies or transport cannot do
  transport,             ///< the communicator reported a failure
  replica_mismatch,      ///< a source's replica differs from the state the clone received
  outside_hooks,         ///< a tensor was written outside its layer's before_update/after_update
};

/// The stable name of a code, as it appears in every message: "deepclone: timeout: ...".
constexpr const char* errc_name(errc e) noexcept {
  switch (e) {
    case errc::invalid_argument: return "invalid_argument";
    case errc::hook_order: return "hook_order";
    case errc::busy: return "busy";
    case errc::layout_mismatch: return "layout_mismatch";
    case errc::plan_mismatch: return "plan_mismatch";
    case errc::timeout: return "timeout";
    case errc::corrupt_message: return "corrupt_message";
    case errc::fork_agreement: return "fork_agreement";
    case errc::source_failed: return "source_failed";
    case errc::cancelled: return "cancelled";
    case errc::not_ready: return "not_ready";
    case errc::unsupported: return "unsupported";
    case errc::transport: return "transport";
    case errc::replica_mismatch: return "replica_mismatch";
    case errc::outside_hooks: return "outside_hooks";
  }
  return "unknown";
}

namespace detail {
class error_category_impl final : public std::error_category {
 public:
  const char* name() const noexcept override { return "deepclone"; }
  std::string message(int code) const override {
    switch (static_cast<errc>(code)) {
      case errc::invalid_argument: return "invalid argument";
      case errc::hook_order: return "hooks called out of order";
      case errc::busy: return "a clone is already in flight";
      case errc::layout_mismatch: return "layout mismatch";
      case errc::plan_mismatch: return "plan settings mismatch";
      case errc::timeout: return "timed out";
      case errc::corrupt_message: return "corrupt message";
      case errc::fork_agreement: return "fork agreement failed";
      case errc::source_failed: return "source failed";
      case errc::cancelled: return "cancelled";
      case errc::not_ready: return "not ready";
      case errc::unsupported: return "unsupported";
      case errc::transport: return "transport failure";
      case errc::replica_mismatch: return "source replicas differ";
      case errc::outside_hooks: return "tensor written outside its update hooks";
    }
    return "unknown deepclone error";
  }
};
}  // namespace detail

/// The category of deepclone's error codes.
inline const std::error_category& error_category() noexcept {
  static const detail::error_category_impl category;
  return category;
}

inline std::error_code make_error_code(errc e) noexcept {
  return {static_cast<int>(e), error_category()};
}

/// Why a clone session ended without delivering, as a source records it (`last_error()`):
/// the same code and details the clone ranks see.
struct failure {
  errc code;
  std::string what;  ///< the details, without the "deepclone: <name>: " prefix
};

/// The exception deepclone throws. `code()` compares equal to a `deepclone::errc`;
/// `what()` reads "deepclone: <errc name>: <details>" (e.g. "deepclone: timeout: clone
/// rank 4: nothing arrived for 60 s; still missing: layer 3 from source rank 1");
/// `details()` is the part after the name, which is what an error passed on keeps (so
/// the prefix never doubles).
class error : public std::system_error {
 public:
  error(errc e, const std::string& details)
      : std::system_error(make_error_code(e)),
        details_(details),
        what_(std::string("deepclone: ") + errc_name(e) + ": " + details) {}
  errc kind() const noexcept { return static_cast<errc>(code().value()); }
  const std::string& details() const noexcept { return details_; }
  const char* what() const noexcept override { return what_.c_str(); }

 private:
  std::string details_, what_;
};

}  // namespace deepclone

template <>
struct std::is_error_code_enum<deepclone::errc> : std::true_type {};

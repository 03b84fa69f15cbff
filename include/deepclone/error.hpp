#pragma once
/// \file error.hpp
/// The one exception type deepclone throws, with an error-code enum so that callers can
/// branch on the kind of failure and log a message that names what went wrong.

#include <string>
#include <system_error>
#include <type_traits>

namespace deepclone {

/// What went wrong. Messages always name the tensor, rank, byte range or iteration
/// involved; the code says which kind of failure it was.
enum class errc {
  invalid_argument = 1,  ///< bad roles, N or M of zero, a rank outside the communicator
  hook_order,            ///< source hooks called out of order (before/after/end_iteration)
  busy,                  ///< a second request while a clone is in flight
  layout_mismatch,       ///< clone and sources disagree on tensors (count, names, sizes, dtypes)
  plan_mismatch,         ///< clone and sources disagree on policies or settings
  timeout,               ///< a deadline passed; the message says what was still missing
  corrupt_message,       ///< a message failed its checks (checksum, header, size)
  fork_agreement,        ///< a source learned the fork iteration too late to serve it
  source_failed,         ///< a source stopped or failed before delivering its part
  cancelled,             ///< the clone was cancelled
  not_ready,             ///< state queried before it is complete
  unsupported,           ///< a combination the chosen policies or transport cannot do
  transport,             ///< the communicator reported a failure
  replica_mismatch,      ///< a source's replica differs from the state the clone received
};

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
/// the same code and message the clone ranks see.
struct failure {
  errc code;
  std::string what;
};

/// The exception deepclone throws. `code()` compares equal to a `deepclone::errc`;
/// `what()` reads "deepclone: <kind>: <details>".
class error : public std::system_error {
 public:
  error(errc e, const std::string& details)
      : std::system_error(make_error_code(e), "deepclone: " + details) {}
  errc kind() const noexcept { return static_cast<errc>(code().value()); }
};

}  // namespace deepclone

template <>
struct std::is_error_code_enum<deepclone::errc> : std::true_type {};

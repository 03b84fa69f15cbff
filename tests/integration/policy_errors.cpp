// Compiled by check_policy_errors.cmake once per -DLACKS=<n>, each time with one member
// missing from a user-written policy: the compile must fail with the library's message
// naming that member (policy.hpp), not only a list of unsatisfied constraints.
#include <deepclone/deepclone.hpp>

namespace user {
struct reconstruction {
  static constexpr std::uint32_t id = 300;
  static constexpr const char* name = "user";
  std::uint64_t param() const { return 0; }
  std::vector<deepclone::piece> assign_owners(std::vector<deepclone::piece> v, const deepclone::layout&, std::uint32_t,
                                              std::uint64_t) const {
    return v;  // piece::all_clones: every clone rank receives every piece from the sources
  }
#if LACKS != 1
  std::vector<deepclone::reconstruct::hop> forwards(std::uint32_t, std::uint32_t) const { return {}; }
#endif
};
struct sharding {
#if LACKS != 2
  static constexpr std::uint32_t id = 301;
#endif
  static constexpr const char* name = "user";
  std::uint64_t param() const { return 0; }
  std::vector<deepclone::piece> assign(const deepclone::layout& l, std::uint32_t n, std::uint64_t a) const {
    return deepclone::shard::whole_tensor{}.assign(l, n, a);
  }
};
struct checksum {
  static constexpr std::uint32_t id = 302;
  static constexpr const char* name = "user";
#if LACKS != 3
  static std::uint64_t compute(std::span<const std::byte>) noexcept { return 0; }
#endif
};
struct pipeline {
  static constexpr const char* name = "user";
  void layer_final(deepclone::pipeline::context& c, std::size_t l) { c.send_layer(l); }
#if LACKS != 4
  bool may_overwrite(deepclone::pipeline::context& c, std::size_t l) { return c.sends_done(l) && c.verified(l); }
#endif
};
struct agreement {
  static constexpr const char* name = "user";
  static constexpr bool trainer_collective = false;
#if LACKS != 5
  void end_iteration(deepclone::agreement::context& c, std::uint64_t step) const {
    deepclone::agreement::coordinator{}.end_iteration(c, step);
  }
#endif
};
}  // namespace user

using cloning = deepclone::engine<deepclone::inproc::communicator, user::sharding, user::pipeline,
                                  user::reconstruction, user::checksum, user::agreement>;
cloning::settings s;

int main() { return static_cast<int>(s.timeout.count() == 0); }

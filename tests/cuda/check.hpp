#pragma once
// A tiny test harness for the CUDA tests, so that they build and run where doctest is not
// installed (the GPU check machine). Exit codes: 0 passed, 1 failed, 77 skipped (no GPU).
#include <cstdio>
#include <exception>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <deepclone/integrations/cuda.hpp>

namespace dctest {
inline int failures = 0;
inline std::vector<std::pair<const char*, std::function<void()>>>& cases() {
  static std::vector<std::pair<const char*, std::function<void()>>> c;
  return c;
}
struct reg {
  reg(const char* n, std::function<void()> f) { cases().emplace_back(n, std::move(f)); }
};
inline constexpr int skip_code = 77;

/// Runs every registered case; reports "skipped" (exit 77) when there is no usable GPU.
inline int run_all(const char* program) {
  auto g = deepclone::cuda::gpu_status();
  if (!g.usable) {
    std::printf("%s: SKIPPED (%s; cudaError %d)\n", program, g.reason.c_str(), static_cast<int>(g.code));
    return skip_code;
  }
  std::printf("%s: GPU %s\n", program, g.reason.c_str());
  for (auto& [name, f] : cases()) {
    int before = failures;
    std::printf("[ RUN  ] %s\n", name);
    std::fflush(stdout);
    try {
      f();
    } catch (const std::exception& e) {
      std::printf("  exception: %s\n", e.what());
      ++failures;
    }
    std::printf("[ %s ] %s\n", failures == before ? " OK " : "FAIL", name);
  }
  std::printf("%s: %zu cases, %d failed checks\n", program, cases().size(), failures);
  return failures ? 1 : 0;
}
}  // namespace dctest

#define DC_CAT2(a, b) a##b
#define DC_CAT(a, b) DC_CAT2(a, b)
#define TEST(name)                                                         \
  static void DC_CAT(dc_test_, __LINE__)();                                \
  static ::dctest::reg DC_CAT(dc_reg_, __LINE__)(name, &DC_CAT(dc_test_, __LINE__)); \
  static void DC_CAT(dc_test_, __LINE__)()
#define CHECK(cond)                                                                  \
  do {                                                                               \
    if (!(cond)) {                                                                   \
      ++::dctest::failures;                                                          \
      std::printf("  %s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond);         \
    }                                                                                \
  } while (0)
#define CHECK_MSG(cond, ...)                                                         \
  do {                                                                               \
    if (!(cond)) {                                                                   \
      ++::dctest::failures;                                                          \
      std::printf("  %s:%d: CHECK failed: %s: ", __FILE__, __LINE__, #cond);         \
      std::printf(__VA_ARGS__);                                                      \
      std::printf("\n");                                                             \
    }                                                                                \
  } while (0)

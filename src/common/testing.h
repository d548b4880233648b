// Helpers shared by the test suites: fresh random inputs every run (the seed is printed so a failure
// can be replayed with POUNCE_SEED=<seed>), relative errors, and the GPU skip guard.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "common/relative_error.h"
#include "common/require.h"
#include "formats/numerics.h"

namespace pounce::testing {

// A generator seeded from std::random_device, or from $POUNCE_SEED when set. Records the seed in
// the test's output so every failure names the inputs that caused it.
inline std::mt19937_64 fresh_rng() {
  uint64_t seed;
  if (const char* env = std::getenv("POUNCE_SEED")) {
    seed = std::strtoull(env, nullptr, 10);
  } else {
    std::random_device device;
    seed = (uint64_t(device()) << 32) ^ device();
  }
  ::testing::Test::RecordProperty("seed", std::to_string(seed));
  std::printf("[ seed     ] POUNCE_SEED=%llu\n", static_cast<unsigned long long>(seed));
  return std::mt19937_64(seed);
}

// n values uniform in [lo, hi), each rounded to bf16 so device bf16 copies hold exactly these values.
inline std::vector<float> random_bf16_values(std::mt19937_64& rng, size_t n, float lo = -1.0f, float hi = 1.0f) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = formats::round_to_bf16(dist(rng));
  return v;
}

// Scales each block_rows x 128 block of v [rows, cols] by 2^e, e uniform in [-3, 3] (exact in bf16), so
// blockwise FP8 scales differ from block to block: a scale applied to the wrong block, or laid out wrongly,
// then fails a comparison.
inline void spread_blocks(std::mt19937_64& rng, std::vector<float>& v, int64_t rows, int64_t cols, int64_t block_rows) {
  std::uniform_int_distribution<int> e(-3, 3);
  for (int64_t br = 0; br < rows / block_rows; ++br)
    for (int64_t bc = 0; bc < cols / 128; ++bc) {
      const int s = e(rng);
      for (int64_t r = br * block_rows; r < (br + 1) * block_rows; ++r)
        for (int64_t c = bc * 128; c < (bc + 1) * 128; ++c) v[r * cols + c] = std::ldexp(v[r * cols + c], s);
    }
}

inline std::vector<uint16_t> to_bf16_bits(std::span<const float> v) {
  std::vector<uint16_t> bits(v.size());
  for (size_t i = 0; i < v.size(); ++i) bits[i] = formats::bf16_from_float(v[i]);
  return bits;
}

// The relative L2 error of common/relative_error.h, for vectors; a size mismatch fails the test.
template <typename A, typename B>
double relative_l2_error(const std::vector<A>& got, const std::vector<B>& want) {
  EXPECT_EQ(got.size(), want.size());
  if (got.size() != want.size()) return INFINITY;
  return pounce::relative_l2_error(std::span<const A>(got), std::span<const B>(want));
}

// The worst token's relative error (common/relative_error.h) over rows of `row_length` values.
template <typename A, typename B>
double worst_token_error(const std::vector<A>& got, const std::vector<B>& want, size_t row_length) {
  EXPECT_EQ(got.size(), want.size());
  if (got.size() != want.size()) return INFINITY;
  return pounce::worst_row_error(std::span<const A>(got), std::span<const B>(want), row_length);
}

// Tolerances of a bf16 layer against a double-precision reference: bf16 rounding of x, the SwiGLU
// output, the expert outputs and y puts the whole tensor near 3e-3 and the worst token near 5e-3. A
// lost or doubled route puts its token near 1/k or worse (k <= 8 in every real model: >= 0.1).
inline constexpr double kBf16LayerL2 = 1e-2;
inline constexpr double kBf16LayerWorstToken = 3e-2;

// The message of the pounce::Error that f() throws; "(no error)" when it throws none.
template <typename F>
std::string error_message(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

// Test-name generator for value-parameterized suites whose parameter has a PrintTo overload.
struct NameFromPrintTo {
  template <typename Param>
  std::string operator()(const ::testing::TestParamInfo<Param>& info) const {
    std::ostringstream name;
    PrintTo(info.param, &name);
    return name.str();
  }
};

// Expects f() to throw a pounce::Error whose message contains `needle`.
template <typename F>
void expect_error(F&& f, const std::string& needle) {
  const std::string message = error_message(std::forward<F>(f));
  EXPECT_NE(message.find(needle), std::string::npos)
      << "message: " << message << "\nexpected it to contain: " << needle;
}

}  // namespace pounce::testing

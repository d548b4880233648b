// CPU tests of the scalar formats (numerics.h) and the block-scaled formats (blockwise.h). The scalar
// conversions are checked against independent formulations written here (nearest-neighbour search over
// the representable values, double arithmetic), never against themselves.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "common/require.h"
#include "common/testing.h"
#include "formats/blockwise.h"
#include "formats/numerics.h"

namespace pounce::formats {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
const float kNaN = std::numeric_limits<float>::quiet_NaN();

float from_bits(uint32_t u) { return std::bit_cast<float>(u); }
uint32_t bits_of(float f) { return std::bit_cast<uint32_t>(f); }

// Runs fn, expects a pounce::Error whose message contains `mention`.
void expect_error(const std::function<void()>& fn, const std::string& mention) {
  try {
    fn();
    ADD_FAILURE() << "no pounce::Error thrown (expected one mentioning \"" << mention << "\")";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(mention), std::string::npos) << "message: " << e.what();
  }
}

// ---- independent oracles --------------------------------------------------------------------------

// bf16 by comparing distances to the two neighbours in double; the neighbour above the largest finite
// bf16 is Inf, reached at 2^128 as IEEE overflow rounding says.
uint16_t bf16_oracle(float x) {
  if (std::isnan(x)) return kBf16NaN;
  const uint32_t u = bits_of(x);
  const uint32_t sign = u & 0x80000000u, mag = u & 0x7FFFFFFFu;
  if (mag == 0x7F800000u) return uint16_t(u >> 16);
  const uint32_t lo = mag >> 16, hi = lo + 1;
  auto value = [](uint32_t b) { return b == 0x7F80u ? std::ldexp(1.0, 128) : double(from_bits(b << 16)); };
  const double a = std::fabs(double(x)), d_lo = a - value(lo), d_hi = value(hi) - a;
  const uint32_t pick = d_lo < d_hi ? lo : d_hi < d_lo ? hi : ((lo & 1u) ? hi : lo);
  return uint16_t((sign >> 16) | pick);
}

// The 127 non-negative finite E4M3 values, from the format's definition.
std::vector<double> e4m3_values() {
  std::vector<double> v;
  for (int code = 0; code <= 0x7E; ++code) {
    const int exponent = code >> 3, mantissa = code & 7;
    v.push_back(exponent == 0 ? mantissa * std::ldexp(1.0, -9) : (8 + mantissa) * std::ldexp(1.0, exponent - 10));
  }
  return v;
}

// E4M3 by nearest-neighbour search over every finite value, ties to the even code. satfinite: the
// nearest finite value to anything at or above 448 is 448 (decided up front, because at huge
// magnitudes all distances round to the same double).
uint8_t e4m3_oracle(float x) {
  if (std::isnan(x)) return kE4M3NaN;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  const double a = std::fabs(double(x));
  if (a >= 448) return sign | 0x7E;
  static const std::vector<double> values = e4m3_values();
  int best = 0;
  for (int c = 1; c <= 0x7E; ++c) {
    const double d = std::fabs(values[c] - a), d_best = std::fabs(values[best] - a);
    if (d < d_best || (d == d_best && (best & 1))) best = c;
  }
  return sign | uint8_t(best);
}

bool is_e4m3_value(double v) {
  static const std::vector<double> values = e4m3_values();
  for (double x : values)
    if (x == std::fabs(v)) return true;
  return false;
}

// A float with uniformly random sign and mantissa and an exponent uniform in [lo, hi].
float random_float(std::mt19937_64& rng, int lo, int hi) {
  std::uniform_int_distribution<int> exponent(lo, hi);
  const uint32_t mantissa = uint32_t(rng()) & 0x7FFFFFu;
  const float f = std::ldexp(1.0f + std::ldexp(float(mantissa), -23), exponent(rng));
  return (rng() & 1) ? -f : f;
}

// ---- bf16 -----------------------------------------------------------------------------------------

TEST(Bf16, EdgeCases) {
  EXPECT_EQ(bf16_from_float(1.0f), 0x3F80);
  EXPECT_EQ(bf16_from_float(1.0f + 0x1p-8f), 0x3F80);             // tie, kept lsb even: down
  EXPECT_EQ(bf16_from_float(1.0f + 3 * 0x1p-8f), 0x3F82);         // tie, kept lsb odd: up
  EXPECT_EQ(bf16_from_float(1.0f + 0x1p-8f + 0x1p-23f), 0x3F81);  // just above the tie
  EXPECT_EQ(bf16_from_float(from_bits(0x3FFFFFFFu)), 0x4000);     // rounds up into the next binade
  EXPECT_EQ(bf16_from_float(from_bits(0x7F7F0000u)), 0x7F7F);     // largest bf16 stays
  EXPECT_EQ(bf16_from_float(from_bits(0x7F7F7FFFu)), 0x7F7F);
  EXPECT_EQ(bf16_from_float(from_bits(0x7F7F8000u)), 0x7F80);  // tie at the top: to Inf (even)
  EXPECT_EQ(bf16_from_float(std::numeric_limits<float>::max()), 0x7F80);
  EXPECT_EQ(bf16_from_float(-std::numeric_limits<float>::max()), 0xFF80);
  EXPECT_EQ(bf16_from_float(kInf), 0x7F80);
  EXPECT_EQ(bf16_from_float(-kInf), 0xFF80);
  EXPECT_EQ(bf16_from_float(kNaN), kBf16NaN);
  EXPECT_EQ(bf16_from_float(-kNaN), kBf16NaN);
  EXPECT_EQ(bf16_from_float(from_bits(0x7F800001u)), kBf16NaN);  // signalling NaN must not become Inf
  EXPECT_EQ(bf16_from_float(from_bits(0xFFFFFFFFu)), kBf16NaN);
  EXPECT_EQ(bf16_from_float(0.0f), 0x0000);
  EXPECT_EQ(bf16_from_float(-0.0f), 0x8000);
  EXPECT_EQ(bf16_from_float(from_bits(0x00008000u)), 0x0000);  // subnormal tie to 0
  EXPECT_EQ(bf16_from_float(from_bits(0x80008000u)), 0x8000);
  EXPECT_EQ(bf16_from_float(from_bits(0x00008001u)), 0x0001);
  EXPECT_EQ(bf16_from_float(from_bits(0x00018000u)), 0x0002);  // subnormal tie, odd: up
  EXPECT_EQ(bf16_from_float(from_bits(0x807FFFFFu)), 0x8080);  // largest subnormal -> min normal
  EXPECT_EQ(bits_of(bf16_to_float(0x0001)), 0x00010000u);      // 2^-133
  EXPECT_EQ(bf16_to_float(0x0001), 0x1p-133f);
  EXPECT_EQ(bits_of(bf16_to_float(0x8000)), 0x80000000u);
  EXPECT_TRUE(std::isnan(bf16_to_float(kBf16NaN)));
  EXPECT_EQ(bf16_to_float(0xFF80), -kInf);
  EXPECT_EQ(round_to_bf16(1.0f + 3 * 0x1p-8f), 1.0f + 0x1p-6f);
}

TEST(Bf16, MatchesDoubleOracleOnRandomFloats) {
  auto rng = testing::fresh_rng();
  for (int i = 0; i < 2'000'000; ++i) {
    // Half uniform over all bit patterns (every class), half exact ties (low 16 bits 0x8000).
    uint32_t u = uint32_t(rng());
    if (i & 1) u = (u & 0xFFFF0000u) | 0x8000u;
    const float x = from_bits(u);
    ASSERT_EQ(bf16_from_float(x), bf16_oracle(x)) << "bits 0x" << std::hex << u;
    if (!std::isnan(x)) {
      ASSERT_EQ(bits_of(round_to_bf16(x)), uint32_t(bf16_oracle(x)) << 16) << "bits 0x" << std::hex << u;
    }
  }
}

TEST(Bf16, EveryBf16RoundTrips) {
  for (uint32_t b = 0; b <= 0xFFFF; ++b) {
    const float f = bf16_to_float(uint16_t(b));
    const uint16_t expected = std::isnan(f) ? kBf16NaN : uint16_t(b);
    ASSERT_EQ(bf16_from_float(f), expected) << "bf16 0x" << std::hex << b;
  }
}

// ---- E4M3 -----------------------------------------------------------------------------------------

TEST(E4M3, EveryCodeRoundTrips) {
  for (int code = 0; code < 256; ++code) {
    const float f = e4m3_to_float(uint8_t(code));
    if ((code & 0x7F) == 0x7F) {
      EXPECT_TRUE(std::isnan(f)) << "code 0x" << std::hex << code;
      EXPECT_EQ(e4m3_from_float(f), kE4M3NaN);
    } else {
      EXPECT_EQ(e4m3_from_float(f), code) << "value " << f;
      EXPECT_EQ(std::signbit(f), code >= 0x80) << "code 0x" << std::hex << code;
    }
  }
  // Positive codes increase strictly with the value (the encoding is monotonic).
  for (int code = 1; code <= 0x7E; ++code) EXPECT_LT(e4m3_to_float(uint8_t(code - 1)), e4m3_to_float(uint8_t(code)));
}

TEST(E4M3, DecodesKnownValues) {
  EXPECT_EQ(e4m3_to_float(0x7E), 448.0f);
  EXPECT_EQ(e4m3_to_float(0xFE), -448.0f);
  EXPECT_EQ(e4m3_to_float(0x01), 0x1p-9f);
  EXPECT_EQ(e4m3_to_float(0x07), 7 * 0x1p-9f);
  EXPECT_EQ(e4m3_to_float(0x08), 0x1p-6f);
  EXPECT_EQ(e4m3_to_float(0x38), 1.0f);
  EXPECT_EQ(e4m3_to_float(0x39), 1.125f);
  EXPECT_EQ(e4m3_to_float(0x00), 0.0f);
  EXPECT_TRUE(std::signbit(e4m3_to_float(0x80)));
  EXPECT_TRUE(std::isnan(e4m3_to_float(0x7F)));
  EXPECT_TRUE(std::isnan(e4m3_to_float(0xFF)));
}

TEST(E4M3, EdgeCases) {
  struct Case {
    float x;
    uint8_t code;
  };
  const Case cases[] = {
      {448.0f, 0x7E},
      {449.0f, 0x7E},
      {463.99f, 0x7E},
      {464.0f, 0x7E},
      {480.0f, 0x7E},
      {1e9f, 0x7E},
      {std::numeric_limits<float>::max(), 0x7E},
      {kInf, 0x7E},
      {-kInf, 0xFE},
      {-464.0f, 0xFE},
      {-1e9f, 0xFE},
      {kNaN, 0x7F},
      {-kNaN, 0x7F},
      {from_bits(0x7F800001u), 0x7F},
      {0x1p-9f, 0x01},              // smallest subnormal
      {0x1p-10f, 0x00},             // tie between 0 and 2^-9: to 0 (even)
      {-0x1p-10f, 0x80},            // keeps the sign
      {0x1p-10f + 0x1p-30f, 0x01},  // just above the tie
      {1.5f * 0x1p-10f, 0x01},      // 0.75 quanta
      {3 * 0x1p-10f, 0x02},         // tie between codes 1 and 2: to 2
      {5 * 0x1p-10f, 0x02},         // tie between codes 2 and 3: to 2
      {0x1p-149f, 0x00},
      {-0x1p-149f, 0x80},
      {0x1p-20f, 0x00},
      {0.0f, 0x00},
      {-0.0f, 0x80},
      {7 * 0x1p-9f, 0x07},     // largest subnormal
      {7.5f * 0x1p-9f, 0x08},  // tie, odd: rounds up into the normal range
      {0x1p-6f, 0x08},         // smallest normal
      {1.0f, 0x38},
      {1.0625f, 0x38},  // tie 1 / 1.125: to 1 (even)
      {1.1875f, 0x3A},  // tie 1.125 / 1.25: to 1.25 (even)
      {1.9375f, 0x40},  // tie 1.875 / 2: up into the next binade
      {-1.9375f, 0xC0},
      {400.0f, 0x7C},  // tie 384 / 416: to 384 (even)
      {432.0f, 0x7E},  // tie 416 / 448: to 448 (even)
      {431.99f, 0x7D},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(e4m3_from_float(c.x), c.code) << "x = " << c.x << " (bits 0x" << std::hex << bits_of(c.x) << ")";
    EXPECT_EQ(e4m3_oracle(c.x), c.code) << "oracle disagrees with the table at x = " << c.x;
  }
}

TEST(E4M3, EveryMidpointRoundsToEven) {
  const std::vector<double> values = e4m3_values();
  for (int c = 0; c + 1 <= 0x7E; ++c) {
    const float mid = float((values[c] + values[c + 1]) / 2);  // exact: 5 significant bits at most
    ASSERT_EQ(double(mid), (values[c] + values[c + 1]) / 2);
    const uint8_t even = (c & 1) ? uint8_t(c + 1) : uint8_t(c);
    EXPECT_EQ(e4m3_from_float(mid), even) << "midpoint " << mid;
    EXPECT_EQ(e4m3_from_float(-mid), 0x80 | even) << "midpoint " << -mid;
    EXPECT_EQ(e4m3_from_float(std::nextafter(mid, 0.0f)), c) << "just below " << mid;
    EXPECT_EQ(e4m3_from_float(std::nextafter(mid, kInf)), c + 1) << "just above " << mid;
  }
}

TEST(E4M3, MatchesNearestSearchOnRandomFloats) {
  auto rng = testing::fresh_rng();
  for (int i = 0; i < 300'000; ++i) {
    const float x = random_float(rng, -14, 10);
    ASSERT_EQ(e4m3_from_float(x), e4m3_oracle(x)) << "x = " << x << " (bits 0x" << std::hex << bits_of(x) << ")";
  }
}

// ---- E8M0 -----------------------------------------------------------------------------------------

TEST(E8M0, EncodesAndDecodesTheWholeRange) {
  for (int e = kE8M0MinExponent; e <= kE8M0MaxExponent; ++e) {
    const uint8_t bits = e8m0_from_exponent(e);
    EXPECT_EQ(bits, e + 127);
    EXPECT_EQ(e8m0_to_exponent(bits), e);
    EXPECT_EQ(double(e8m0_to_float(bits)), std::ldexp(1.0, e)) << "exponent " << e;
  }
  EXPECT_EQ(e8m0_from_exponent(-127), 0x00);
  EXPECT_EQ(e8m0_from_exponent(0), 0x7F);
  EXPECT_EQ(e8m0_from_exponent(127), 0xFE);
  EXPECT_EQ(bits_of(e8m0_to_float(0x00)), 0x00400000u);  // 2^-127, a float subnormal
  EXPECT_TRUE(std::isnan(e8m0_to_float(kE8M0NaN)));
}

TEST(E8M0, RejectsOutOfRangeAndNaN) {
  expect_error([] { e8m0_from_exponent(128); }, "128");
  expect_error([] { e8m0_from_exponent(-128); }, "-128");
  expect_error([] { e8m0_from_exponent(1000); }, "out of range");
  expect_error([] { e8m0_to_exponent(kE8M0NaN); }, "NaN");
}

// ---- scale exponents ------------------------------------------------------------------------------

TEST(ScaleExponent, BlockwiseCeilRule) {
  for (int e = -100; e <= 100; ++e) {
    const float exact = std::ldexp(448.0f, e);
    EXPECT_EQ(blockwise_scale_exponent(exact), e) << "amax = 448 * 2^" << e;
    EXPECT_EQ(blockwise_scale_exponent(std::nextafter(exact, kInf)), e + 1) << "just above 448 * 2^" << e;
    EXPECT_EQ(blockwise_scale_exponent(std::nextafter(exact, 0.0f)), e) << "just below 448 * 2^" << e;
    EXPECT_EQ(blockwise_scale_exponent(std::ldexp(224.0f, e)), e - 1);
  }
  EXPECT_EQ(blockwise_scale_exponent(1.0f), -8);  // 1 <= 448 * 2^-8 = 1.75, 1 > 0.875
  EXPECT_EQ(blockwise_scale_exponent(1.75f), -8);
  EXPECT_EQ(blockwise_scale_exponent(1.76f), -7);
  EXPECT_EQ(blockwise_scale_exponent(0.0f), 0);
  EXPECT_EQ(blockwise_scale_exponent(-0.0f), 0);
  EXPECT_EQ(blockwise_scale_exponent(kNaN), 0);
  EXPECT_EQ(blockwise_scale_exponent(kInf), 0);
  EXPECT_EQ(blockwise_scale_exponent(std::numeric_limits<float>::max()), 120);  // 2^128 <= 448 * 2^120
  EXPECT_EQ(blockwise_scale_exponent(std::ldexp(448.0f, -127)), -127);
  EXPECT_EQ(blockwise_scale_exponent(std::ldexp(449.0f, -128)), -127);
  EXPECT_EQ(blockwise_scale_exponent(std::ldexp(448.0f, -128)), -127);  // clamped (would be -128)
  EXPECT_EQ(blockwise_scale_exponent(0x1p-149f), -127);                 // clamped (would be -157)
  expect_error([] { blockwise_scale_exponent(-1.0f); }, "negative");
}

TEST(ScaleExponent, BlockwiseIsTheSmallestSufficientPowerOfTwo) {
  auto rng = testing::fresh_rng();
  for (int i = 0; i < 100'000; ++i) {
    const float amax = std::fabs(random_float(rng, -115, 127));
    const int e = blockwise_scale_exponent(amax);
    ASSERT_LE(double(amax), std::ldexp(448.0, e)) << "amax " << amax;
    ASSERT_GT(double(amax), std::ldexp(448.0, e - 1)) << "amax " << amax;
  }
}

TEST(ScaleExponent, MxFloorRule) {
  EXPECT_EQ(mx_scale_exponent(448.0f), 0);
  EXPECT_EQ(mx_scale_exponent(256.0f), 0);
  EXPECT_EQ(mx_scale_exponent(511.99f), 0);
  EXPECT_EQ(mx_scale_exponent(512.0f), 1);
  EXPECT_EQ(mx_scale_exponent(255.99f), -1);
  EXPECT_EQ(mx_scale_exponent(1.0f), -8);
  EXPECT_EQ(mx_scale_exponent(0.0f), 0);
  EXPECT_EQ(mx_scale_exponent(kNaN), 0);
  EXPECT_EQ(mx_scale_exponent(-kInf), 0);
  EXPECT_EQ(mx_scale_exponent(std::numeric_limits<float>::max()), 119);
  EXPECT_EQ(mx_scale_exponent(0x1p-119f), -127);
  EXPECT_EQ(mx_scale_exponent(0x1p-120f), -127);  // clamped (would be -128)
  EXPECT_EQ(mx_scale_exponent(0x1p-149f), -127);  // subnormal, clamped
  expect_error([] { mx_scale_exponent(-2.0f); }, "negative");
  auto rng = testing::fresh_rng();
  for (int i = 0; i < 100'000; ++i) {
    const float amax = std::fabs(random_float(rng, -119, 127));
    const int e = mx_scale_exponent(amax);
    ASSERT_LE(std::ldexp(1.0, e + 8), double(amax)) << "amax " << amax;
    ASSERT_LT(double(amax), std::ldexp(1.0, e + 9)) << "amax " << amax;
  }
}

// ---- block quantizers -----------------------------------------------------------------------------

// rows x cols random bf16 values whose magnitude changes by 2^[-40, 40] from block to block of
// block_cols, so every block picks a different scale.
std::vector<float> varied_matrix(std::mt19937_64& rng, int64_t rows, int64_t cols, int64_t block_cols) {
  std::vector<float> x = testing::random_bf16_values(rng, size_t(rows * cols));
  std::uniform_int_distribution<int> shift(-40, 40);
  for (int64_t i = 0; i < rows * cols; i += block_cols) {
    const int s = shift(rng);
    for (int64_t j = i; j < i + block_cols; ++j) x[j] = std::ldexp(x[j], s);
  }
  return x;
}

// Every element is within half an E4M3 step of its input: relative 2^-4 in the normal range, absolute
// 2^-10 * scale below it. Finite inputs only.
void expect_within_e4m3_rounding(const std::vector<float>& x, const std::vector<float>& y,
                                 const std::function<float(int64_t)>& scale_of) {
  ASSERT_EQ(x.size(), y.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double scale = scale_of(int64_t(i)), err = std::fabs(double(y[i]) - double(x[i]));
    if (std::fabs(x[i]) >= 0x1p-6 * scale)
      ASSERT_LE(err, 0x1p-4 * std::fabs(double(x[i]))) << "element " << i << ": " << x[i] << " -> " << y[i];
    else
      ASSERT_LE(err, 0x1p-10 * scale) << "element " << i << ": " << x[i] << " -> " << y[i];
  }
}

float block_amax(const std::vector<float>& x, int64_t cols, int64_t r0, int64_t c0, int64_t nr, int64_t nc) {
  float m = 0;
  for (int64_t r = r0; r < r0 + nr; ++r)
    for (int64_t c = c0; c < c0 + nc; ++c)
      if (std::isfinite(x[r * cols + c])) m = std::max(m, std::fabs(x[r * cols + c]));
  return m;
}

TEST(Quantize1x128, RandomDataScalesAndErrorBounds) {
  auto rng = testing::fresh_rng();
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{1, 128}, {7, 512}, {33, 1024}}) {
    const std::vector<float> x = varied_matrix(rng, rows, cols, 128);
    const Fp8Rows1x128 q = quantize_1x128(x, rows, cols);
    ASSERT_EQ(q.rows, rows);
    ASSERT_EQ(q.cols, cols);
    ASSERT_EQ(q.data.size(), size_t(rows * cols));
    ASSERT_EQ(q.scales.size(), size_t(rows * cols / 128));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t b = 0; b < cols / 128; ++b) {
        const float amax = block_amax(x, cols, r, b * 128, 1, 128);
        const double scale = q.scales[r * (cols / 128) + b];
        EXPECT_LE(double(amax), 448.0 * scale);  // never saturates
        EXPECT_GT(double(amax), 224.0 * scale);  // and uses the top binade
        for (int64_t c = b * 128; c < (b + 1) * 128; ++c)
          ASSERT_EQ(q.data[r * cols + c], e4m3_oracle(float(double(x[r * cols + c]) / scale)));
      }
    const std::vector<float> y = dequantize(q);
    expect_within_e4m3_rounding(x, y, [&](int64_t i) { return q.scales[i / 128]; });
    const std::vector<float> by_block = scales_k_block_major(q);
    ASSERT_EQ(by_block.size(), q.scales.size());
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t b = 0; b < cols / 128; ++b) ASSERT_EQ(by_block[b * rows + r], q.scales[r * (cols / 128) + b]);
  }
}

TEST(Quantize1x128, ZeroNaNAndInfBlocks) {
  auto rng = testing::fresh_rng();
  std::vector<float> x = testing::random_bf16_values(rng, 4 * 128, -3.0f, 3.0f);
  for (int i = 0; i < 128; ++i) x[i] = (i & 1) ? -0.0f : 0.0f;  // block 0: zeros, some negative
  x[128 + 5] = kNaN;                                            // block 1: NaN and Inf among data
  x[128 + 6] = kInf;
  x[128 + 7] = -kInf;
  x[128 + 8] = 100.0f;                          // the finite amax
  for (int i = 256; i < 384; ++i) x[i] = 0.0f;  // block 2: only non-finite and zeros
  x[256] = kNaN;
  x[257] = -kInf;
  const Fp8Rows1x128 q = quantize_1x128(x, 1, 512);

  EXPECT_EQ(q.scales[0], 1.0f);
  for (int i = 0; i < 128; ++i) EXPECT_EQ(q.data[i], (i & 1) ? 0x80 : 0x00) << i;

  EXPECT_EQ(q.scales[1], std::ldexp(1.0f, blockwise_scale_exponent(100.0f)));
  EXPECT_EQ(q.scales[1], 0.25f);  // 100 <= 448 / 4, 100 > 448 / 8
  EXPECT_EQ(q.data[128 + 5], kE4M3NaN);
  EXPECT_EQ(q.data[128 + 6], 0x7E);
  EXPECT_EQ(q.data[128 + 7], 0xFE);
  EXPECT_EQ(q.data[128 + 8], e4m3_oracle(400.0f));

  EXPECT_EQ(q.scales[2], 1.0f);
  EXPECT_EQ(q.data[256], kE4M3NaN);
  EXPECT_EQ(q.data[257], 0xFE);

  const std::vector<float> y = dequantize(q);
  EXPECT_TRUE(std::isnan(y[128 + 5]));
  EXPECT_EQ(y[128 + 6], 448.0f * 0.25f);
  EXPECT_EQ(y[257], -448.0f);
}

TEST(Quantize1x128, TinyAndHugeBlocksClampOrStayExact) {
  // Subnormal floats: the exponent clamps at -127, and 2^-127 * e4m3 still carries the values.
  std::vector<float> x(256);
  for (int i = 0; i < 128; ++i) x[i] = std::ldexp(float(i % 8), -130);  // up to 7 * 2^-130
  for (int i = 128; i < 256; ++i) x[i] = (i % 2 ? -1.0f : 1.0f) * std::ldexp(float(1 + i % 16), 120);
  const Fp8Rows1x128 q = quantize_1x128(x, 1, 256);
  EXPECT_EQ(bits_of(q.scales[0]), 0x00400000u);  // 2^-127
  EXPECT_EQ(q.scales[1], std::ldexp(1.0f, blockwise_scale_exponent(16 * 0x1p120f)));
  const std::vector<float> y = dequantize(q);
  for (int i = 0; i < 256; ++i) EXPECT_EQ(y[i], x[i]) << "element " << i;  // all exactly representable
}

TEST(Quantize128x128, SeveralBlocks) {
  auto rng = testing::fresh_rng();
  const int64_t rows = 384, cols = 256;
  std::vector<float> x = testing::random_bf16_values(rng, size_t(rows * cols));
  std::uniform_int_distribution<int> shift(-30, 30);
  for (int64_t br = 0; br < 3; ++br)
    for (int64_t bc = 0; bc < 2; ++bc) {
      const int s = shift(rng);
      for (int64_t r = br * 128; r < (br + 1) * 128; ++r)
        for (int64_t c = bc * 128; c < (bc + 1) * 128; ++c) x[r * cols + c] = std::ldexp(x[r * cols + c], s);
    }
  const Fp8Blocks128x128 q = quantize_128x128(x, rows, cols);
  ASSERT_EQ(q.scales.size(), 6u);
  for (int64_t br = 0; br < 3; ++br)
    for (int64_t bc = 0; bc < 2; ++bc) {
      const float amax = block_amax(x, cols, br * 128, bc * 128, 128, 128);
      EXPECT_EQ(q.scales[br * 2 + bc], std::ldexp(1.0f, blockwise_scale_exponent(amax))) << br << "," << bc;
    }
  const std::vector<float> y = dequantize(q);
  expect_within_e4m3_rounding(x, y, [&](int64_t i) { return q.scales[(i / cols / 128) * 2 + (i % cols) / 128]; });
  EXPECT_LT(testing::relative_l2_error(y, x), 0x1p-4);
}

// Square blocks whose scales depend on their amax alone: quantizing the transposed matrices gives the
// transposed quantized ones, bit for bit (the backward's weights in their second orientation).
TEST(Quantize128x128, TransposingCommutesWithQuantizing) {
  auto rng = testing::fresh_rng();
  const int64_t matrices = 2, rows = 256, cols = 384;
  std::vector<float> x = testing::random_bf16_values(rng, size_t(matrices * rows * cols));
  // Every block its own magnitude, so that its scale differs from its neighbours': a scale array left
  // untransposed, or transposed wrongly, no longer matches.
  std::uniform_int_distribution<int> shift(-20, 20);
  for (int64_t block = 0; block < matrices * rows / 128; ++block)
    for (int64_t bc = 0; bc < cols / 128; ++bc) {
      const int s = shift(rng);
      for (int64_t r = block * 128; r < (block + 1) * 128; ++r)
        for (int64_t c = bc * 128; c < (bc + 1) * 128; ++c) x[r * cols + c] = std::ldexp(x[r * cols + c], s);
    }
  std::vector<float> xt(x.size());
  for (int64_t m = 0; m < matrices; ++m)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) xt[(m * cols + c) * rows + r] = x[(m * rows + r) * cols + c];
  const Fp8Blocks128x128 transposed = transpose_128x128(quantize_128x128(x, matrices * rows, cols), matrices);
  const Fp8Blocks128x128 direct = quantize_128x128(xt, matrices * cols, rows);
  EXPECT_EQ(transposed.rows, direct.rows);
  EXPECT_EQ(transposed.cols, direct.cols);
  EXPECT_EQ(transposed.data, direct.data);
  EXPECT_EQ(transposed.scales, direct.scales);
  EXPECT_GT(std::set<float>(direct.scales.begin(), direct.scales.end()).size(), direct.scales.size() / 2)
      << "the blocks' scales must differ for the comparison to mean anything";
  EXPECT_THROW(transpose_128x128(direct, 5), Error);
}

TEST(QuantizeMxfp8, RandomDataScalesAndErrorBounds) {
  auto rng = testing::fresh_rng();
  const int64_t rows = 17, cols = 320;
  const std::vector<float> x = varied_matrix(rng, rows, cols, 32);
  const Mxfp8 q = quantize_mxfp8(x, rows, cols);
  ASSERT_EQ(q.scales.size(), size_t(rows * cols / 32));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < cols / 32; ++b) {
      const float amax = block_amax(x, cols, r, b * 32, 1, 32);
      const int e = e8m0_to_exponent(q.scales[r * (cols / 32) + b]);
      EXPECT_EQ(e, mx_scale_exponent(amax));
      for (int64_t c = b * 32; c < (b + 1) * 32; ++c)
        ASSERT_EQ(q.data[r * cols + c], e4m3_oracle(float(std::ldexp(double(x[r * cols + c]), -e))));
    }
  // Within rounding except where the top binade clipped to 448: there |y| <= |x| and the loss < 1/8.
  const std::vector<float> y = dequantize(q);
  for (size_t i = 0; i < x.size(); ++i) {
    const double scale = e8m0_to_float(q.scales[i / 32]);
    if (std::fabs(x[i]) > 464 * scale) {
      EXPECT_EQ(std::fabs(y[i]), 448 * scale);
      EXPECT_LT(std::fabs(double(x[i]) - y[i]), std::fabs(double(x[i])) / 8);
    } else if (std::fabs(x[i]) >= 0x1p-6 * scale) {
      ASSERT_LE(std::fabs(double(y[i]) - x[i]), 0x1p-4 * std::fabs(double(x[i]))) << i;
    } else {
      ASSERT_LE(std::fabs(double(y[i]) - x[i]), 0x1p-10 * scale) << i;
    }
  }
}

TEST(QuantizeMxfp8, SaturatesTheTopBinade) {
  std::vector<float> x(64, 1.0f);
  x[0] = 500.0f;  // amax in [256, 512): e = 0, and 500 clips to 448
  x[1] = -470.0f;
  x[2] = 460.0f;                           // rounds to 448 anyway
  x[3] = 300.0f;                           // 288 (quantum 32 in [256, 512))
  x[4] = kInf;                             // ignored by amax, saturates
  for (int i = 32; i < 64; ++i) x[i] = 0;  // block 1: tiny values, e = -118 - 8 = -126
  x[32] = 0x1p-140f;                       // 2^-140 / 2^-126 = 2^-14 flushes to 0
  x[33] = -0x1p-118f;                      // 2^-118 / 2^-126 = 2^8
  const Mxfp8 q = quantize_mxfp8(x, 1, 64);
  EXPECT_EQ(q.scales[0], 127);
  EXPECT_EQ(q.data[0], 0x7E);
  EXPECT_EQ(q.data[1], 0xFE);
  EXPECT_EQ(q.data[2], 0x7E);
  EXPECT_EQ(q.data[3], e4m3_oracle(300.0f));
  EXPECT_EQ(e4m3_to_float(q.data[3]), 288.0f);
  EXPECT_EQ(q.data[4], 0x7E);
  EXPECT_EQ(q.data[5], 0x38);
  EXPECT_EQ(e8m0_to_exponent(q.scales[1]), mx_scale_exponent(0x1p-118f));
  EXPECT_EQ(e8m0_to_exponent(q.scales[1]), -126);  // floor(log2 2^-118) - 8
  EXPECT_EQ(q.data[32], 0x00);
  EXPECT_EQ(q.data[33], e4m3_oracle(-256.0f));  // -2^-118 / 2^-126 = -256
}

TEST(QuantizeMxfp8, ClampsTinyBlocksAndKeepsNaN) {
  std::vector<float> x(32, 0x1p-125f);  // floor(log2) - 8 = -133: clamped to -127
  x[1] = kNaN;
  x[2] = -0x1p-136f;  // 2^-136 / 2^-127 = 2^-9: the smallest subnormal
  const Mxfp8 q = quantize_mxfp8(x, 1, 32);
  EXPECT_EQ(q.scales[0], 0x00);
  EXPECT_EQ(q.data[0], e4m3_oracle(4.0f));
  EXPECT_EQ(q.data[1], kE4M3NaN);
  EXPECT_EQ(q.data[2], 0x81);
  const std::vector<float> y = dequantize(q);
  EXPECT_EQ(y[0], x[0]);
  EXPECT_EQ(y[2], x[2]);
  EXPECT_TRUE(std::isnan(y[1]));
}

TEST(BlockFormats, RejectBadShapes) {
  const std::vector<float> x(256 * 128, 1.0f);
  expect_error([&] { quantize_1x128(std::span(x).first(100), 1, 100); }, "cols = 100");
  expect_error([&] { quantize_1x128(x, 2, 128); }, "x holds");
  expect_error([&] { quantize_1x128(x, -1, 128); }, "negative");
  expect_error([&] { quantize_128x128(std::span(x).first(100 * 128), 100, 128); }, "rows = 100");
  expect_error([&] { quantize_128x128(x, 128, 128); }, "x holds");
  expect_error([&] { quantize_mxfp8(std::span(x).first(48), 1, 48); }, "cols = 48");
  expect_error([&] { quantize_mxfp8(x, 1, 32); }, "x holds");

  Fp8Rows1x128 q = quantize_1x128(x, 256, 128);
  q.scales.pop_back();
  expect_error([&] { dequantize(q); }, "scales holds");
  Mxfp8 mx = quantize_mxfp8(std::span(x).first(32), 1, 32);
  expect_error([&] { reencode_mxfp8_to_1x128(mx, nullptr); }, "cols = 32");
  mx = quantize_mxfp8(std::span(x).first(128), 1, 128);
  mx.data.pop_back();
  expect_error([&] { dequantize(mx); }, "data holds");
  expect_error([&] { reencode_mxfp8_to_1x128(mx, nullptr); }, "data holds");
  mx = quantize_mxfp8(std::span(x).first(128), 1, 128);
  mx.scales[2] = kE8M0NaN;
  expect_error([&] { reencode_mxfp8_to_1x128(mx, nullptr); }, "32-block 2");
  EXPECT_TRUE(std::isnan(dequantize(mx)[64]));  // a NaN scale makes its block NaN
}

TEST(BlockFormats, EmptyMatrices) {
  const std::vector<float> none;
  EXPECT_TRUE(quantize_1x128(none, 0, 128).data.empty());
  EXPECT_TRUE(quantize_128x128(none, 0, 128).scales.empty());
  EXPECT_TRUE(quantize_mxfp8(none, 3, 0).scales.empty());
}

// ---- MXFP8 -> 1x128 re-encoding -------------------------------------------------------------------

// The report recomputed from the definitions: the rescaled value of each element is exact in double; it
// survives iff it is an E4M3 value, and it is flushed iff it is nonzero and at most 2^-10 (the tie
// between 0 and the smallest subnormal goes to 0).
ReencodeReport brute_force_report(const Mxfp8& mx) {
  ReencodeReport r;
  r.elements = mx.rows * mx.cols;
  double err2 = 0, ref2 = 0;
  for (int64_t row = 0; row < mx.rows; ++row)
    for (int64_t b = 0; b < mx.cols / 128; ++b) {
      int S = -1000;
      for (int j = 0; j < 4; ++j) S = std::max(S, e8m0_to_exponent(mx.scales[row * (mx.cols / 32) + b * 4 + j]));
      for (int64_t c = b * 128; c < (b + 1) * 128; ++c) {
        const int64_t i = row * mx.cols + c;
        const int s = e8m0_to_exponent(mx.scales[i / 32]);
        const double v = std::ldexp(double(e4m3_to_float(mx.data[i])), s);
        if (std::isnan(v)) continue;
        const double rescaled = std::ldexp(v, -S);
        double after = v;
        if (!is_e4m3_value(rescaled)) {
          after = std::ldexp(double(e4m3_to_float(e4m3_oracle(float(rescaled)))), S);
          ++r.changed;
          if (std::fabs(rescaled) <= 0x1p-10) ++r.flushed_to_zero;
        }
        r.max_abs_error = std::max(r.max_abs_error, std::fabs(after - v));
        err2 += (after - v) * (after - v);
        ref2 += v * v;
      }
    }
  r.relative_l2_error = ref2 > 0 ? std::sqrt(err2 / ref2) : 0;
  return r;
}

TEST(Reencode, EqualExponentsAreExact) {
  auto rng = testing::fresh_rng();
  const int64_t rows = 5, cols = 384;
  std::vector<float> x = testing::random_bf16_values(rng, size_t(rows * cols));
  std::uniform_int_distribution<int> shift(-60, 60);
  for (int64_t b = 0; b < rows * cols / 128; ++b) {
    const int s = shift(rng);
    for (int64_t i = b * 128; i < (b + 1) * 128; ++i) x[i] = std::ldexp(x[i], s);
    for (int j = 0; j < 4; ++j) x[b * 128 + j * 32] = std::ldexp(1.5f, s);  // same amax in all four
  }
  x[7] = kNaN;
  const Mxfp8 mx = quantize_mxfp8(x, rows, cols);
  ReencodeReport report;
  report.changed = -1;
  const Fp8Rows1x128 q = reencode_mxfp8_to_1x128(mx, &report);
  EXPECT_EQ(report.elements, rows * cols);
  EXPECT_EQ(report.changed, 0);
  EXPECT_EQ(report.flushed_to_zero, 0);
  EXPECT_EQ(report.max_abs_error, 0.0);
  EXPECT_EQ(report.relative_l2_error, 0.0);
  EXPECT_EQ(q.data, mx.data);
  for (int64_t b = 0; b < rows * cols / 128; ++b)
    EXPECT_EQ(q.scales[b], e8m0_to_float(mx.scales[b * 4])) << "block " << b;
  const std::vector<float> a = dequantize(q), m = dequantize(mx);
  for (size_t i = 0; i < a.size(); ++i)
    if (i != 7) {
      ASSERT_EQ(a[i], m[i]) << i;
    }
  EXPECT_TRUE(std::isnan(a[7]));
}

TEST(Reencode, DistantExponentsFlushSmallElements) {
  auto rng = testing::fresh_rng();
  const int64_t rows = 9, cols = 512;
  std::vector<float> x = testing::random_bf16_values(rng, size_t(rows * cols));
  std::uniform_int_distribution<int> shift(-12, 12);
  for (int64_t i = 0; i < rows * cols; i += 32) {
    const int s = shift(rng);
    for (int64_t j = i; j < i + 32; ++j) x[j] = std::ldexp(x[j], s);
  }
  x[40] = kNaN;
  x[41] = -kInf;
  const Mxfp8 mx = quantize_mxfp8(x, rows, cols);
  ReencodeReport report;
  const Fp8Rows1x128 q = reencode_mxfp8_to_1x128(mx, &report);
  const ReencodeReport want = brute_force_report(mx);

  EXPECT_GT(want.changed, 0);  // the setup really exercises the lossy path
  EXPECT_GT(want.flushed_to_zero, 0);
  EXPECT_EQ(report.elements, want.elements);
  EXPECT_EQ(report.changed, want.changed);
  EXPECT_EQ(report.flushed_to_zero, want.flushed_to_zero);
  EXPECT_EQ(report.max_abs_error, want.max_abs_error);
  EXPECT_NEAR(report.relative_l2_error, want.relative_l2_error, 1e-12 * want.relative_l2_error);

  // The result is a valid 1x128 encoding whose scale is the largest of the four, and it agrees with the
  // report computed directly from the two dequantized tensors.
  const std::vector<float> a = dequantize(q), m = dequantize(mx);
  int64_t changed = 0, flushed = 0;
  double err2 = 0, ref2 = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (i == 40) {
      EXPECT_EQ(q.data[i], kE4M3NaN);
      continue;
    }
    changed += a[i] != m[i];
    flushed += m[i] != 0 && a[i] == 0;
    err2 += (double(a[i]) - m[i]) * (double(a[i]) - m[i]);
    ref2 += double(m[i]) * m[i];
  }
  EXPECT_EQ(report.changed, changed);
  EXPECT_EQ(report.flushed_to_zero, flushed);
  EXPECT_NEAR(report.relative_l2_error, std::sqrt(err2 / ref2), 1e-9 * report.relative_l2_error);
  for (int64_t b = 0; b < rows * cols / 128; ++b) {
    int S = -1000;
    for (int j = 0; j < 4; ++j) S = std::max(S, e8m0_to_exponent(mx.scales[b * 4 + j]));
    EXPECT_EQ(q.scales[b], std::ldexp(1.0f, S));
  }
}

TEST(Reencode, HandPickedFlush) {
  // One 128-block: sub-block 0 has exponent 10, sub-block 1 exponent 0, sub-blocks 2 and 3 exponent -2.
  std::vector<uint8_t> data(128, 0x00);
  data[0] = 0x38;   // 1.0 * 2^10
  data[32] = 0x01;  // 2^-9  * 2^0  -> 2^-19 at scale 2^10: flushed
  data[33] = 0x7E;  // 448 * 2^0    -> 448 * 2^-10 = 0.4375: exact
  data[34] = 0x3F;  // 1.875 * 2^0  -> 1.875 * 2^-10 = 0.9375 * 2^-9: rounds to 2^-9, changed
  data[35] = 0xB8;  // -1 * 2^0     -> -2^-10: the tie, flushed to -0
  data[64] = 0x50;  // 8 * 2^-2     -> 2 * 2^-10 = 2^-9: exact (a subnormal)
  data[96] = kE4M3NaN;
  Mxfp8 mx{
      1, 128, data, {e8m0_from_exponent(10), e8m0_from_exponent(0), e8m0_from_exponent(-2), e8m0_from_exponent(-2)}};
  ReencodeReport report;
  const Fp8Rows1x128 q = reencode_mxfp8_to_1x128(mx, &report);
  EXPECT_EQ(q.scales[0], 1024.0f);
  EXPECT_EQ(q.data[0], 0x38);
  EXPECT_EQ(q.data[32], 0x00);
  EXPECT_EQ(q.data[33], e4m3_oracle(0.4375f));
  EXPECT_EQ(q.data[34], 0x01);
  EXPECT_EQ(q.data[35], 0x80);
  EXPECT_EQ(q.data[64], 0x01);
  EXPECT_EQ(q.data[96], kE4M3NaN);
  EXPECT_EQ(report.changed, 3);
  EXPECT_EQ(report.flushed_to_zero, 2);
  EXPECT_EQ(report.max_abs_error, 1.0);  // the -1 that became -0
  const double err2 = 0x1p-18 + std::pow(1.875 - 1024 * 0x1p-9, 2) + 1.0;
  const double ref2 = 1024.0 * 1024 + 0x1p-18 + 448.0 * 448 + 1.875 * 1.875 + 1.0 + 2.0 * 2.0;
  EXPECT_DOUBLE_EQ(report.relative_l2_error, std::sqrt(err2 / ref2));
  reencode_mxfp8_to_1x128(mx, nullptr);  // the report is optional
}

}  // namespace
}  // namespace pounce::formats

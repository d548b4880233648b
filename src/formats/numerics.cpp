#include "formats/numerics.h"

#include <bit>
#include <cmath>
#include <limits>

#include "common/require.h"

namespace pounce::formats {

uint16_t bf16_from_float(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return kBf16NaN;
  // Round to nearest even on the 16 dropped bits: add just under half, plus one when the kept lsb is odd.
  // A carry out of the mantissa moves into the exponent, which is exactly the next binade (or Inf).
  const uint32_t lsb = (u >> 16) & 1u;
  return static_cast<uint16_t>((u + 0x7FFFu + lsb) >> 16);
}

float bf16_to_float(uint16_t bits) { return std::bit_cast<float>(uint32_t(bits) << 16); }

float round_to_bf16(float x) { return bf16_to_float(bf16_from_float(x)); }

namespace {

// Round-half-to-even of a non-negative double that is an exact multiple of a small power of two
// (so q - floor(q) is exact). Independent of the floating-point environment's rounding mode.
uint32_t round_half_even(double q) {
  const double n = std::floor(q);
  const double r = q - n;
  auto i = static_cast<uint32_t>(n);
  if (r > 0.5 || (r == 0.5 && (i & 1u))) ++i;
  return i;
}

}  // namespace

uint8_t e4m3_from_float(float x) {
  if (std::isnan(x)) return kE4M3NaN;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  const double a = std::fabs(static_cast<double>(x));  // exact; also covers Inf
  // Everything from 448 up rounds to 448 or to 480 (which would be the NaN code): saturate.
  if (a >= kE4M3Max) return sign | 0x7E;

  // Encode as (biased exponent << 3) + mantissa, where the integer n counts quanta of the binade.
  // A rounding that reaches the next power of two carries into the exponent field by itself.
  uint32_t code;
  if (a < 0x1p-6) {
    code = round_half_even(a * 0x1p9);  // subnormals: quantum 2^-9, code = n (n = 8 is 2^-6)
  } else {
    int k;
    std::frexp(a, &k);           // a = m * 2^k, m in [0.5, 1): unbiased exponent k - 1
    const int exponent = k - 1;  // in [-6, 8]
    const uint32_t n = round_half_even(std::ldexp(a, 3 - exponent));  // in [8, 16]
    code = (uint32_t(exponent + 7) << 3) + (n - 8);                   // a < 448 keeps this <= 0x7E (448)
  }
  return sign | static_cast<uint8_t>(code);
}

float e4m3_to_float(uint8_t bits) {
  const int exponent = (bits >> 3) & 0xF;
  const int mantissa = bits & 0x7;
  if (exponent == 0xF && mantissa == 0x7) return std::numeric_limits<float>::quiet_NaN();
  const float magnitude =
      exponent == 0 ? std::ldexp(float(mantissa), -9) : std::ldexp(float(8 + mantissa), exponent - 10);
  return (bits & 0x80) ? -magnitude : magnitude;
}

uint8_t e8m0_from_exponent(int exponent) {
  POUNCE_REQUIRE(exponent >= kE8M0MinExponent && exponent <= kE8M0MaxExponent, "E8M0 exponent ", exponent,
                 " is out of range [", kE8M0MinExponent, ", ", kE8M0MaxExponent, "]");
  return static_cast<uint8_t>(exponent + kE8M0Bias);
}

int e8m0_to_exponent(uint8_t bits) {
  POUNCE_REQUIRE(bits != kE8M0NaN, "E8M0 scale 0xFF is NaN and has no exponent");
  return int(bits) - kE8M0Bias;
}

float e8m0_to_float(uint8_t bits) {
  if (bits == kE8M0NaN) return std::numeric_limits<float>::quiet_NaN();
  return std::ldexp(1.0f, int(bits) - kE8M0Bias);  // 2^-127 is a float subnormal, still exact
}

}  // namespace pounce::formats

// Scalar number formats, host reference. These are the bit-exact ground truth for every device
// conversion: device kernels are tested against these functions, never against themselves.
//
// Rules (all conversions round to nearest, ties to even):
//   bf16:  NaN -> 0x7FC0 (canonical quiet NaN, sign dropped); +-Inf stay +-Inf; overflow rounds to Inf.
//   E4M3 (fp8, "fn" variant: no Inf, NaN = S.1111.111): saturating. |x| > 448 (after rounding) and
//          +-Inf -> +-448; NaN -> 0x7F; values below the smallest subnormal (2^-9) round to +-0,
//          keeping the sign. This matches PTX cvt.rn.satfinite.e4m3x2.f32 with NaN made canonical.
//   E8M0:  an unsigned biased exponent (bias 127), value 2^(b-127), b in [0, 254]; 0xFF is NaN.
#pragma once

#include <cstdint>

namespace pounce::formats {

inline constexpr float kE4M3Max = 448.0f;
inline constexpr uint8_t kE4M3NaN = 0x7F;
inline constexpr uint16_t kBf16NaN = 0x7FC0;
inline constexpr int kE8M0Bias = 127;
inline constexpr int kE8M0MinExponent = -127;
inline constexpr int kE8M0MaxExponent = 127;
inline constexpr uint8_t kE8M0NaN = 0xFF;

uint16_t bf16_from_float(float x);
float bf16_to_float(uint16_t bits);
// Rounds x to the nearest bf16 and back: the value a bf16 tensor would hold.
float round_to_bf16(float x);

uint8_t e4m3_from_float(float x);
float e4m3_to_float(uint8_t bits);

// exponent must lie in [kE8M0MinExponent, kE8M0MaxExponent]; anything else throws pounce::Error.
uint8_t e8m0_from_exponent(int exponent);
// The scale's exponent; NaN (0xFF) throws pounce::Error.
int e8m0_to_exponent(uint8_t bits);
float e8m0_to_float(uint8_t bits);  // NaN for 0xFF

}  // namespace pounce::formats

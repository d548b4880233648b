// Block-scaled FP8 formats, host reference (bit-exact ground truth for device quantizers).
//
// All scales are powers of two, so applying or removing a scale is exact and the only rounding is the
// E4M3 conversion of each element.
//
// Blockwise FP8 (DeepSeek-V3 / TransformerEngine "blockwise" recipe): one fp32 power-of-two scale per
// block of 1x128 (activations, along the row) or 128x128 (weights). Scale rule ("ceil"): the smallest
// 2^e with amax <= 448 * 2^e, so no element saturates; e is clamped to the E8M0 range [-127, 127], which
// keeps every scale representable as E8M0 for exchange with MX systems. amax is taken over finite
// elements; a block with no finite nonzero element gets scale 1 (e = 0).
//   q = e4m3(x / 2^e)      x ~= e4m3_to_float(q) * 2^e
//
// MXFP8 (OCP Microscaling spec v1.0): one E8M0 scale per 32 consecutive elements of a row, elements E4M3.
// Scale rule (the spec's): e = floor(log2(amax)) - 8, where 8 = emax of E4M3, clamped to [-127, 127];
// elements are then converted with saturation, so the top binade of a block may clip to 448 (the spec
// allows it; it costs at most one part in 8 of the largest elements' magnitude, for amax in (448,512)*2^e).
// A block with no finite nonzero element gets e = 0. NaN elements stay NaN.
//
// Re-encoding MXFP8 -> 1x128: the 1x128 block takes the largest of its four E8M0 exponents, S; elements
// of the sub-block with exponent s are rescaled by 2^(s-S) with one E4M3 rounding. Elements of the
// sub-blocks with s = S are unchanged; the others lose bits only where the rescaled value falls into
// E4M3's subnormal range (< 2^-6) or below it (flushed to zero). reencode_mxfp8_to_1x128 reports how
// many elements changed and the error that caused.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace pounce::formats {

inline constexpr int kActivationBlock = 128;  // 1x128 activation blocks
inline constexpr int kWeightBlock = 128;      // 128x128 weight blocks
inline constexpr int kMxBlock = 32;           // 1x32 MX blocks

// Smallest e with amax <= 448 * 2^e, clamped to [-127, 127]; 0 when amax is 0 or not finite.
int blockwise_scale_exponent(float amax);
// floor(log2(amax)) - 8, clamped to [-127, 127]; 0 when amax is 0 or not finite.
int mx_scale_exponent(float amax);

// 1x128 row-wise blocks. cols must be a multiple of 128.
struct Fp8Rows1x128 {
  int64_t rows = 0, cols = 0;
  std::vector<uint8_t> data;  // [rows, cols] E4M3
  std::vector<float> scales;  // [rows, cols / 128], powers of two
};
Fp8Rows1x128 quantize_1x128(std::span<const float> x, int64_t rows, int64_t cols);
std::vector<float> dequantize(const Fp8Rows1x128& q);
// q's scales K block-major, [cols / 128, rows] (one K block's lie together): how the FP8 GEMMs read their
// row-scaled operands' scales, and how quantize_1x128_transposed_device (and the 1 x 128 quantizers with a
// K block-major ScaleLayout) write them.
std::vector<float> scales_k_block_major(const Fp8Rows1x128& q);

// 128x128 blocks (weights). rows and cols must be multiples of 128.
struct Fp8Blocks128x128 {
  int64_t rows = 0, cols = 0;
  std::vector<uint8_t> data;  // [rows, cols] E4M3
  std::vector<float> scales;  // [rows / 128, cols / 128], powers of two
};
Fp8Blocks128x128 quantize_128x128(std::span<const float> x, int64_t rows, int64_t cols);
std::vector<float> dequantize(const Fp8Blocks128x128& q);
// q holds `matrices` stacked [rows, cols] matrices (q.rows = matrices * rows); returns each one
// transposed, stacked [cols, rows], with its block scales transposed alike. Blocks are square and their
// scales depend on the block's amax alone, so this is bit for bit quantize_128x128 of the transposed
// values: the weights' E4M3 copy in the orientation the backward's data-gradient GEMMs read.
Fp8Blocks128x128 transpose_128x128(const Fp8Blocks128x128& q, int64_t matrices);

// MXFP8, 1x32 row-wise blocks. cols must be a multiple of 32.
struct Mxfp8 {
  int64_t rows = 0, cols = 0;
  std::vector<uint8_t> data;    // [rows, cols] E4M3
  std::vector<uint8_t> scales;  // [rows, cols / 32] E8M0
};
Mxfp8 quantize_mxfp8(std::span<const float> x, int64_t rows, int64_t cols);
std::vector<float> dequantize(const Mxfp8& q);

struct ReencodeReport {
  int64_t elements = 0;
  int64_t changed = 0;           // elements whose dequantized value differs from the MXFP8 one
  int64_t flushed_to_zero = 0;   // nonzero MXFP8 elements that became zero
  double max_abs_error = 0;      // against the MXFP8 dequantized values
  double relative_l2_error = 0;  // ||reencoded - mx|| / ||mx||, 0 when ||mx|| is 0
};
// cols must be a multiple of 128. report may be null.
Fp8Rows1x128 reencode_mxfp8_to_1x128(const Mxfp8& mx, ReencodeReport* report);

}  // namespace pounce::formats

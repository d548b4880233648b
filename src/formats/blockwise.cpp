#include "formats/blockwise.h"

#include <algorithm>
#include <cmath>

#include "common/require.h"
#include "formats/numerics.h"

namespace pounce::formats {

int blockwise_scale_exponent(float amax) {
  if (!std::isfinite(amax) || amax == 0) return 0;
  POUNCE_REQUIRE(amax > 0, "amax ", amax, " is negative");
  int k;
  const float m = std::frexp(amax, &k);  // amax = m * 2^k, m in [0.5, 1), exact (subnormals too)
  // 448 = 0.875 * 2^9, so amax <= 448 * 2^e  <=>  m <= 0.875 * 2^(e + 9 - k): the smallest such e is
  // k - 9 when m <= 0.875, else k - 8.
  const int e = m <= 0.875f ? k - 9 : k - 8;
  return std::clamp(e, kE8M0MinExponent, kE8M0MaxExponent);
}

int mx_scale_exponent(float amax) {
  if (!std::isfinite(amax) || amax == 0) return 0;
  POUNCE_REQUIRE(amax > 0, "amax ", amax, " is negative");
  int k;
  std::frexp(amax, &k);  // floor(log2(amax)) = k - 1
  return std::clamp(k - 1 - 8, kE8M0MinExponent, kE8M0MaxExponent);
}

namespace {

// A [rows, cols] matrix cut into block_rows x block_cols tiles; scales are row-major over the tiles.
struct Tiling {
  int64_t rows, cols, block_rows, block_cols;
  int64_t tile_rows() const { return rows / block_rows; }
  int64_t tile_cols() const { return cols / block_cols; }
  int64_t tiles() const { return tile_rows() * tile_cols(); }
  int64_t tile_of(int64_t r, int64_t c) const { return (r / block_rows) * tile_cols() + c / block_cols; }
};

Tiling check_shape(const char* what, int64_t rows, int64_t cols, int64_t block_rows, int64_t block_cols) {
  POUNCE_REQUIRE(rows >= 0 && cols >= 0, what, ": shape [", rows, ", ", cols, "] has a negative extent");
  POUNCE_REQUIRE(rows % block_rows == 0, what, ": rows = ", rows, " is not a multiple of ", block_rows);
  POUNCE_REQUIRE(cols % block_cols == 0, what, ": cols = ", cols, " is not a multiple of ", block_cols);
  return {rows, cols, block_rows, block_cols};
}

void check_size(const char* what, const char* name, size_t size, int64_t expected) {
  POUNCE_REQUIRE(int64_t(size) == expected, what, ": ", name, " holds ", size, " elements, expected ", expected);
}

// Quantizes x with one power-of-two scale per tile, 2^exponent_of(tile amax); returns the exponents.
std::vector<int> quantize_tiles(std::span<const float> x, const Tiling& t, int (*exponent_of)(float),
                                std::vector<uint8_t>& data) {
  std::vector<float> amax(t.tiles(), 0.0f);
  for (int64_t r = 0; r < t.rows; ++r)
    for (int64_t c = 0; c < t.cols; ++c) {
      const float a = std::fabs(x[r * t.cols + c]);
      float& m = amax[t.tile_of(r, c)];
      if (std::isfinite(a)) m = std::max(m, a);
    }
  std::vector<int> exponents(t.tiles());
  for (int64_t i = 0; i < t.tiles(); ++i) exponents[i] = exponent_of(amax[i]);

  // Scaling by 2^-e is exact unless the result is a float subnormal (< 2^-126), and those all round to
  // +-0 in E4M3 either way: one rounding in total, the E4M3 one.
  data.resize(x.size());
  for (int64_t r = 0; r < t.rows; ++r)
    for (int64_t c = 0; c < t.cols; ++c) {
      const int64_t i = r * t.cols + c;
      data[i] = e4m3_from_float(std::ldexp(x[i], -exponents[t.tile_of(r, c)]));
    }
  return exponents;
}

template <typename ScaleOf>
std::vector<float> dequantize_tiles(const std::vector<uint8_t>& data, const Tiling& t, ScaleOf scale_of) {
  std::vector<float> x(data.size());
  for (int64_t r = 0; r < t.rows; ++r)
    for (int64_t c = 0; c < t.cols; ++c) {
      const int64_t i = r * t.cols + c;
      x[i] = e4m3_to_float(data[i]) * scale_of(t.tile_of(r, c));
    }
  return x;
}

std::vector<float> powers_of_two(const std::vector<int>& exponents) {
  std::vector<float> scales(exponents.size());
  for (size_t i = 0; i < exponents.size(); ++i) scales[i] = std::ldexp(1.0f, exponents[i]);
  return scales;
}

}  // namespace

Fp8Rows1x128 quantize_1x128(std::span<const float> x, int64_t rows, int64_t cols) {
  const Tiling t = check_shape("quantize_1x128", rows, cols, 1, kActivationBlock);
  check_size("quantize_1x128", "x", x.size(), rows * cols);
  Fp8Rows1x128 q{rows, cols, {}, {}};
  q.scales = powers_of_two(quantize_tiles(x, t, blockwise_scale_exponent, q.data));
  return q;
}

std::vector<float> dequantize(const Fp8Rows1x128& q) {
  const Tiling t = check_shape("dequantize(Fp8Rows1x128)", q.rows, q.cols, 1, kActivationBlock);
  check_size("dequantize(Fp8Rows1x128)", "data", q.data.size(), q.rows * q.cols);
  check_size("dequantize(Fp8Rows1x128)", "scales", q.scales.size(), t.tiles());
  return dequantize_tiles(q.data, t, [&](int64_t tile) { return q.scales[tile]; });
}

std::vector<float> scales_k_block_major(const Fp8Rows1x128& q) {
  const Tiling t = check_shape("scales_k_block_major", q.rows, q.cols, 1, kActivationBlock);
  check_size("scales_k_block_major", "scales", q.scales.size(), t.tiles());
  const int64_t blocks = q.cols / kActivationBlock;
  std::vector<float> out(q.scales.size());
  for (int64_t r = 0; r < q.rows; ++r)
    for (int64_t b = 0; b < blocks; ++b) out[b * q.rows + r] = q.scales[r * blocks + b];
  return out;
}

Fp8Blocks128x128 quantize_128x128(std::span<const float> x, int64_t rows, int64_t cols) {
  const Tiling t = check_shape("quantize_128x128", rows, cols, kWeightBlock, kWeightBlock);
  check_size("quantize_128x128", "x", x.size(), rows * cols);
  Fp8Blocks128x128 q{rows, cols, {}, {}};
  q.scales = powers_of_two(quantize_tiles(x, t, blockwise_scale_exponent, q.data));
  return q;
}

std::vector<float> dequantize(const Fp8Blocks128x128& q) {
  const Tiling t = check_shape("dequantize(Fp8Blocks128x128)", q.rows, q.cols, kWeightBlock, kWeightBlock);
  check_size("dequantize(Fp8Blocks128x128)", "data", q.data.size(), q.rows * q.cols);
  check_size("dequantize(Fp8Blocks128x128)", "scales", q.scales.size(), t.tiles());
  return dequantize_tiles(q.data, t, [&](int64_t tile) { return q.scales[tile]; });
}

Fp8Blocks128x128 transpose_128x128(const Fp8Blocks128x128& q, int64_t matrices) {
  POUNCE_REQUIRE(matrices >= 1 && q.rows % matrices == 0, "transpose_128x128: ", q.rows, " rows are not ", matrices,
                 " stacked matrices");
  const int64_t rows = q.rows / matrices, cols = q.cols;
  const Tiling t = check_shape("transpose_128x128", rows, cols, kWeightBlock, kWeightBlock);
  check_size("transpose_128x128", "data", q.data.size(), q.rows * cols);
  check_size("transpose_128x128", "scales", q.scales.size(), matrices * t.tiles());
  Fp8Blocks128x128 out{matrices * cols, rows, std::vector<uint8_t>(q.data.size()), std::vector<float>(q.scales.size())};
  const int64_t block_rows = rows / kWeightBlock, block_cols = cols / kWeightBlock;
  for (int64_t m = 0; m < matrices; ++m) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) out.data[(m * cols + c) * rows + r] = q.data[(m * rows + r) * cols + c];
    for (int64_t br = 0; br < block_rows; ++br)
      for (int64_t bc = 0; bc < block_cols; ++bc)
        out.scales[(m * block_cols + bc) * block_rows + br] = q.scales[(m * block_rows + br) * block_cols + bc];
  }
  return out;
}

Mxfp8 quantize_mxfp8(std::span<const float> x, int64_t rows, int64_t cols) {
  const Tiling t = check_shape("quantize_mxfp8", rows, cols, 1, kMxBlock);
  check_size("quantize_mxfp8", "x", x.size(), rows * cols);
  Mxfp8 q{rows, cols, {}, {}};
  const std::vector<int> exponents = quantize_tiles(x, t, mx_scale_exponent, q.data);
  q.scales.resize(exponents.size());
  for (size_t i = 0; i < exponents.size(); ++i) q.scales[i] = e8m0_from_exponent(exponents[i]);
  return q;
}

std::vector<float> dequantize(const Mxfp8& q) {
  const Tiling t = check_shape("dequantize(Mxfp8)", q.rows, q.cols, 1, kMxBlock);
  check_size("dequantize(Mxfp8)", "data", q.data.size(), q.rows * q.cols);
  check_size("dequantize(Mxfp8)", "scales", q.scales.size(), t.tiles());
  // A NaN scale (0xFF) makes its whole block NaN, as the MX spec says.
  return dequantize_tiles(q.data, t, [&](int64_t tile) { return e8m0_to_float(q.scales[tile]); });
}

Fp8Rows1x128 reencode_mxfp8_to_1x128(const Mxfp8& mx, ReencodeReport* report) {
  const char* what = "reencode_mxfp8_to_1x128";
  check_shape(what, mx.rows, mx.cols, 1, kActivationBlock);
  check_size(what, "data", mx.data.size(), mx.rows * mx.cols);
  check_size(what, "scales", mx.scales.size(), mx.rows * (mx.cols / kMxBlock));
  constexpr int kSubBlocks = kActivationBlock / kMxBlock;

  Fp8Rows1x128 out{mx.rows, mx.cols, std::vector<uint8_t>(mx.data.size()), {}};
  out.scales.resize(mx.rows * (mx.cols / kActivationBlock));
  ReencodeReport r;
  r.elements = mx.rows * mx.cols;
  double error_sq = 0, mx_sq = 0;
  for (int64_t row = 0; row < mx.rows; ++row)
    for (int64_t block = 0; block < mx.cols / kActivationBlock; ++block) {
      int s[kSubBlocks];
      for (int j = 0; j < kSubBlocks; ++j) {
        const uint8_t bits = mx.scales[row * (mx.cols / kMxBlock) + block * kSubBlocks + j];
        POUNCE_REQUIRE(bits != kE8M0NaN, what, ": scale of row ", row, ", 32-block ", block * kSubBlocks + j,
                       " is NaN (0xFF)");
        s[j] = e8m0_to_exponent(bits);
      }
      const int S = *std::max_element(s, s + kSubBlocks);
      out.scales[row * (mx.cols / kActivationBlock) + block] = std::ldexp(1.0f, S);

      for (int j = 0; j < kSubBlocks; ++j)
        for (int c = 0; c < kMxBlock; ++c) {
          const int64_t i = row * mx.cols + block * kActivationBlock + j * kMxBlock + c;
          const float value = e4m3_to_float(mx.data[i]);
          if (std::isnan(value)) {
            out.data[i] = kE4M3NaN;
            continue;
          }
          // Exact rescale unless it lands below 2^-126, where E4M3 gives +-0 anyway (see quantize_tiles).
          const uint8_t code = s[j] == S ? mx.data[i] : e4m3_from_float(std::ldexp(value, s[j] - S));
          out.data[i] = code;

          const double before = std::ldexp(double(value), s[j]);
          const double after = std::ldexp(double(e4m3_to_float(code)), S);
          const double error = std::fabs(after - before);
          r.changed += after != before;
          r.flushed_to_zero += before != 0 && after == 0;
          r.max_abs_error = std::max(r.max_abs_error, error);
          error_sq += error * error;
          mx_sq += before * before;
        }
    }
  r.relative_l2_error = mx_sq > 0 ? std::sqrt(error_sq / mx_sq) : 0.0;
  if (report) *report = r;
  return out;
}

}  // namespace pounce::formats

// GPU tests of the device quantizers: every byte of data and scales must equal the host reference
// (formats/blockwise.h). Outputs are poisoned before each launch, and a guard zone past the end of every
// output buffer must stay poisoned (no out-of-bounds writes).
#include "formats/quantize_kernel.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "common/cuda_check.h"
#include "common/device_buffer.h"
#include "common/gpu.h"
#include "common/testing.h"
#include "formats/blockwise.h"
#include "formats/numerics.h"

namespace pounce::formats {
namespace {

constexpr uint8_t kPoison = 0xAB;
constexpr size_t kGuardBytes = 256;

// A device allocation with kGuardBytes of slack past `bytes`.
class GuardedBuffer {
 public:
  explicit GuardedBuffer(size_t bytes) : bytes_(bytes) { CUDA_CHECK(cudaMalloc(&ptr_, bytes + kGuardBytes)); }
  ~GuardedBuffer() {
    if (cudaError_t status = cudaFree(ptr_); status != cudaSuccess)
      ADD_FAILURE() << "cudaFree: " << cudaGetErrorString(status);
  }
  GuardedBuffer(const GuardedBuffer&) = delete;
  GuardedBuffer& operator=(const GuardedBuffer&) = delete;

  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  void poison() const { CUDA_CHECK(cudaMemset(ptr_, kPoison, bytes_ + kGuardBytes)); }
  // The bytes_ payload; the guard zone is checked here too.
  std::vector<uint8_t> download() const {
    std::vector<uint8_t> all(bytes_ + kGuardBytes);
    CUDA_CHECK(cudaMemcpy(all.data(), ptr_, all.size(), cudaMemcpyDeviceToHost));
    for (size_t i = bytes_; i < all.size(); ++i)
      EXPECT_EQ(all[i], kPoison) << "write past the end, at byte " << i - bytes_ << " after it";
    all.resize(bytes_);
    return all;
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_;
};

void expect_bytes_equal(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want, const char* what,
                        int64_t row_bytes) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int64_t mismatches = 0, first = -1;
  for (size_t i = 0; i < got.size(); ++i)
    if (got[i] != want[i] && mismatches++ == 0) first = int64_t(i);
  EXPECT_EQ(mismatches, 0) << what << ": first mismatch at byte " << first << " (row " << first / row_bytes
                           << ", column " << first % row_bytes << "): device 0x" << std::hex
                           << int(got[std::max<int64_t>(first, 0)]) << ", host 0x"
                           << int(want[std::max<int64_t>(first, 0)]);
}

template <typename T>
std::vector<uint8_t> as_bytes(const std::vector<T>& v) {
  std::vector<uint8_t> bytes(v.size() * sizeof(T));
  std::memcpy(bytes.data(), v.data(), bytes.size());
  return bytes;
}

// q's scales K block-major over `stride` >= q.rows rows, as bytes ([cols / 128, stride]): the slots of
// rows past q.rows hold the poison (a quantizer must leave them alone).
std::vector<uint8_t> k_block_major_bytes(const Fp8Rows1x128& q, int64_t stride) {
  const std::vector<float> packed = scales_k_block_major(q);
  std::vector<uint8_t> bytes(size_t(stride * (q.cols / kActivationBlock)) * sizeof(float), kPoison);
  for (int64_t b = 0; b < q.cols / kActivationBlock; ++b)
    std::memcpy(bytes.data() + b * stride * sizeof(float), packed.data() + b * q.rows, size_t(q.rows) * sizeof(float));
  return bytes;
}

// A device dequantizer (`run` writes bf16 [rows, cols] to its argument) against the host's dequantized
// values, bit for bit (NaN for NaN).
template <typename Run>
void check_dequantized(const char* what, Run run, int64_t cols, const std::vector<float>& want, cudaStream_t stream) {
  GuardedBuffer d_out(want.size() * sizeof(uint16_t));
  d_out.poison();
  run(d_out.as<uint16_t>());
  CUDA_CHECK(cudaStreamSynchronize(stream));
  const std::vector<uint8_t> bytes = d_out.download();
  const std::vector<uint16_t> want_bits = testing::to_bf16_bits(want);
  int64_t mismatches = 0, first = -1;
  for (size_t i = 0; i < want.size(); ++i) {
    uint16_t got;
    std::memcpy(&got, bytes.data() + 2 * i, 2);
    const bool same = got == want_bits[i] || (std::isnan(bf16_to_float(got)) && std::isnan(want[i]));
    if (!same && mismatches++ == 0) first = int64_t(i);
  }
  EXPECT_EQ(mismatches, 0) << what << " dequantized: first mismatch at element " << first << " (row " << first / cols
                           << ", column " << first % cols << ")";
}

// The blockwise device dequantizer on what a device quantizer wrote.
void check_dequantized(const GuardedBuffer& q, const GuardedBuffer& scales, int64_t rows, int64_t cols, int block_rows,
                       const std::vector<float>& want, cudaStream_t stream, ScaleLayout layout = {}) {
  check_dequantized(
      block_rows == 1 ? "1x128" : "128x128",
      [&](uint16_t* out) {
        dequantize_blockwise_device(q.as<uint8_t>(), scales.as<float>(), rows, cols, block_rows, out, stream, layout);
      },
      cols, want, stream);
}

// Runs the device quantizers on x (bf16 bits, [rows, cols]) and compares them to the host reference.
// The 1x128 quantizer runs only when cols is a multiple of 128, the 128x128 one when rows is too.
void check_against_host(const std::vector<uint16_t>& x, int64_t rows, int64_t cols) {
  SCOPED_TRACE(::testing::Message() << "shape [" << rows << ", " << cols << "]");
  std::vector<float> xf(x.size());
  for (size_t i = 0; i < x.size(); ++i) xf[i] = bf16_to_float(x[i]);

  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreate(&stream));
  GuardedBuffer d_x(x.size() * sizeof(uint16_t)), d_out(x.size());
  CUDA_CHECK(cudaMemcpy(d_x.as<void>(), x.data(), x.size() * sizeof(uint16_t), cudaMemcpyHostToDevice));

  if (cols % kActivationBlock == 0) {
    const Fp8Rows1x128 want = quantize_1x128(xf, rows, cols);
    GuardedBuffer d_scales(want.scales.size() * sizeof(float));
    d_out.poison();
    d_scales.poison();
    quantize_1x128_device(d_x.as<uint16_t>(), rows, cols, d_out.as<uint8_t>(), d_scales.as<float>(), stream);
    CUDA_CHECK(cudaStreamSynchronize(stream));
    expect_bytes_equal(d_out.download(), want.data, "1x128 data", cols);
    expect_bytes_equal(d_scales.download(), as_bytes(want.scales), "1x128 scales", cols / kActivationBlock * 4);
    check_dequantized(d_out, d_scales, rows, cols, 1, dequantize(want), stream);

    // K block-major scales (the FP8 GEMM's A operand) over more rows than x has.
    const int64_t stride = rows + 5;
    GuardedBuffer d_block_major(size_t(stride * (cols / kActivationBlock)) * sizeof(float));
    d_out.poison();
    d_block_major.poison();
    quantize_1x128_device(d_x.as<uint16_t>(), rows, cols, d_out.as<uint8_t>(), d_block_major.as<float>(), stream,
                          ScaleLayout{stride});
    CUDA_CHECK(cudaStreamSynchronize(stream));
    expect_bytes_equal(d_out.download(), want.data, "1x128 data (K block-major scales)", cols);
    expect_bytes_equal(d_block_major.download(), k_block_major_bytes(want, stride), "1x128 scales, K block-major",
                       stride * int64_t(sizeof(float)));
    check_dequantized(d_out, d_block_major, rows, cols, 1, dequantize(want), stream, ScaleLayout{stride});
  }
  if (cols % kWeightBlock == 0 && rows % kWeightBlock == 0) {
    const Fp8Blocks128x128 want = quantize_128x128(xf, rows, cols);
    GuardedBuffer d_scales(want.scales.size() * sizeof(float));
    d_out.poison();
    d_scales.poison();
    quantize_128x128_device(d_x.as<uint16_t>(), rows, cols, d_out.as<uint8_t>(), d_scales.as<float>(), stream);
    CUDA_CHECK(cudaStreamSynchronize(stream));
    expect_bytes_equal(d_out.download(), want.data, "128x128 data", cols);
    expect_bytes_equal(d_scales.download(), as_bytes(want.scales), "128x128 scales", cols / kWeightBlock * 4);
    check_dequantized(d_out, d_scales, rows, cols, kWeightBlock, dequantize(want), stream);
  }

  const Mxfp8 want = quantize_mxfp8(xf, rows, cols);
  GuardedBuffer d_scales(want.scales.size());
  d_out.poison();
  d_scales.poison();
  quantize_mxfp8_device(d_x.as<uint16_t>(), rows, cols, d_out.as<uint8_t>(), d_scales.as<uint8_t>(), stream);
  CUDA_CHECK(cudaStreamSynchronize(stream));
  expect_bytes_equal(d_out.download(), want.data, "MXFP8 data", cols);
  expect_bytes_equal(d_scales.download(), want.scales, "MXFP8 scales", cols / kMxBlock);
  check_dequantized(
      "MXFP8",
      [&](uint16_t* out) {
        dequantize_mxfp8_device(d_out.as<uint8_t>(), d_scales.as<uint8_t>(), rows, cols, out, stream);
      },
      cols, dequantize(want), stream);
  CUDA_CHECK(cudaStreamDestroy(stream));
}

// bf16 bits whose magnitude ranges over the whole format: each 32-element block draws a top exponent
// field in [0, 254] and its elements fall up to `spread` binades below it (field 0: subnormals). Tops near
// 0 make the scale exponent clamp at -127; tops near 254 reach the largest bf16.
std::vector<uint16_t> wide_range_bf16(std::mt19937_64& rng, size_t n, int spread) {
  std::vector<uint16_t> x(n);
  std::uniform_int_distribution<int> top(0, 254), below(0, spread);
  for (size_t b = 0; b < n; b += kMxBlock) {
    const int t = top(rng);
    for (size_t i = b; i < b + kMxBlock; ++i) {
      const uint32_t exponent = uint32_t(std::max(0, t - below(rng)));
      x[i] = uint16_t((rng() & 0x807Fu) | exponent << 7);  // random sign and fraction
    }
  }
  return x;
}

TEST(QuantizeKernel, RandomUniformMatchesHost) {
  POUNCE_REQUIRE_HOPPER();
  auto rng = testing::fresh_rng();
  const std::pair<int64_t, int64_t> shapes[] = {{1, 128},     {1, 7168},    {3, 384},  {333, 128},
                                                {2048, 7168}, {1000, 2048}, {384, 640}};
  for (auto [rows, cols] : shapes) {
    const std::vector<float> v = testing::random_bf16_values(rng, size_t(rows * cols), -4.0f, 4.0f);
    check_against_host(testing::to_bf16_bits(v), rows, cols);
  }
}

TEST(QuantizeKernel, WideMagnitudesMatchHost) {
  POUNCE_REQUIRE_HOPPER();
  auto rng = testing::fresh_rng();
  const std::pair<int64_t, int64_t> shapes[] = {{1, 128}, {17, 7168}, {4096, 256}, {5, 32}, {7, 96}};
  for (auto [rows, cols] : shapes)
    for (int spread : {3, 12, 40}) check_against_host(wide_range_bf16(rng, size_t(rows * cols), spread), rows, cols);
}

TEST(QuantizeKernel, EdgeCasesMatchHost) {
  POUNCE_REQUIRE_HOPPER();
  auto rng = testing::fresh_rng();
  const int64_t rows = 3, cols = 512;
  std::vector<uint16_t> x = testing::to_bf16_bits(testing::random_bf16_values(rng, size_t(rows * cols)));
  auto block = [&](int64_t index) { return x.begin() + index * kMxBlock; };         // 32-element blocks
  std::fill(block(0), block(4), uint16_t(0x0000));                                  // a whole 128-block of zeros...
  for (int i = 0; i < 128; i += 3) x[i] = 0x8000;                                   // ...some of them -0
  for (int i = 128; i < 256; ++i) x[i] = uint16_t((i & 1) << 15 | (i % 0x7F + 1));  // only subnormals
  std::fill(block(8), block(9), uint16_t(0x3F80));                                  // largest bf16 among ones
  x[8 * 32 + 3] = 0x7F7F;
  x[8 * 32 + 4] = 0xFF7F;
  x[9 * 32 + 0] = 0x7FC0;  // NaN, -NaN, a NaN payload, +-Inf
  x[9 * 32 + 1] = 0xFFC0;
  x[9 * 32 + 2] = 0x7F81;
  x[9 * 32 + 3] = 0x7F80;
  x[9 * 32 + 4] = 0xFF80;
  x[9 * 32 + 5] = 0x4300;  // 128, the MX block's largest finite value, in the chunk with the NaNs
  std::fill(block(10), block(11), uint16_t(0x7FC0));  // only NaN and Inf
  x[10 * 32 + 7] = 0xFF80;
  std::fill(block(12), block(13), uint16_t(0x0001));                       // smallest subnormal and big values
  x[12 * 32 + 9] = 0x4480;                                                 // 1024: tiny ones flush
  x[13 * 32] = 0x43E0;                                                     // amax exactly 448
  x[14 * 32] = 0x43E1;                                                     // just above 448
  x[15 * 32] = 0xC3E0;                                                     // -448
  for (int i = 0; i < 32; ++i) x[16 * 32 + i] = uint16_t(0x3F80 + i * 4);  // 1.0 .. 1.97 (ties in E4M3)
  x[17 * 32] = 0x3FE0;                                                     // 1.75 * 2^0: the ceil threshold
  x[18 * 32] = 0x3FE1;                                                     // just above it
  x[19 * 32] = 0x0070;                                                     // subnormal amax, 1.75 * 2^-127
  std::fill(block(20), block(21), uint16_t(0x0071));                       // subnormal, just above 1.75 * 2^-127
  std::fill(block(24), block(28), uint16_t(0x7F80));                       // a 128-block of +Inf
  x[28 * 32 + 1] = 0x7FC0;  // a NaN beside its 128-block's largest finite value, 128 (the chunk's other
  x[28 * 32 + 2] = 0x4300;  // values, and the block's, from [-1, 1])
  check_against_host(x, rows, cols);
}

// 128 x 128 blocks that hold only zeros, only subnormals, NaN and Inf beside finite values, amax exactly
// 448, and a block of NaN and Inf only.
TEST(QuantizeKernel, WeightBlockEdgeCasesMatchHost) {
  POUNCE_REQUIRE_HOPPER();
  auto rng = testing::fresh_rng();
  const int64_t rows = 256, cols = 384;
  std::vector<uint16_t> x = testing::to_bf16_bits(testing::random_bf16_values(rng, size_t(rows * cols)));
  const auto at = [&](int64_t block_row, int64_t block_col, int64_t r, int64_t c) -> uint16_t& {
    return x[(block_row * 128 + r) * cols + block_col * 128 + c];
  };
  for (int r = 0; r < 128; ++r)
    for (int c = 0; c < 128; ++c) {
      at(0, 0, r, c) = (r + c) % 5 == 0 ? 0x8000 : 0x0000;              // zeros and -0
      at(0, 2, r, c) = uint16_t(((r * 7 + c) & 0x7F) | (c & 1) << 15);  // only subnormals (and zeros)
      at(1, 2, r, c) = (r + c) % 2 ? 0x7FC0 : 0xFF80;                   // NaN and -Inf only
    }
  at(0, 1, 5, 9) = 0x7FC0;  // NaN, +Inf and exactly 448 among random values
  at(0, 1, 77, 127) = 0x7F80;
  at(0, 1, 127, 0) = 0x43E0;
  at(1, 0, 64, 64) = 0x43E1;  // just above 448
  check_against_host(x, rows, cols);
}

// The gathering quantizer (dispatch order): row r of the output is row source_row[r] of x, repeats and
// padding rows (-1: zeros, scale 1) included, bit for bit the host quantizer of the gathered matrix.
TEST(QuantizeKernel, GatherMatchesHostOnTheGatheredRows) {
  POUNCE_REQUIRE_HOPPER();
  auto rng = testing::fresh_rng();
  const int64_t x_rows = 50, cols = 384, rows = 77;
  const std::vector<uint16_t> x = wide_range_bf16(rng, size_t(x_rows * cols), 12);
  std::vector<int32_t> source(rows);
  std::uniform_int_distribution<int32_t> pick(-1, int32_t(x_rows) - 1);
  for (auto& r : source) r = pick(rng);
  source[0] = -1;
  source[1] = int32_t(x_rows) - 1;
  std::vector<float> gathered(size_t(rows * cols), 0.0f);
  for (int64_t r = 0; r < rows; ++r)
    if (source[r] >= 0)
      for (int64_t c = 0; c < cols; ++c) gathered[r * cols + c] = bf16_to_float(x[source[r] * cols + c]);
  const Fp8Rows1x128 want = quantize_1x128(gathered, rows, cols);

  GuardedBuffer d_x(x.size() * sizeof(uint16_t)), d_out(size_t(rows * cols)), d_scales(want.scales.size() * 4);
  CUDA_CHECK(cudaMemcpy(d_x.as<void>(), x.data(), x.size() * sizeof(uint16_t), cudaMemcpyHostToDevice));
  const DeviceBuffer<int32_t> d_source(source);
  d_out.poison();
  d_scales.poison();
  quantize_1x128_gather_device(d_x.as<uint16_t>(), d_source.data(), rows, cols, d_out.as<uint8_t>(),
                               d_scales.as<float>(), nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  expect_bytes_equal(d_out.download(), want.data, "gathered 1x128 data", cols);
  expect_bytes_equal(d_scales.download(), as_bytes(want.scales), "gathered 1x128 scales", cols / 128 * 4);

  // K block-major scales, as the FP8 grouped GEMM reads the gathered rows' (its a_rows = rows).
  d_out.poison();
  d_scales.poison();
  quantize_1x128_gather_device(d_x.as<uint16_t>(), d_source.data(), rows, cols, d_out.as<uint8_t>(),
                               d_scales.as<float>(), nullptr, ScaleLayout{rows});
  CUDA_CHECK(cudaDeviceSynchronize());
  expect_bytes_equal(d_out.download(), want.data, "gathered 1x128 data (K block-major scales)", cols);
  expect_bytes_equal(d_scales.download(), k_block_major_bytes(want, rows), "gathered 1x128 scales, K block-major",
                     rows * 4);
}

// Weights in the data gradients' orientation: three stacked [256, 384] matrices, each block with a scale
// of its own, transposed on the device; bit for bit the host's transpose (itself checked against
// quantizing the transposed values, formats_test).
TEST(QuantizeKernel, TransposedBlocksMatchHost) {
  POUNCE_REQUIRE_HOPPER();
  auto rng = testing::fresh_rng();
  const int64_t matrices = 3, rows = 256, cols = 384;
  const std::vector<uint16_t> x = wide_range_bf16(rng, size_t(matrices * rows * cols), 12);
  std::vector<float> values(x.size());
  for (size_t i = 0; i < x.size(); ++i) values[i] = bf16_to_float(x[i]);
  const Fp8Blocks128x128 q = quantize_128x128(values, matrices * rows, cols);
  const Fp8Blocks128x128 want = transpose_128x128(q, matrices);

  const DeviceBuffer<uint8_t> d_q(q.data);
  const DeviceBuffer<float> d_scales(q.scales);
  GuardedBuffer d_out(want.data.size()), d_out_scales(want.scales.size() * 4);
  d_out.poison();
  d_out_scales.poison();
  transpose_128x128_device(d_q.data(), d_scales.data(), matrices, rows, cols, d_out.as<uint8_t>(),
                           d_out_scales.as<float>(), nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  expect_bytes_equal(d_out.download(), want.data, "transposed data", rows);
  expect_bytes_equal(d_out_scales.download(), as_bytes(want.scales), "transposed scales", rows / 128 * 4);
  EXPECT_THROW(transpose_128x128_device(d_q.data(), d_scales.data(), 1, 100, 128, d_out.as<uint8_t>(),
                                        d_out_scales.as<float>(), nullptr),
               Error);
}

// MXFP8 -> bf16 over every pair of scale code (0 to 255: the subnormal rounding at the low end,
// infinities at the high end, NaN at 0xFF) and E4M3 code (NaNs included), bit for bit the host's
// dequantized values; bad shapes and pointers refused.
TEST(QuantizeKernel, MxDequantizerIsTheHostsOnEveryCode) {
  POUNCE_REQUIRE_HOPPER();
  // Row r: every E4M3 code, every block under scale code r: each (code, scale) pair once.
  Mxfp8 mx{256, 256, std::vector<uint8_t>(256 * 256), std::vector<uint8_t>(256 * 256 / kMxBlock)};
  for (int64_t r = 0; r < mx.rows; ++r) {
    for (int64_t c = 0; c < mx.cols; ++c) mx.data[r * mx.cols + c] = uint8_t(c);
    for (int64_t b = 0; b < mx.cols / kMxBlock; ++b) mx.scales[r * (mx.cols / kMxBlock) + b] = uint8_t(r);
  }
  GuardedBuffer d_q(mx.data.size()), d_scales(mx.scales.size());
  CUDA_CHECK(cudaMemcpy(d_q.as<void>(), mx.data.data(), mx.data.size(), cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(d_scales.as<void>(), mx.scales.data(), mx.scales.size(), cudaMemcpyHostToDevice));
  check_dequantized(
      "MXFP8",
      [&](uint16_t* out) {
        dequantize_mxfp8_device(d_q.as<uint8_t>(), d_scales.as<uint8_t>(), mx.rows, mx.cols, out, nullptr);
      },
      mx.cols, dequantize(mx), nullptr);
  GuardedBuffer d_out(size_t(2 * 32));
  EXPECT_THROW(dequantize_mxfp8_device(d_q.as<uint8_t>(), d_scales.as<uint8_t>(), 1, 48, d_out.as<uint16_t>(), nullptr),
               Error);
  EXPECT_THROW(dequantize_mxfp8_device(nullptr, d_scales.as<uint8_t>(), 1, 32, d_out.as<uint16_t>(), nullptr), Error);
  EXPECT_NO_THROW(dequantize_mxfp8_device(nullptr, nullptr, 0, 32, nullptr, nullptr));
}

// The weight gradients' operands: x [rows, cols] quantized along its rows into its transpose, bit for
// bit the host's 1 x 128 quantizer of the transposed matrix; wide magnitudes, NaNs of both signs, an
// Inf, a zero column block, several tiles both ways.
TEST(QuantizeKernel, TransposedQuantizerIsTheHostsQuantizerOfTheTranspose) {
  POUNCE_REQUIRE_HOPPER();
  auto rng = testing::fresh_rng();
  const int64_t rows = 384, cols = 256;
  std::vector<uint16_t> x = wide_range_bf16(rng, size_t(rows * cols), 12);
  // Every (128-row block, column) its own binade, as the transposed blocks run down the columns.
  std::uniform_int_distribution<int> exponent(1, 254);
  for (int64_t rb = 0; rb < rows / 128; ++rb)
    for (int64_t c = 0; c < cols; ++c) {
      const uint32_t e = uint32_t(exponent(rng));
      for (int64_t r = rb * 128; r < (rb + 1) * 128; ++r)
        x[r * cols + c] = uint16_t((x[r * cols + c] & 0x807Fu) | e << 7);
    }
  for (int64_t r = 256; r < 384; ++r) x[r * cols + 9] = uint16_t(0x0001 + r % 0x7F);  // a block of subnormals
  for (int64_t r = 0; r < 128; ++r) x[r * cols + 7] = uint16_t((x[r * cols + 7] & 0x807Fu) | 100u << 7);
  x[4 * cols + 7] = uint16_t(101u << 7);                    // its block's largest value, beside the NaN
  x[5 * cols + 7] = 0x7FC0;                                 // NaN
  x[6 * cols + 8] = 0xFFC0;                                 // -NaN
  x[200 * cols + 130] = 0xFF80;                             // -Inf
  for (int64_t r = 128; r < 256; ++r) x[r * cols + 3] = 0;  // column 3's second block all zeros
  std::vector<float> transposed(size_t(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) transposed[c * rows + r] = bf16_to_float(x[r * cols + c]);
  const Fp8Rows1x128 want = quantize_1x128(transposed, cols, rows);

  GuardedBuffer d_x(x.size() * sizeof(uint16_t)), d_out(size_t(rows * cols)), d_scales(want.scales.size() * 4);
  CUDA_CHECK(cudaMemcpy(d_x.as<void>(), x.data(), x.size() * sizeof(uint16_t), cudaMemcpyHostToDevice));
  d_out.poison();
  d_scales.poison();
  quantize_1x128_transposed_device(d_x.as<uint16_t>(), rows, cols, d_out.as<uint8_t>(), d_scales.as<float>(), nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  expect_bytes_equal(d_out.download(), want.data, "transposed 1x128 data", rows);
  const std::vector<uint8_t> want_scales = as_bytes(scales_k_block_major(want));  // [rows / 128, cols]
  expect_bytes_equal(d_scales.download(), want_scales, "transposed 1x128 scales", cols * 4);
  // Only the rows in use (the first two row blocks): the third block's part stays untouched.
  const DeviceBuffer<int32_t> in_use(std::vector<int32_t>{256});
  d_out.poison();
  d_scales.poison();
  quantize_1x128_transposed_device(d_x.as<uint16_t>(), rows, cols, d_out.as<uint8_t>(), d_scales.as<float>(), nullptr,
                                   in_use.data());
  CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<uint8_t> partial = d_out.download(), partial_scales = d_scales.download();
  for (int64_t c = 0; c < cols; ++c)
    for (int64_t r = 0; r < rows; ++r)
      ASSERT_EQ(partial[c * rows + r], r < 256 ? want.data[c * rows + r] : kPoison) << "row " << r << ", column " << c;
  for (size_t b = 0; b < partial_scales.size(); ++b)  // row blocks 0 and 1 of the scales, then block 2's
    ASSERT_EQ(partial_scales[b], b < size_t(2 * cols * 4) ? want_scales[b] : kPoison) << "scale byte " << b;
  EXPECT_THROW(quantize_1x128_transposed_device(d_x.as<uint16_t>(), 100, cols, d_out.as<uint8_t>(),
                                                d_scales.as<float>(), nullptr),
               Error);
}

// More tiles than the GPU holds CTAs at once (each CTA loops over several), and a device row count that
// leaves the last row block out: every tile in use bit for bit the host's, the rest untouched.
TEST(QuantizeKernel, TransposedQuantizerLoopsOverMoreTilesThanFitOnTheGpu) {
  POUNCE_REQUIRE_HOPPER();
  auto rng = testing::fresh_rng();
  const int64_t rows = 128 * 96, cols = 128 * 17, used = rows - 128;  // 1615 tiles in use
  const std::vector<uint16_t> x = wide_range_bf16(rng, size_t(rows * cols), 12);
  std::vector<float> transposed(size_t(used * cols));
  for (int64_t r = 0; r < used; ++r)
    for (int64_t c = 0; c < cols; ++c) transposed[c * used + r] = bf16_to_float(x[r * cols + c]);
  const Fp8Rows1x128 want = quantize_1x128(transposed, cols, used);
  const std::vector<float> want_scales = scales_k_block_major(want);  // [used / 128, cols]

  GuardedBuffer d_x(x.size() * sizeof(uint16_t)), d_out(size_t(rows * cols)), d_scales(size_t(rows / 128 * cols * 4));
  CUDA_CHECK(cudaMemcpy(d_x.as<void>(), x.data(), x.size() * sizeof(uint16_t), cudaMemcpyHostToDevice));
  d_out.poison();
  d_scales.poison();
  const DeviceBuffer<int32_t> in_use(std::vector<int32_t>{int32_t(used)});
  quantize_1x128_transposed_device(d_x.as<uint16_t>(), rows, cols, d_out.as<uint8_t>(), d_scales.as<float>(), nullptr,
                                   in_use.data());
  CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<uint8_t> out = d_out.download(), scales = d_scales.download();
  for (int64_t c = 0; c < cols; ++c)
    for (int64_t r = 0; r < rows; ++r)
      ASSERT_EQ(out[c * rows + r], r < used ? want.data[c * used + r] : kPoison) << "row " << r << ", column " << c;
  const std::vector<uint8_t> want_bytes = as_bytes(want_scales);
  for (size_t b = 0; b < scales.size(); ++b)
    ASSERT_EQ(scales[b], b < want_bytes.size() ? want_bytes[b] : kPoison) << "scale byte " << b;
}

TEST(QuantizeKernel, RejectsBadArguments) {
  POUNCE_REQUIRE_HOPPER();
  GuardedBuffer d_x(1024 * 2), d_out(1024), d_scales(64);
  const auto* x = d_x.as<uint16_t>();
  auto* out = d_out.as<uint8_t>();
  EXPECT_THROW(quantize_1x128_device(x, 1, 100, out, d_scales.as<float>(), nullptr), Error);
  EXPECT_THROW(quantize_mxfp8_device(x, 1, 48, out, d_scales.as<uint8_t>(), nullptr), Error);
  EXPECT_THROW(quantize_1x128_device(x, -1, 128, out, d_scales.as<float>(), nullptr), Error);
  EXPECT_THROW(quantize_1x128_device(nullptr, 1, 128, out, d_scales.as<float>(), nullptr), Error);
  EXPECT_THROW(quantize_mxfp8_device(x, 1, 128, nullptr, d_scales.as<uint8_t>(), nullptr), Error);
  EXPECT_THROW(quantize_mxfp8_device(x, 1, 128, out, nullptr, nullptr), Error);
  EXPECT_THROW(quantize_1x128_device(x + 1, 1, 128, out, d_scales.as<float>(), nullptr), Error);  // misaligned
  EXPECT_THROW(quantize_1x128_device(x, 1, 128, out + 4, d_scales.as<float>(), nullptr), Error);
  EXPECT_THROW(quantize_128x128_device(x, 64, 128, out, d_scales.as<float>(), nullptr), Error);  // half a block
  EXPECT_THROW(quantize_128x128_device(x, 128, 128, out, nullptr, nullptr), Error);
  // Empty matrices launch nothing, even with null pointers.
  EXPECT_NO_THROW(quantize_1x128_device(nullptr, 0, 128, nullptr, nullptr, nullptr));
  EXPECT_NO_THROW(quantize_mxfp8_device(nullptr, 4, 0, nullptr, nullptr, nullptr));
  EXPECT_NO_THROW(quantize_128x128_device(nullptr, 0, 256, nullptr, nullptr, nullptr));
  EXPECT_THROW(quantize_1x128_gather_device(x, nullptr, 1, 128, out, d_scales.as<float>(), nullptr), Error);
  // K block-major scales need a slot for every row; 128 x 128 blocks have no such layout.
  testing::expect_error([&] { quantize_1x128_device(x, 4, 128, out, d_scales.as<float>(), nullptr, ScaleLayout{3}); },
                        "ScaleLayout::block_major_rows = 3 must be 0 (row-major scales) or at least rows = 4");
  testing::expect_error(
      [&] {
        dequantize_blockwise_device(out, d_scales.as<float>(), 128, 128, 128, d_x.as<uint16_t>(), nullptr,
                                    ScaleLayout{128});
      },
      "K block-major scales are for 1 x 128 blocks");
  CUDA_CHECK(cudaDeviceSynchronize());
}

}  // namespace
}  // namespace pounce::formats

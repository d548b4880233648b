// Grouped GEMM engine against a host computation in double, on fresh random data each run.
// Padding rows and the unused tail of the A buffer hold NaN: a kernel that lets them leak into valid
// rows, or that reads past an expert's rows, fails the comparison.
#include "gemm/grouped_gemm.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <thread>

#include "common/gpu.h"
#include "common/testing.h"
#include "formats/blockwise.h"
#include "reference/moe_layer.h"

namespace pounce::gemm {
namespace {

using ::testing::HasSubstr;

constexpr uint16_t kBf16NaNBits = 0x7FC0;
constexpr uint16_t kPoisonBits = 0xFFFF;  // what fill_bytes(0xFF) leaves: a NaN

struct Problem {
  int experts = 0;
  int64_t n = 0, k = 0;
  std::vector<int32_t> counts;  // rows per expert
  Epilogue epilogue = Epilogue::kStore;
  bool row_scale = false;

  std::vector<int32_t> offsets;  // padded, [experts + 1]
  int64_t a_rows = 0;            // offsets.back() plus one unused m-block
  std::vector<float> a, b, scale;
  int64_t out_cols() const { return epilogue == Epilogue::kSwiGLU ? n / 2 : n; }
};

Problem make_problem(std::mt19937_64& rng, int experts, int64_t n, int64_t k, std::vector<int32_t> counts,
                     Epilogue epilogue, bool row_scale) {
  Problem p;
  p.experts = experts;
  p.n = n;
  p.k = k;
  p.counts = std::move(counts);
  p.epilogue = epilogue;
  p.row_scale = row_scale;
  p.offsets.assign(experts + 1, 0);
  for (int e = 0; e < experts; ++e) p.offsets[e + 1] = p.offsets[e] + (p.counts[e] + kBlockM - 1) / kBlockM * kBlockM;
  p.a_rows = p.offsets.back() + kBlockM;
  p.a.assign(p.a_rows * k, std::nanf(""));
  const auto values = testing::random_bf16_values(rng, p.a_rows * k);
  for (int e = 0; e < experts; ++e)
    for (int64_t r = p.offsets[e]; r < p.offsets[e] + p.counts[e]; ++r)
      std::copy(values.begin() + r * k, values.begin() + (r + 1) * k, p.a.begin() + r * k);
  const float b_scale = 2.0f / std::sqrt(float(k));
  p.b = testing::random_bf16_values(rng, int64_t(experts) * n * k, -b_scale, b_scale);
  if (row_scale) p.scale = testing::random_bf16_values(rng, p.a_rows, 0.1f, 1.0f);
  return p;
}

// Valid rows of C in double; NaN elsewhere (not compared).
std::vector<double> host_result(const Problem& p) {
  const int64_t cols = p.out_cols();
  std::vector<double> c(p.a_rows * cols, std::nan(""));
  std::vector<double> acc(p.n);
  for (int e = 0; e < p.experts; ++e)
    for (int64_t r = p.offsets[e]; r < p.offsets[e] + p.counts[e]; ++r) {
      for (int64_t j = 0; j < p.n; ++j) {
        double sum = 0;
        const float* a = &p.a[r * p.k];
        const float* b = &p.b[(int64_t(e) * p.n + j) * p.k];
        for (int64_t i = 0; i < p.k; ++i) sum += double(a[i]) * b[i];
        acc[j] = sum;
      }
      const double s = p.row_scale ? p.scale[r] : 1.0;
      for (int64_t j = 0; j < cols; ++j) {
        if (p.epilogue == Epilogue::kSwiGLU) {
          const double g = acc[reference::w13_row(j, false)], u = acc[reference::w13_row(j, true)];
          c[r * cols + j] = s * g / (1.0 + std::exp(-g)) * u;
        } else {
          c[r * cols + j] = s * acc[j];
        }
      }
    }
  return c;
}

struct DeviceProblem {
  DeviceBuffer<uint16_t> a, b, c;
  DeviceBuffer<int32_t> offsets;
  DeviceBuffer<float> scale;

  explicit DeviceProblem(const Problem& p)
      : a(testing::to_bf16_bits(p.a)),
        b(testing::to_bf16_bits(p.b)),
        c(p.a_rows * p.out_cols()),
        offsets(p.offsets),
        scale(p.scale) {}

  GroupedGemmArgs args(const Problem& p) const {
    GroupedGemmArgs g;
    g.a = reinterpret_cast<const __nv_bfloat16*>(a.data());
    g.a_rows = p.a_rows;
    g.b = reinterpret_cast<const __nv_bfloat16*>(b.data());
    g.experts = p.experts;
    g.n = p.n;
    g.k = p.k;
    g.c = reinterpret_cast<__nv_bfloat16*>(c.data());
    g.epilogue = p.epilogue;
    g.expert_offsets = offsets.data();
    g.row_scale = p.row_scale ? scale.data() : nullptr;
    return g;
  }
};

std::vector<uint16_t> run(GroupedGemm& gemm, DeviceProblem& d, const GroupedGemmArgs& args) {
  d.c.fill_bytes(0xFF);
  gemm.run(args, nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  gemm.check_device_errors();
  return d.c.download();
}

void expect_matches(const Problem& p, const std::vector<uint16_t>& got_bits) {
  const auto want = host_result(p);
  const int64_t cols = p.out_cols();
  std::vector<double> got_valid, want_valid;
  int64_t non_finite = 0, tail_written = 0;
  for (int e = 0; e < p.experts; ++e)
    for (int64_t r = p.offsets[e]; r < p.offsets[e] + p.counts[e]; ++r)
      for (int64_t j = 0; j < cols; ++j) {
        const float v = formats::bf16_to_float(got_bits[r * cols + j]);
        non_finite += !std::isfinite(v);
        got_valid.push_back(v);
        want_valid.push_back(want[r * cols + j]);
      }
  // Rows past expert_offsets[experts] belong to no tile: they must still hold the poison.
  for (int64_t i = int64_t(p.offsets.back()) * cols; i < p.a_rows * cols; ++i)
    tail_written += got_bits[i] != kPoisonBits;
  EXPECT_EQ(non_finite, 0) << "valid output rows must be finite (padding NaN leaked, or rows left unwritten)";
  EXPECT_EQ(tail_written, 0) << "rows beyond the experts' m-blocks were written";
  // bf16 output rounding (2^-9 relative) dominates: ~3e-3.
  EXPECT_LT(testing::relative_l2_error(got_valid, want_valid), 1e-2);
  // Row by row too: one row computed from the wrong A row or expert fails here, not in the average.
  if (!got_valid.empty()) {
    EXPECT_LT(testing::worst_token_error(got_valid, want_valid, cols), 3e-2);
  }
}

struct Case {
  const char* name;
  int experts;
  int64_t n, k;
  std::vector<int32_t> counts;  // empty: random in [0, max_count]
  int32_t max_count;
  Epilogue epilogue;
  bool row_scale;
};

void PrintTo(const Case& c, std::ostream* out) { *out << c.name; }

// The case's rows per expert, drawn when it gives none.
std::vector<int32_t> case_counts(std::mt19937_64& rng, const Case& c) {
  std::vector<int32_t> counts = c.counts;
  if (counts.empty()) {
    std::uniform_int_distribution<int32_t> count(0, c.max_count);
    for (int e = 0; e < c.experts; ++e) counts.push_back(count(rng));
  }
  return counts;
}

// `skipped` ran with expert_rows, `computed` without: routed rows must be bit-identical, and the halves of
// tiles that hold no route must still hold the poison. Returns how many such halves there were.
int64_t expect_padding_halves_skipped(const Problem& p, const std::vector<uint16_t>& computed,
                                      const std::vector<uint16_t>& skipped) {
  const int64_t cols = p.out_cols();
  int64_t differing = 0, written = 0, halves = 0;
  for (int e = 0; e < p.experts; ++e) {
    for (int64_t r = p.offsets[e]; r < p.offsets[e] + p.counts[e]; ++r)
      for (int64_t j = 0; j < cols; ++j) differing += skipped[r * cols + j] != computed[r * cols + j];
    // The second half of the last m-block when the routed rows end in its first half.
    const int64_t last = p.offsets[e + 1] - kBlockM, in_last = p.offsets[e] + p.counts[e] - last;
    if (p.counts[e] == 0 || in_last > kBlockM / 2) continue;
    ++halves;
    for (int64_t r = last + kBlockM / 2; r < last + kBlockM; ++r)
      for (int64_t j = 0; j < cols; ++j) written += skipped[r * cols + j] != kPoisonBits;
  }
  EXPECT_EQ(differing, 0) << "skipping padding changed routed rows";
  EXPECT_EQ(written, 0) << "a consumer wrote rows that hold no route";
  return halves;
}

class GroupedGemmTest : public ::testing::TestWithParam<Case> {};

TEST_P(GroupedGemmTest, MatchesHost) {
  POUNCE_REQUIRE_HOPPER();
  auto rng = testing::fresh_rng();
  const Case c = GetParam();
  const Problem p = make_problem(rng, c.experts, c.n, c.k, case_counts(rng, c), c.epilogue, c.row_scale);
  DeviceProblem d(p);
  GroupedGemm gemm;
  const auto first = run(gemm, d, d.args(p));
  expect_matches(p, first);
  // Same inputs, same bits: tiles never split K, so no reduction order can change between runs.
  const auto second = run(gemm, d, d.args(p));
  EXPECT_EQ(std::memcmp(first.data(), second.data(), first.size() * sizeof(uint16_t)), 0) << "not deterministic";

  // The same product with the weights stored N-major, [E, K, N] (the backward's data gradients use the
  // forward's weights this way).
  if (c.epilogue == Epilogue::kStore) {
    SCOPED_TRACE("N-major weights");
    std::vector<float> b_n_major(p.b.size());
    for (int e = 0; e < p.experts; ++e)
      for (int64_t j = 0; j < p.n; ++j)
        for (int64_t i = 0; i < p.k; ++i) b_n_major[(e * p.k + i) * p.n + j] = p.b[(e * p.n + j) * p.k + i];
    d.b.upload(testing::to_bf16_bits(b_n_major));
    GroupedGemmArgs args = d.args(p);
    args.b_major = Major::kMN;
    expect_matches(p, run(gemm, d, args));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, GroupedGemmTest,
    ::testing::Values(
        Case{"one_row_smallest", 1, 64, 64, {1}, 0, Epilogue::kStore, false},
        Case{"one_row_swiglu_narrowest", 1, 64, 64, {1}, 0, Epilogue::kSwiGLU, false},
        Case{"edges_swiglu_scaled", 7, 192, 192, {0, 1, 127, 128, 129, 0, 300}, 0, Epilogue::kSwiGLU, true},
        Case{"many_small_experts", 64, 320, 128, {}, 40, Epilogue::kStore, false},
        Case{"odd_multiples", 3, 448, 576, {500, 260, 0}, 0, Epilogue::kSwiGLU, false},
        Case{"wide_n_scaled", 4, 1024, 512, {700, 300, 900, 129}, 0, Epilogue::kStore, true},
        Case{"deep_k", 2, 256, 2048, {200, 90}, 0, Epilogue::kSwiGLU, true},
        Case{"max_experts", 512, 64, 64, {}, 3, Epilogue::kStore, false}),
    [](const auto& info) { return std::string(info.param.name); });

// ---- k-grouped: C[e] (+)= A[rows of e]^T . B[rows of e], the weight gradients -------------------------

struct KCase {
  const char* name;
  int experts;
  int64_t m, n;
  std::vector<int32_t> counts;  // routed rows per expert (padded to 128-row m-blocks in the buffers)
  Epilogue epilogue;
};

void PrintTo(const KCase& c, std::ostream* out) { *out << c.name; }

class KGroupedGemmTest : public ::testing::TestWithParam<KCase> {};

// Each expert's first row in the row buffers, its rows padded to 128-row m-blocks; [experts] = rows in use.
std::vector<int32_t> padded_offsets(const KCase& c) {
  std::vector<int32_t> offsets(c.experts + 1, 0);
  for (int e = 0; e < c.experts; ++e) offsets[e + 1] = offsets[e] + (c.counts[e] + kBlockM - 1) / kBlockM * kBlockM;
  return offsets;
}

// A case's row layout (each expert's rows padded to m-blocks, one unused m-block at the end of the row
// buffers) and its output C [E, m, n]: poisoned before each run (accumulating: holding `before`),
// downloaded as floats.
struct KGroupedRun {
  const KCase& c;
  const std::vector<int32_t> offsets;
  const int64_t rows;
  std::vector<float> before;  // kAddF32 adds to these
  DeviceBuffer<int32_t> d_offsets;
  DeviceBuffer<float> c32;
  DeviceBuffer<uint16_t> c16;

  KGroupedRun(const KCase& kcase, std::mt19937_64& rng)
      : c(kcase),
        offsets(padded_offsets(kcase)),
        rows(offsets.back() + kBlockM),
        before(testing::random_bf16_values(rng, elems())),
        d_offsets(offsets),
        c32(fp32() ? elems() : 0),
        c16(fp32() ? 0 : elems()) {}
  bool fp32() const { return c.epilogue != Epilogue::kStore; }
  int64_t elems() const { return int64_t(c.experts) * c.m * c.n; }
  // The GEMM's arguments but its operands and C.
  KGroupedGemmArgs args() const {
    KGroupedGemmArgs g;
    g.rows = rows;
    g.m = c.m;
    g.n = c.n;
    g.experts = c.experts;
    g.expert_offsets = d_offsets.data();
    return g;
  }
  // The host's C in double: each expert's rows [offsets[e], offsets[e + 1]) of A [rows, m] and B [rows, n]
  // (padding rows zero in A), added to `before` when accumulating.
  std::vector<double> want(const std::vector<float>& a, const std::vector<float>& b) const {
    std::vector<double> sums(elems());
    for (int e = 0; e < c.experts; ++e)
      for (int64_t i = 0; i < c.m; ++i)
        for (int64_t j = 0; j < c.n; ++j) {
          double sum = c.epilogue == Epilogue::kAddF32 ? before[(e * c.m + i) * c.n + j] : 0.0;
          for (int64_t r = offsets[e]; r < offsets[e + 1]; ++r) sum += double(a[r * c.m + i]) * b[r * c.n + j];
          sums[(e * c.m + i) * c.n + j] = sum;
        }
    return sums;
  }
  std::vector<float> run(GroupedGemm& gemm, KGroupedGemmArgs args) {
    args.c = fp32() ? static_cast<void*>(c32.data()) : static_cast<void*>(c16.data());
    args.epilogue = c.epilogue;
    if (c.epilogue == Epilogue::kAddF32)
      c32.upload(before);
    else if (fp32())
      c32.fill_bytes(0xFF);
    else
      c16.fill_bytes(0xFF);
    gemm.run_k_grouped(args, nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    gemm.check_device_errors();
    std::vector<float> got;
    if (fp32())
      got = c32.download();
    else
      for (uint16_t v : c16.download()) got.push_back(formats::bf16_to_float(v));
    return got;
  }
};

// Against a double-precision host sum. Padding rows are zero in A and finite in B, as the contract asks
// (they are summed like any row); the unused tail of both buffers is NaN, so a tile reading past its
// expert's rows fails. With `expert_rows` the GEMM is given each expert's routed rows, and the rows of
// the K slices wholly past them are NaN in A and B: a tile that sums them fails.
void expect_k_grouped_matches_host(const KCase& c, bool expert_rows) {
  auto rng = testing::fresh_rng();
  const int E = c.experts;
  KGroupedRun out(c, rng);
  const std::vector<int32_t>& offsets = out.offsets;
  const int64_t rows = out.rows;
  std::vector<float> a(rows * c.m, std::nanf("")), b(rows * c.n, std::nanf(""));
  std::vector<float> host_a(rows * c.m, 0.0f), host_b(rows * c.n, 0.0f);  // the skipped slices as zeros
  const auto a_values = testing::random_bf16_values(rng, rows * c.m),
             b_values = testing::random_bf16_values(rng, rows * c.n);
  for (int e = 0; e < E; ++e) {
    const int64_t summed_end =
        expert_rows ? offsets[e] + (c.counts[e] + kBlockK - 1) / kBlockK * kBlockK : offsets[e + 1];
    for (int64_t r = offsets[e]; r < summed_end; ++r) {
      const bool routed = r < offsets[e] + c.counts[e];
      for (int64_t i = 0; i < c.m; ++i) a[r * c.m + i] = host_a[r * c.m + i] = routed ? a_values[r * c.m + i] : 0.0f;
      for (int64_t j = 0; j < c.n; ++j) b[r * c.n + j] = host_b[r * c.n + j] = b_values[r * c.n + j];
    }
  }
  const bool fp32 = out.fp32();
  const std::vector<double> want = out.want(host_a, host_b);

  DeviceBuffer<uint16_t> d_a(testing::to_bf16_bits(a)), d_b(testing::to_bf16_bits(b));
  DeviceBuffer<int32_t> d_expert_rows(c.counts);
  KGroupedGemmArgs args = out.args();
  args.a = reinterpret_cast<const __nv_bfloat16*>(d_a.data());
  args.b = reinterpret_cast<const __nv_bfloat16*>(d_b.data());
  if (expert_rows) args.expert_rows = d_expert_rows.data();
  GroupedGemm gemm;
  const std::vector<float> got = out.run(gemm, args);
  int64_t non_finite = 0;
  for (float v : got) non_finite += !std::isfinite(v);
  EXPECT_EQ(non_finite, 0) << "a weight gradient read padding or rows past its expert, or was left unwritten";
  // fp32 out: the products of bf16 inputs summed in fp32 (~1e-6 relative); bf16 out adds its rounding.
  const double tolerance = fp32 ? 1e-5 : 1e-2;
  EXPECT_LT(testing::relative_l2_error(got, want), tolerance);
  // Expert by expert: each matrix against its own norm (an expert's gradient lost or doubled fails).
  for (int e = 0; e < E; ++e) {
    const std::span<const float> g(got.data() + e * c.m * c.n, c.m * c.n);
    const std::span<const double> w(want.data() + e * c.m * c.n, c.m * c.n);
    EXPECT_LE(relative_l2_error(g, w), tolerance) << "expert " << e << " (" << c.counts[e] << " rows)";
  }
  EXPECT_EQ(out.run(gemm, args), got) << "not deterministic";
}

TEST_P(KGroupedGemmTest, MatchesHost) {
  POUNCE_REQUIRE_HOPPER();
  expect_k_grouped_matches_host(GetParam(), false);
}

TEST_P(KGroupedGemmTest, SkipsTheSlicesPastEachExpertsRoutedRows) {
  POUNCE_REQUIRE_HOPPER();
  expect_k_grouped_matches_host(GetParam(), true);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, KGroupedGemmTest,
    ::testing::Values(KCase{"one_expert_one_row", 1, 64, 64, {1}, Epilogue::kStoreF32},
                      KCase{"empty_experts_store", 5, 128, 256, {0, 300, 0, 129, 0}, Epilogue::kStoreF32},
                      KCase{"empty_experts_accumulate", 5, 128, 256, {0, 300, 0, 129, 0}, Epilogue::kAddF32},
                      KCase{"ragged_m_and_n", 3, 192, 320, {500, 1, 260}, Epilogue::kStoreF32},
                      KCase{"bf16_out", 4, 256, 512, {700, 128, 0, 90}, Epilogue::kStore},
                      // Routes ending on a K slice's edge (64, 192: an all-padding slice follows) or one past it.
                      KCase{"slice_edges", 4, 128, 256, {64, 192, 65, 0}, Epilogue::kStoreF32},
                      KCase{"deep_reduction", 2, 256, 256, {3000, 2200}, Epilogue::kAddF32}),
    [](const auto& info) { return std::string(info.param.name); });

// FP8 k-grouped: the row buffers quantized along their rows and stored transposed, as the backward's
// weight gradients would read them, against a double-precision host sum of the dequantized operands.
// Every 128-row block of every column of A and B has its own magnitude, so each of B's per-column scales
// differs from its neighbours' (a scale applied to the wrong column fails).
class Fp8KGroupedGemmTest : public ::testing::TestWithParam<KCase> {};

// The row buffer [rows, cols] transposed and quantized 1 x 128 along its rows, scales K block-major (the
// host's quantize_1x128_transposed_device), and its dequantized values in row-buffer order.
struct TransposedFp8 {
  DeviceBuffer<uint8_t> q;
  DeviceBuffer<float> scales;
  std::vector<float> exact;  // [rows, cols]
};
TransposedFp8 quantize_transposed(const std::vector<float>& x, int64_t rows, int64_t cols) {
  std::vector<float> t(x.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) t[c * rows + r] = x[r * cols + c];
  const formats::Fp8Rows1x128 q = formats::quantize_1x128(t, cols, rows);
  const std::vector<float> d = formats::dequantize(q);
  std::vector<float> exact(x.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) exact[r * cols + c] = d[c * rows + r];
  return {DeviceBuffer<uint8_t>(q.data), DeviceBuffer<float>(formats::scales_k_block_major(q)), exact};
}

TEST_P(Fp8KGroupedGemmTest, MatchesHostOnTheQuantizedOperands) {
  POUNCE_REQUIRE_HOPPER();
  auto rng = testing::fresh_rng();
  const KCase c = GetParam();
  const int E = c.experts;
  KGroupedRun out(c, rng);
  const std::vector<int32_t>& offsets = out.offsets;
  const int64_t rows = out.rows;
  std::uniform_int_distribution<int> binade(-6, 6);
  const auto spread_values = [&](int64_t cols) {
    std::vector<float> v = testing::random_bf16_values(rng, rows * cols);
    for (int64_t rb = 0; rb < rows / kBlockM; ++rb)
      for (int64_t col = 0; col < cols; ++col) {
        const float f = std::ldexp(1.0f, binade(rng));
        for (int64_t r = rb * kBlockM; r < (rb + 1) * kBlockM; ++r) v[r * cols + col] *= f;
      }
    return v;
  };
  std::vector<float> a = spread_values(c.m), b = spread_values(c.n);
  for (int e = 0; e < E; ++e)  // padding rows zero in A, as the contract asks
    for (int64_t r = offsets[e] + c.counts[e]; r < offsets[e + 1]; ++r)
      for (int64_t i = 0; i < c.m; ++i) a[r * c.m + i] = 0.0f;
  const TransposedFp8 qa = quantize_transposed(a, rows, c.m), qb = quantize_transposed(b, rows, c.n);
  const std::vector<double> want = out.want(qa.exact, qb.exact);

  KGroupedGemmArgs args = out.args();
  args.fp8 = {qa.q.data(), qa.scales.data(), qb.q.data(), qb.scales.data()};
  GroupedGemm gemm;
  const std::vector<float> got = out.run(gemm, args);
  // The tensor cores sum each 128-wide slice of E4M3 products in their own precision before the fp32
  // promotion (up to ~2^-14 relative per slice); bf16 output adds its rounding.
  const double tolerance = out.fp32() ? 1e-3 : 1e-2;
  for (int e = 0; e < E; ++e) {
    const std::span<const float> g(got.data() + e * c.m * c.n, c.m * c.n);
    const std::span<const double> w(want.data() + e * c.m * c.n, c.m * c.n);
    if (c.counts[e] == 0 && c.epilogue != Epilogue::kAddF32) {
      EXPECT_TRUE(std::all_of(g.begin(), g.end(), [](float v) { return v == 0; })) << "expert " << e << " has no rows";
      continue;
    }
    EXPECT_LE(relative_l2_error(g, w), tolerance) << "expert " << e << " (" << c.counts[e] << " rows)";
  }
  EXPECT_EQ(out.run(gemm, args), got) << "not deterministic";
  // One CTA running every tile in turn (stages, turns and store slots carried from tile to tile, empty
  // experts between others): the same bits.
  KGroupedGemmArgs one_cta = args;
  one_cta.max_ctas = 1;
  EXPECT_EQ(out.run(gemm, one_cta), got) << "one CTA for every tile";
  args.m = 192;
  EXPECT_THAT([&] { gemm.run_k_grouped(args, nullptr); },
              ::testing::ThrowsMessage<Error>(HasSubstr("FP8 needs m and n in whole 128-blocks")));
  args.m = c.m;
  args.fp8.b_scale = qb.scales.data() + 1;  // the scale loader copies 16-byte pieces
  EXPECT_THAT([&] { gemm.run_k_grouped(args, nullptr); },
              ::testing::ThrowsMessage<Error>(HasSubstr("fp8.a_scale and fp8.b_scale must be 16-byte aligned")));
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, Fp8KGroupedGemmTest,
    ::testing::Values(KCase{"one_expert_one_row", 1, 128, 128, {1}, Epilogue::kStoreF32},
                      KCase{"empty_experts_store", 5, 128, 256, {0, 300, 0, 129, 0}, Epilogue::kStoreF32},
                      KCase{"empty_experts_accumulate", 5, 128, 256, {0, 300, 0, 129, 0}, Epilogue::kAddF32},
                      KCase{"bf16_out", 4, 256, 384, {700, 128, 0, 90}, Epilogue::kStore},
                      KCase{"deep_reduction", 2, 256, 256, {3000, 2200}, Epilogue::kStoreF32}),
    [](const auto& info) { return std::string(info.param.name); });

// Every scheduling knob must compute the same bits: tiles never split K, so only who computes a tile
// and when changes.
TEST(GroupedGemm, TuningNeverChangesResults) {
  POUNCE_REQUIRE_HOPPER();
  auto rng = testing::fresh_rng();
  std::vector<int32_t> counts;
  std::uniform_int_distribution<int32_t> count(0, 700);
  for (int e = 0; e < 9; ++e) counts.push_back(count(rng));
  const Problem p = make_problem(rng, 9, 576, 320, counts, Epilogue::kSwiGLU, true);
  DeviceProblem d(p);
  GroupedGemm gemm;
  const auto reference_bits = run(gemm, d, d.args(p));
  expect_matches(p, reference_bits);
  for (int band : {1, 3, 100}) {
    SCOPED_TRACE(::testing::Message() << "band_m_blocks " << band);
    const GemmTuning tuning{.band_m_blocks = band};
    GroupedGemmArgs args = d.args(p);
    args.tuning = tuning;
    const auto bits = run(gemm, d, args);
    EXPECT_EQ(std::memcmp(bits.data(), reference_bits.data(), bits.size() * sizeof(uint16_t)), 0);
  }
}

// With each expert's routed rows given, a consumer whose 64 rows of a tile are all padding does no work:
// the routed rows come out as without them, bit for bit, and those padding rows are never written.
TEST(GroupedGemm, PaddingHalvesOfTilesAreSkipped) {
  POUNCE_REQUIRE_HOPPER();
  auto rng = testing::fresh_rng();
  for (const Epilogue epilogue : {Epilogue::kStore, Epilogue::kSwiGLU}) {
    SCOPED_TRACE(epilogue == Epilogue::kSwiGLU ? "SwiGLU" : "store");
    const std::vector<int32_t> counts = {1, 64, 65, 127, 128, 129, 0, 192, 300};
    const Problem p = make_problem(rng, int(counts.size()), 256, 320, counts, epilogue, true);
    DeviceProblem d(p);
    GroupedGemm gemm;
    const auto computed = run(gemm, d, d.args(p));
    DeviceBuffer<int32_t> rows(counts);
    GroupedGemmArgs args = d.args(p);
    args.expert_rows = rows.data();
    const auto skipped = run(gemm, d, args);
    expect_matches(p, skipped);
    EXPECT_EQ(expect_padding_halves_skipped(p, computed, skipped), 5)
        << "the counts should leave five all-padding halves";
  }
}

// The counters start below the target and are raised from another stream while the GEMM runs: first
// half of them, then (after the GEMM has shown it is still waiting) the rest. A GEMM that ignored them
// would be done long before either release; its output must also be right.
TEST(GroupedGemm, WaitsForReadinessCounters) {
  POUNCE_REQUIRE_HOPPER();
  auto rng = testing::fresh_rng();
  const Problem p = make_problem(rng, 3, 256, 128, {300, 0, 200}, Epilogue::kStore, false);
  DeviceProblem d(p);
  const int64_t m_blocks = p.a_rows / kBlockM;
  constexpr uint32_t kTarget = 7;  // counters are epochs: forward 7 waits for 7
  DeviceBuffer<uint32_t> d_ready(std::vector<uint32_t>(m_blocks, kTarget - 1));
  const DeviceBuffer<uint32_t> released(std::vector<uint32_t>(m_blocks, kTarget));
  GroupedGemmArgs args = d.args(p);
  args.m_block_ready = d_ready.data();
  args.ready_target = kTarget;
  GroupedGemm gemm;
  d.c.fill_bytes(0xFF);

  cudaStream_t gemm_stream, release_stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&gemm_stream, cudaStreamNonBlocking));
  CUDA_CHECK(cudaStreamCreateWithFlags(&release_stream, cudaStreamNonBlocking));
  cudaEvent_t done;
  CUDA_CHECK(cudaEventCreate(&done));
  gemm.run(args, gemm_stream);
  CUDA_CHECK(cudaEventRecord(done, gemm_stream));
  const auto still_waiting = [&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the GEMM alone takes microseconds
    const cudaError_t state = cudaEventQuery(done);
    EXPECT_EQ(state, cudaErrorNotReady) << "the GEMM finished before its m-blocks were released";
    return state == cudaErrorNotReady;
  };
  if (still_waiting()) {
    const int64_t half = m_blocks / 2;
    CUDA_CHECK(cudaMemcpyAsync(d_ready.data(), released.data(), half * sizeof(uint32_t), cudaMemcpyDeviceToDevice,
                               release_stream));
    CUDA_CHECK(cudaStreamSynchronize(release_stream));
    still_waiting();
    CUDA_CHECK(cudaMemcpyAsync(d_ready.data() + half, released.data() + half, (m_blocks - half) * sizeof(uint32_t),
                               cudaMemcpyDeviceToDevice, release_stream));
  }
  CUDA_CHECK(cudaStreamSynchronize(gemm_stream));
  gemm.check_device_errors();
  expect_matches(p, d.c.download());
  CUDA_CHECK(cudaEventDestroy(done));
  CUDA_CHECK(cudaStreamDestroy(gemm_stream));
  CUDA_CHECK(cudaStreamDestroy(release_stream));
}

TEST(GroupedGemm, StalledMBlockTimesOutWithANamedError) {
  POUNCE_REQUIRE_HOPPER();
  auto rng = testing::fresh_rng();
  const Problem p = make_problem(rng, 2, 256, 128, {400, 300}, Epilogue::kSwiGLU, false);
  DeviceProblem d(p);
  std::vector<uint32_t> ready(p.a_rows / kBlockM, 4);
  ready[5] = 3;  // m-block 5 (expert 1) never becomes ready
  DeviceBuffer<uint32_t> d_ready(ready);
  GroupedGemmArgs args = d.args(p);
  args.m_block_ready = d_ready.data();
  args.ready_target = 4;
  args.wait_timeout_ns = 20'000'000;  // 20 ms
  GroupedGemm gemm;
  d.c.fill_bytes(0xFF);
  gemm.run(args, nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());  // the kernel must end on its own
  try {
    gemm.check_device_errors();
    FAIL() << "expected a readiness timeout";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("gemm producer"));
    EXPECT_THAT(e.what(), HasSubstr("m-block 5 readiness counter stayed at 3, expected >= 4"));
  }
  // The error was consumed; the next run with every m-block ready succeeds.
  ready[5] = 4;
  d_ready.upload(ready);
  expect_matches(p, run(gemm, d, args));
}

TEST(GroupedGemm, RejectsOffsetsBeyondTheBuffer) {
  POUNCE_REQUIRE_HOPPER();
  auto rng = testing::fresh_rng();
  Problem p = make_problem(rng, 2, 128, 64, {100, 100}, Epilogue::kStore, false);
  DeviceProblem d(p);
  GroupedGemmArgs args = d.args(p);
  args.a_rows = kBlockM;  // offsets say 256 rows
  GroupedGemm gemm;
  gemm.run(args, nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_THROW(
      {
        try {
          gemm.check_device_errors();
        } catch (const Error& e) {
          EXPECT_THAT(e.what(), HasSubstr("expert_offsets[experts] = 256 exceeds the 128 rows"));
          throw;
        }
      },
      Error);
}

// Offsets off the 128-row grid, or going backwards, stop the launch with the offset named: m-grouped, and
// k-grouped, whose tiles would otherwise drop rows without a word.
TEST(GroupedGemm, RejectsOffsetsOffTheGrid) {
  POUNCE_REQUIRE_HOPPER();
  auto rng = testing::fresh_rng();
  GroupedGemm gemm;
  const auto expect_rejected = [&](const std::string& what) {
    CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_THAT([&] { gemm.check_device_errors(); }, ::testing::ThrowsMessage<Error>(HasSubstr(what)));
  };
  Problem p = make_problem(rng, 2, 128, 64, {100, 100}, Epilogue::kStore, false);
  DeviceProblem d(p);
  d.offsets.upload(std::vector<int32_t>{0, 64, 256});
  gemm.run(d.args(p), nullptr);
  expect_rejected("expert_offsets[1] = 64 is not a multiple of 128");

  const KCase kcase{"two_experts", 2, 128, 128, {100, 100}, Epilogue::kStoreF32};
  KGroupedRun run(kcase, rng);
  const DeviceBuffer<uint16_t> a(run.rows * kcase.m), b(run.rows * kcase.n);  // never read
  KGroupedGemmArgs args = run.args();
  args.a = reinterpret_cast<const __nv_bfloat16*>(a.data());
  args.b = reinterpret_cast<const __nv_bfloat16*>(b.data());
  args.c = run.c32.data();
  run.d_offsets.upload(std::vector<int32_t>{0, 256, 128});
  gemm.run_k_grouped(args, nullptr);
  expect_rejected("expert_offsets[2] = 128 is not a multiple of 128, or lies below the offset before it");
}

// ---- FP8: E4M3 operands with 1 x 128 (A) and 128 x 128 (B) power-of-two scales ----------------------

// The problem's operands quantized on the host (formats/blockwise.h), on the device.
struct DeviceFp8Operands {
  DeviceBuffer<uint8_t> a, b;
  DeviceBuffer<float> a_scale, b_scale;
};

// Spreads p's operands over many binades, block by block, so that every scale differs from its
// neighbours (a kernel applying a wrong or no scale fails), then quantizes them and replaces them in `p`
// by their dequantized values: the GEMM's exact inputs, which host_result then multiplies in double.
DeviceFp8Operands quantize_operands(std::mt19937_64& rng, Problem& p) {
  std::uniform_int_distribution<int> binade(-6, 6);
  for (int64_t r = 0; r < p.a_rows; ++r)
    for (int64_t kb = 0; kb < p.k / 128; ++kb) {
      const float f = std::ldexp(1.0f, binade(rng));
      for (int64_t i = kb * 128; i < (kb + 1) * 128; ++i) p.a[r * p.k + i] *= f;
    }
  const int64_t b_rows = int64_t(p.experts) * p.n;
  for (int64_t rb = 0; rb < b_rows / 128; ++rb)
    for (int64_t kb = 0; kb < p.k / 128; ++kb) {
      const float f = std::ldexp(1.0f, binade(rng));
      for (int64_t r = rb * 128; r < (rb + 1) * 128; ++r)
        for (int64_t i = kb * 128; i < (kb + 1) * 128; ++i) p.b[r * p.k + i] *= f;
    }
  const formats::Fp8Rows1x128 qa = formats::quantize_1x128(p.a, p.a_rows, p.k);
  const formats::Fp8Blocks128x128 qb = formats::quantize_128x128(p.b, b_rows, p.k);
  p.a = formats::dequantize(qa);  // NaN padding rows stay NaN
  p.b = formats::dequantize(qb);
  // A's scales K block-major, [k / 128, a_rows], as the GEMM reads them.
  return {DeviceBuffer<uint8_t>(qa.data), DeviceBuffer<uint8_t>(qb.data),
          DeviceBuffer<float>(formats::scales_k_block_major(qa)), DeviceBuffer<float>(qb.scales)};
}

GroupedGemmArgs fp8_args(const Problem& p, const DeviceProblem& d, const DeviceFp8Operands& q) {
  GroupedGemmArgs args = d.args(p);
  args.a = nullptr;
  args.b = nullptr;
  args.fp8 = {q.a.data(), q.a_scale.data(), q.b.data(), q.b_scale.data()};
  return args;
}

class Fp8GroupedGemmTest : public ::testing::TestWithParam<Case> {};

TEST_P(Fp8GroupedGemmTest, MatchesHostOnTheQuantizedOperands) {
  POUNCE_REQUIRE_HOPPER();
  auto rng = testing::fresh_rng();
  const Case c = GetParam();
  Problem p = make_problem(rng, c.experts, c.n, c.k, case_counts(rng, c), c.epilogue, c.row_scale);
  const DeviceFp8Operands q = quantize_operands(rng, p);
  DeviceProblem d(p);
  GroupedGemm gemm;
  const GroupedGemmArgs args = fp8_args(p, d, q);
  const auto first = run(gemm, d, args);
  expect_matches(p, first);
  const auto second = run(gemm, d, args);
  EXPECT_EQ(std::memcmp(first.data(), second.data(), first.size() * sizeof(uint16_t)), 0) << "not deterministic";

  // Padding halves skipped: the routed rows keep their bits, the all-padding halves stay unwritten.
  DeviceBuffer<int32_t> rows(p.counts);
  GroupedGemmArgs skipping = args;
  skipping.expert_rows = rows.data();
  expect_padding_halves_skipped(p, first, run(gemm, d, skipping));
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, Fp8GroupedGemmTest,
    ::testing::Values(
        Case{"one_row_smallest", 1, 128, 128, {1}, 0, Epilogue::kStore, false},
        Case{"one_row_swiglu", 1, 128, 128, {1}, 0, Epilogue::kSwiGLU, false},
        Case{"edges_swiglu_scaled", 7, 256, 384, {0, 1, 127, 128, 129, 0, 300}, 0, Epilogue::kSwiGLU, true},
        Case{"many_small_experts", 64, 384, 128, {}, 40, Epilogue::kStore, false},
        Case{"wide_n_scaled", 4, 1024, 512, {700, 300, 900, 129}, 0, Epilogue::kStore, true},
        Case{"deep_k", 2, 256, 4096, {200, 90}, 0, Epilogue::kSwiGLU, true},
        Case{"odd_deep_k", 3, 256, 1664, {150, 0, 260}, 0, Epilogue::kStore, true}),
    [](const auto& info) { return std::string(info.param.name); });

// An FP8 GEMM behind readiness counters: it waits for a stalled m-block, then reports it by name.
TEST(Fp8GroupedGemm, StalledMBlockTimesOutWithANamedError) {
  POUNCE_REQUIRE_HOPPER();
  auto rng = testing::fresh_rng();
  Problem p = make_problem(rng, 2, 256, 256, {400, 300}, Epilogue::kSwiGLU, false);
  const DeviceFp8Operands q = quantize_operands(rng, p);
  DeviceProblem d(p);
  std::vector<uint32_t> ready(p.a_rows / kBlockM, 2);
  ready[4] = 1;
  DeviceBuffer<uint32_t> d_ready(ready);
  GroupedGemmArgs args = fp8_args(p, d, q);
  args.m_block_ready = d_ready.data();
  args.ready_target = 2;
  args.wait_timeout_ns = 20'000'000;
  GroupedGemm gemm;
  gemm.run(args, nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_THAT([&] { gemm.check_device_errors(); },
              ::testing::ThrowsMessage<Error>(HasSubstr("m-block 4 readiness counter stayed at 1, expected >= 2")));
  ready[4] = 2;
  d_ready.upload(ready);
  expect_matches(p, run(gemm, d, args));
}

TEST(Fp8GroupedGemm, RejectsBadOperandsByName) {
  POUNCE_REQUIRE_HOPPER();
  auto rng = testing::fresh_rng();
  Problem p = make_problem(rng, 2, 256, 256, {100, 100}, Epilogue::kStore, false);
  const DeviceFp8Operands q = quantize_operands(rng, p);
  DeviceProblem d(p);
  GroupedGemm gemm;
  const auto rejects = [&](const GroupedGemmArgs& args, const char* message) {
    EXPECT_THAT([&] { gemm.run(args, nullptr); }, ::testing::ThrowsMessage<Error>(HasSubstr(message)));
  };
  GroupedGemmArgs args = fp8_args(p, d, q);
  args.n = 192;
  rejects(args, "FP8 needs n and k in whole 128-blocks");
  args = fp8_args(p, d, q);
  args.fp8.b_scale = nullptr;
  rejects(args, "an FP8 GEMM needs fp8.a, fp8.a_scale, fp8.b and fp8.b_scale");
  args = fp8_args(p, d, q);
  args.a = d.args(p).a;
  rejects(args, "and no bf16 a or b");
  args = fp8_args(p, d, q);
  args.b_major = Major::kMN;
  rejects(args, "FP8 weights must be K-major");
  args = fp8_args(p, d, q);
  args.fp8.a_scale = q.a_scale.data() + 1;  // the scale loader copies 16-byte pieces
  rejects(args, "fp8.a_scale must be 16-byte aligned");
}

TEST(GroupedGemm, RejectsUnsupportedShapesByName) {
  POUNCE_REQUIRE_HOPPER();
  GroupedGemmArgs args;
  args.experts = 2;
  args.n = 100;
  args.k = 64;
  GroupedGemm gemm;
  try {
    gemm.run(args, nullptr);
    FAIL() << "n = 100 was accepted";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("n = 100 is not supported"));
  }
}

}  // namespace
}  // namespace pounce::gemm

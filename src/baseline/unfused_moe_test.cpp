// The unfused forwards (cuBLAS baseline and pounce's unfused chain) against the host reference: they
// are what the fused kernels are compared with, so they must compute the same layer.
#include <gtest/gtest.h>

#include "baseline/cublas_moe.h"
#include "baseline/pounce_unfused.h"
#include "common/gpu.h"
#include "common/testing.h"
#include "formats/blockwise.h"
#include "formats/numerics.h"
#include "reference/moe_layer.h"
#include "reference/synthetic_routing.h"

namespace pounce::baseline {
namespace {

using reference::RoutingPattern;

struct Case {
  int64_t tokens, hidden, intermediate, experts, topk;
  RoutingPattern pattern;
};

void PrintTo(const Case& c, std::ostream* out) {
  *out << "T" << c.tokens << "_H" << c.hidden << "_I" << c.intermediate << "_E" << c.experts << "_k" << c.topk << "_"
       << reference::routing_pattern_name(c.pattern);
}

class UnfusedMoeTest : public ::testing::TestWithParam<Case> {};

TEST_P(UnfusedMoeTest, MatchesHostReference) {
  POUNCE_REQUIRE_HOPPER();
  auto rng = testing::fresh_rng();
  const Case p = GetParam();
  const auto x = testing::random_bf16_values(rng, p.tokens * p.hidden);
  const auto w13 = testing::random_bf16_values(rng, p.experts * 2 * p.intermediate * p.hidden, -0.1f, 0.1f);
  const auto w2 = testing::random_bf16_values(rng, p.experts * p.hidden * p.intermediate, -0.1f, 0.1f);
  const auto ids = reference::synthetic_topk_ids(p.pattern, p.tokens, int(p.experts), int(p.topk), rng);
  const auto weights = reference::synthetic_topk_weights(p.tokens, int(p.topk), rng);

  const reference::MoeShape shape{p.tokens, p.hidden, p.intermediate, p.experts, p.topk};
  const auto want = reference::moe_forward(shape, {x, ids, weights, w13, w2});

  DeviceBuffer<uint16_t> d_x(testing::to_bf16_bits(x)), d_w13(testing::to_bf16_bits(w13)),
      d_w2(testing::to_bf16_bits(w2)), d_y(p.tokens * p.hidden);
  DeviceBuffer<float> d_weights(weights);
  auto bf16 = [](const DeviceBuffer<uint16_t>& b) { return reinterpret_cast<__nv_bfloat16*>(b.data()); };

  const MoeDims dims{.max_tokens = p.tokens + 5,
                     .hidden = p.hidden,
                     .intermediate = p.intermediate,
                     .experts = p.experts,
                     .topk = p.topk};
  auto check = [&](const char* what, auto&& forward) {
    SCOPED_TRACE(what);
    d_y.fill_bytes(0xFF);  // NaN in bf16: an unwritten element fails the comparison
    forward();
    CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<float> got;
    for (uint16_t b : d_y.download()) got.push_back(formats::bf16_to_float(b));
    // bf16 rounding of x, h13 (cuBLAS only), hidden, out and y: a few 1e-3.
    EXPECT_LT(testing::relative_l2_error(got, want), testing::kBf16LayerL2);
    EXPECT_LT(testing::worst_token_error(got, want, p.hidden), testing::kBf16LayerWorstToken);
  };

  CublasMoe cublas(dims);
  cublas.set_weights(bf16(d_w13), bf16(d_w2));
  cublas.set_routing(ids, p.tokens);
  EXPECT_EQ(cublas.plan().routes, p.tokens * p.topk);
  for (GemmCalls calls : {GemmCalls::kLoop, GemmCalls::kGroupedBatched})
    check(gemm_calls_name(calls), [&] { cublas.forward(bf16(d_x), d_weights.data(), bf16(d_y), calls, nullptr); });

  PounceUnfusedMoe unfused(dims);
  unfused.set_weights(bf16(d_w13), bf16(d_w2));
  unfused.set_routing(ids, p.tokens);
  check("pounce_unfused", [&] {
    unfused.forward(bf16(d_x), d_weights.data(), bf16(d_y), nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    unfused.check_device_errors();
  });
  const auto host_scheduled = d_y.download();

  // Scheduled on the GPU from device routing: the same schedule, so the same bits.
  DeviceBuffer<int32_t> d_ids(ids);
  PounceUnfusedMoe device_scheduled(dims);
  device_scheduled.set_weights(bf16(d_w13), bf16(d_w2));
  check("pounce_unfused, device schedule", [&] {
    device_scheduled.forward_with_device_schedule(bf16(d_x), d_ids.data(), p.tokens, d_weights.data(), bf16(d_y),
                                                  nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    device_scheduled.check_device_errors();
  });
  EXPECT_EQ(d_y.download(), host_scheduled);
}

INSTANTIATE_TEST_SUITE_P(Shapes, UnfusedMoeTest,
                         ::testing::Values(Case{300, 256, 128, 8, 2, RoutingPattern::kUniform},
                                           Case{129, 512, 192, 16, 4, RoutingPattern::kZipf},
                                           Case{64, 256, 64, 16, 4, RoutingPattern::kHalfEmpty},
                                           Case{1, 128, 64, 4, 1, RoutingPattern::kUniform},
                                           Case{200, 384, 256, 6, 3, RoutingPattern::kOneExpert}),
                         testing::NameFromPrintTo());

// ---- the FP8 chain ------------------------------------------------------------------------------------

std::vector<float> fp8_round_trip_rows(std::span<const float> v, int64_t rows, int64_t cols) {
  return formats::dequantize(formats::quantize_1x128(v, rows, cols));
}
std::vector<float> fp8_round_trip_weights(std::span<const float> v, int64_t rows, int64_t cols) {
  return formats::dequantize(formats::quantize_128x128(v, rows, cols));
}

// GEMM1 and SwiGLU as the FP8 chain computes them, on the host: x quantized 1 x 128, w13 128 x 128, the
// sums in double, each route's hidden row rounded to bf16 (GEMM1's output). [tokens * k, I], route-major.
std::vector<float> fp8_hidden_reference(const reference::MoeShape& shape, const reference::MoeInputs& in) {
  const auto xq = fp8_round_trip_rows(in.x, shape.tokens, shape.hidden);
  const auto w13q = fp8_round_trip_weights(in.w13, shape.experts * 2 * shape.intermediate, shape.hidden);
  const auto acts = reference::moe_route_activations(shape, {xq, in.topk_ids, in.topk_weights, w13q, in.w2});
  std::vector<float> hidden(acts.hidden.size());
  for (size_t i = 0; i < hidden.size(); ++i) hidden[i] = formats::round_to_bf16(float(acts.hidden[i]));
  return hidden;
}

// The rest of the chain on the host, from given bf16 hidden rows (route-major): each row quantized
// 1 x 128, w2 128 x 128, GEMM2 in double rounded to bf16 (GEMM2's output), the weighted sum.
std::vector<double> fp8_output_reference(const reference::MoeShape& shape, const reference::MoeInputs& in,
                                         std::span<const float> hidden) {
  const int64_t T = shape.tokens, H = shape.hidden, I = shape.intermediate, E = shape.experts, K = shape.topk;
  const auto w2q = fp8_round_trip_weights(in.w2, E * H, I);
  std::vector<double> y(T * H, 0.0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < K; ++k) {
      const auto hq = fp8_round_trip_rows(hidden.subspan((t * K + k) * I, I), 1, I);
      const int64_t e = in.topk_ids[t * K + k];
      for (int64_t j = 0; j < H; ++j) {
        double o = 0;
        for (int64_t i = 0; i < I; ++i) o += double(w2q[(e * H + j) * I + i]) * hq[i];
        y[t * H + j] += double(in.topk_weights[t * K + k]) * formats::round_to_bf16(float(o));
      }
    }
  return y;
}

class UnfusedFp8Test : public ::testing::TestWithParam<Case> {};

// Against the host model of the same quantization (tight), and against the unquantized layer (the FP8
// error band: E4M3 keeps 3 fraction bits, so each element is off by up to 1/16).
TEST_P(UnfusedFp8Test, MatchesTheQuantizedHostLayer) {
  POUNCE_REQUIRE_HOPPER();
  auto rng = testing::fresh_rng();
  const Case p = GetParam();
  auto x = testing::random_bf16_values(rng, p.tokens * p.hidden, -2.0f, 2.0f);
  // Each token's 128-blocks over several binades, so the gathered rows' scales differ from block to block
  // (a scale laid out or applied wrongly fails).
  testing::spread_blocks(rng, x, p.tokens, p.hidden, 1);
  const auto w13 = testing::random_bf16_values(rng, p.experts * 2 * p.intermediate * p.hidden, -0.1f, 0.1f);
  const auto w2 = testing::random_bf16_values(rng, p.experts * p.hidden * p.intermediate, -0.1f, 0.1f);
  const auto ids = reference::synthetic_topk_ids(p.pattern, p.tokens, int(p.experts), int(p.topk), rng);
  auto weights = reference::synthetic_topk_weights(p.tokens, int(p.topk), rng);
  if (weights.size() > 1) weights[0] = 0.0f;  // an exact-zero router weight (not the only route's)
  const reference::MoeShape shape{p.tokens, p.hidden, p.intermediate, p.experts, p.topk};
  const reference::MoeInputs inputs{x, ids, weights, w13, w2};
  const auto want_hidden = fp8_hidden_reference(shape, inputs);
  const auto unquantized = reference::moe_forward(shape, inputs);

  DeviceBuffer<uint16_t> d_x(testing::to_bf16_bits(x)), d_w13(testing::to_bf16_bits(w13)),
      d_w2(testing::to_bf16_bits(w2)), d_y(p.tokens * p.hidden);
  DeviceBuffer<float> d_weights(weights);
  auto bf16 = [](const DeviceBuffer<uint16_t>& b) { return reinterpret_cast<__nv_bfloat16*>(b.data()); };
  PounceUnfusedMoe chain({.max_tokens = p.tokens + 3,
                          .hidden = p.hidden,
                          .intermediate = p.intermediate,
                          .experts = p.experts,
                          .topk = p.topk});
  chain.set_weights(bf16(d_w13), bf16(d_w2));
  chain.quantize_weights_fp8(nullptr);
  chain.set_routing(ids, p.tokens);
  const auto run = [&] {
    d_y.fill_bytes(0xFF);
    chain.forward_fp8(bf16(d_x), d_weights.data(), bf16(d_y), nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    chain.check_device_errors();
    return d_y.download();
  };
  const auto bits = run();
  std::vector<float> got;
  for (uint16_t b : bits) got.push_back(formats::bf16_to_float(b));
  // GEMM1's hidden rows against the host's, route by route (the chain keeps them by pool row).
  std::vector<uint16_t> pool_hidden(chain.plan().padded_rows * p.intermediate);
  CUDA_CHECK(
      cudaMemcpy(pool_hidden.data(), chain.hidden(), pool_hidden.size() * sizeof(uint16_t), cudaMemcpyDeviceToHost));
  const auto route_row = chain.plan().route_row.download();
  std::vector<float> hidden(want_hidden.size());
  for (size_t r = 0; r < route_row.size(); ++r) {
    ASSERT_GE(route_row[r], 0);
    ASSERT_LT(route_row[r], chain.plan().padded_rows);
    for (int64_t i = 0; i < p.intermediate; ++i)
      hidden[r * p.intermediate + i] = formats::bf16_to_float(pool_hidden[route_row[r] * p.intermediate + i]);
  }
  EXPECT_LT(testing::relative_l2_error(hidden, want_hidden), testing::kBf16LayerL2) << "GEMM1";
  EXPECT_LT(testing::worst_token_error(hidden, want_hidden, p.intermediate), testing::kBf16LayerWorstToken) << "GEMM1";
  // The rest from the device's own hidden rows: where the host's double sums and the device's fp32 ones
  // round a hidden value to different bf16 values, the two can land on either side of an E4M3 rounding
  // step (or a block's amax on either side of a power of two), which moved a short row's token by up to
  // 7.7 %. Quantized from the same bits, GEMM2's inputs are the same, and the output is held to the bf16
  // band.
  const auto want = fp8_output_reference(shape, inputs, hidden);
  EXPECT_LT(testing::relative_l2_error(got, want), testing::kBf16LayerL2);
  EXPECT_LT(testing::worst_token_error(got, want, p.hidden), testing::kBf16LayerWorstToken);
  EXPECT_LT(testing::relative_l2_error(got, unquantized), 0.1) << "FP8 strayed from the unquantized layer";
  EXPECT_EQ(run(), bits) << "not deterministic";
}

INSTANTIATE_TEST_SUITE_P(Shapes, UnfusedFp8Test,
                         ::testing::Values(Case{300, 256, 128, 8, 2, RoutingPattern::kUniform},
                                           Case{77, 512, 384, 16, 8, RoutingPattern::kZipf},
                                           Case{200, 384, 256, 6, 3, RoutingPattern::kOneExpert},
                                           Case{64, 256, 128, 16, 4, RoutingPattern::kHalfEmpty},
                                           Case{1, 128, 128, 4, 1, RoutingPattern::kUniform}),
                         testing::NameFromPrintTo());

TEST(UnfusedMoe, Fp8RejectsShapesOffTheScaleBlocks) {
  POUNCE_REQUIRE_HOPPER();
  DeviceBuffer<uint16_t> w13(4 * 128 * 64), w2(4 * 64 * 64);
  PounceUnfusedMoe chain({.max_tokens = 8, .hidden = 64, .intermediate = 64, .experts = 4, .topk = 2});
  chain.set_weights(reinterpret_cast<__nv_bfloat16*>(w13.data()), reinterpret_cast<__nv_bfloat16*>(w2.data()));
  EXPECT_THROW(
      {
        try {
          chain.quantize_weights_fp8(nullptr);
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("hidden = 64, intermediate = 64"), std::string::npos) << e.what();
          throw;
        }
      },
      Error);
}

TEST(UnfusedMoe, ZeroTokensRunsAndWritesNothing) {
  POUNCE_REQUIRE_HOPPER();
  DeviceBuffer<uint16_t> w13(4 * 128 * 64), w2(4 * 64 * 64);
  auto* w13_ptr = reinterpret_cast<__nv_bfloat16*>(w13.data());
  auto* w2_ptr = reinterpret_cast<__nv_bfloat16*>(w2.data());
  const MoeDims dims{.max_tokens = 8, .hidden = 64, .intermediate = 64, .experts = 4, .topk = 2};
  CublasMoe cublas(dims);
  cublas.set_weights(w13_ptr, w2_ptr);
  cublas.set_routing({}, 0);
  cublas.forward(nullptr, nullptr, nullptr, GemmCalls::kGroupedBatched, nullptr);
  PounceUnfusedMoe unfused(dims);
  unfused.set_weights(w13_ptr, w2_ptr);
  unfused.set_routing({}, 0);
  unfused.forward(nullptr, nullptr, nullptr, nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  unfused.check_device_errors();
  EXPECT_EQ(cublas.plan().padded_rows, 0);
}

}  // namespace
}  // namespace pounce::baseline

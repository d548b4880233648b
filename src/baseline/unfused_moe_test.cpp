// The unfused forwards (cuBLAS baseline and pounce's unfused chain) against the host reference: they
// are what the fused kernels are compared with, so they must compute the same layer.
#include <gtest/gtest.h>

#include "baseline/cublas_moe.h"
#include "baseline/pounce_unfused.h"
#include "common/gpu.h"
#include "common/testing.h"
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

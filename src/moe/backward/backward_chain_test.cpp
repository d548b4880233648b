// The MoE backward chain against the host reference (reference::moe_backward, double accumulation) on
// fresh random inputs: dx token by token, the router-weight gradients route by route, the weight
// gradients expert by expert; outputs poisoned first; bitwise repeats; the three weight-gradient modes;
// the data gradients in FP8.
#include "moe/backward/backward_chain.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <set>

#include "common/device_buffer.h"
#include "common/gpu.h"
#include "common/testing.h"
#include "formats/quantize_kernel.h"
#include "moe/backward/backward_kernels.h"
#include "reference/moe_layer.h"
#include "reference/synthetic_routing.h"

namespace pounce::moe {
namespace {

using reference::RoutingPattern;

struct Case {
  int64_t tokens, hidden, intermediate;
  int experts, topk;
  RoutingPattern pattern;
  bool zero_weights = false;  // every third route's router weight exactly 0
};

void PrintTo(const Case& c, std::ostream* out) {
  *out << "T" << c.tokens << "_H" << c.hidden << "_I" << c.intermediate << "_E" << c.experts << "_k" << c.topk << "_"
       << reference::routing_pattern_name(c.pattern) << (c.zero_weights ? "_zero_weights" : "");
}

template <typename T>
const __nv_bfloat16* bf16(const DeviceBuffer<T>& b) {
  return reinterpret_cast<const __nv_bfloat16*>(b.data());
}

std::vector<float> bf16_floats(const DeviceBuffer<uint16_t>& b) {
  std::vector<float> out;
  for (uint16_t v : b.download()) out.push_back(formats::bf16_to_float(v));
  return out;
}

// Worst of a set of slices' relative errors, each against its own norm (tokens, experts).
double worst_slice_error(const std::vector<float>& got, const std::vector<double>& want, int64_t slice) {
  return testing::worst_token_error(got, want, size_t(slice));
}

// A case's fresh random inputs, on the host (with the reference's gradients) and on the device, and a
// chain for them.
struct Problem {
  int64_t T, H, I, E, k;
  reference::MoeGradients want;
  DeviceBuffer<uint16_t> d_x, d_dy, d_w13, d_w2, d_dx;
  DeviceBuffer<int32_t> d_ids;
  DeviceBuffer<float> d_weights, d_dw, dw13, dw2;
  BackwardChain chain;
  BackwardSource in;
  ExpertGradients out;

  // spread_blocks: every 128-wide block of dy's rows and every 128 x 128 block of the weights scaled by
  // its own power of two (H and I multiples of 128), so that FP8 block scales differ from their
  // neighbours' and a misplaced scale shows as a large error.
  Problem(const Case& c, std::mt19937_64& rng, bool spread_blocks = false)
      : T(c.tokens), H(c.hidden), I(c.intermediate), E(c.experts), k(c.topk), chain(config(c)) {
    const auto x = testing::random_bf16_values(rng, T * H);
    auto dy = testing::random_bf16_values(rng, T * H);
    auto w13 = testing::random_bf16_values(rng, E * 2 * I * H, -0.1f, 0.1f);
    auto w2 = testing::random_bf16_values(rng, E * H * I, -0.1f, 0.1f);
    if (spread_blocks) {
      testing::spread_blocks(rng, dy, T, H, 1);
      testing::spread_blocks(rng, w13, E * 2 * I, H, 128);
      testing::spread_blocks(rng, w2, E * H, I, 128);
    }
    const auto ids = reference::synthetic_topk_ids(c.pattern, T, c.experts, c.topk, rng);
    auto weights = reference::synthetic_topk_weights(T, c.topk, rng);
    if (c.zero_weights)
      for (size_t i = 0; i < weights.size(); i += 3) weights[i] = 0.0f;
    want = reference::moe_backward({T, H, I, E, k}, {x, ids, weights, w13, w2}, dy);
    d_x = DeviceBuffer<uint16_t>(testing::to_bf16_bits(x));
    d_dy = DeviceBuffer<uint16_t>(testing::to_bf16_bits(dy));
    d_w13 = DeviceBuffer<uint16_t>(testing::to_bf16_bits(w13));
    d_w2 = DeviceBuffer<uint16_t>(testing::to_bf16_bits(w2));
    d_dx = DeviceBuffer<uint16_t>(T * H);
    d_ids = DeviceBuffer<int32_t>(ids);
    d_weights = DeviceBuffer<float>(weights);
    d_dw = DeviceBuffer<float>(T * k);
    dw13 = DeviceBuffer<float>(E * 2 * I * H);
    dw2 = DeviceBuffer<float>(E * H * I);
    in = {bf16(d_x),  d_ids.data(), d_weights.data(), T, bf16(d_dy), reinterpret_cast<__nv_bfloat16*>(d_dx.data()),
          d_dw.data()};
    out = {bf16(d_w13), bf16(d_w2), dw13.data(), dw2.data(), WeightGradOutput::kF32};
  }
  static EpConfig config(const Case& c) {
    return {.ranks = 1,
            .experts = c.experts,
            .topk = c.topk,
            .hidden = c.hidden,
            .intermediate = c.intermediate,
            .max_tokens_per_rank = c.tokens + 5};
  }
  // Outputs poisoned, the backward run and waited for.
  void run(const ExpertGradients& experts) {
    for (auto* b : {&d_dw, &dw13, &dw2}) b->fill_bytes(0xFF);
    d_dx.fill_bytes(0xFF);
    chain.run(in, experts, nullptr, nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    chain.check_device_errors();
  }
  // dx over the whole tensor and its worst token; each route's router-weight gradient against its
  // terms' magnitude.
  struct Errors {
    double dx, dx_worst_token, worst_route;
  };
  Errors errors(const std::vector<float>& dx, const std::vector<float>& d_topk) const {
    double worst_route = 0;
    for (int64_t r = 0; r < T * k; ++r)
      worst_route = std::max(worst_route, std::abs(d_topk[r] - want.d_topk_weights[r]) / want.d_topk_scale[r]);
    return {testing::relative_l2_error(dx, want.dx), worst_slice_error(dx, want.dx, H), worst_route};
  }
};

class BackwardChainTest : public ::testing::TestWithParam<Case> {};

TEST_P(BackwardChainTest, MatchesHostReference) {
  POUNCE_REQUIRE_HOPPER();
  auto rng = testing::fresh_rng();
  Problem p(GetParam(), rng);
  const int64_t T = p.T, H = p.H, I = p.I, E = p.E;
  const auto& want = p.want;
  const ExpertGradients& out = p.out;
  auto &dw13 = p.dw13, &dw2 = p.dw2;
  p.run(out);
  const auto dx = bf16_floats(p.d_dx), d_topk = p.d_dw.download(), g13 = dw13.download(), g2 = dw2.download();
  if (T > 0) {
    const Problem::Errors e = p.errors(dx, d_topk);
    std::printf("[ measured ] dx %.3g (worst token %.3g), d_topk_weights worst route %.3g, dW13 %.3g, dW2 %.3g\n", e.dx,
                e.dx_worst_token, e.worst_route, testing::relative_l2_error(g13, want.dw13),
                testing::relative_l2_error(g2, want.dw2));
    // bf16 rounding of the recomputed gate/up rows, da, dgu and dx rows, and of dx: a few 1e-3.
    EXPECT_LT(e.dx, 2e-2);
    EXPECT_LT(e.dx_worst_token, 5e-2);
    // Each route's dot: bf16 rounding of da and of a bounds its error by ~4 * 2^-9 of its terms' sum.
    EXPECT_LT(e.worst_route, 1e-2);
  }
  // Weight gradients expert by expert; an expert nobody chose gets exactly zero.
  for (int64_t e = 0; e < E; ++e) {
    const std::span<const float> got13(g13.data() + e * 2 * I * H, 2 * I * H), got2(g2.data() + e * H * I, H * I);
    const std::span<const double> want13(want.dw13.data() + e * 2 * I * H, 2 * I * H),
        want2(want.dw2.data() + e * H * I, H * I);
    EXPECT_LT(relative_l2_error(got13, want13), 2e-2) << "dW13 of expert " << e;
    EXPECT_LT(relative_l2_error(got2, want2), 2e-2) << "dW2 of expert " << e;
  }

  // Bit for bit again; then the weight gradients accumulated into what is there, and in bf16.
  p.run(out);
  EXPECT_EQ(bf16_floats(p.d_dx), dx);
  EXPECT_EQ(p.d_dw.download(), d_topk);
  EXPECT_EQ(dw13.download(), g13);
  EXPECT_EQ(dw2.download(), g2);
  dw13.upload(g13);
  dw2.upload(g2);
  p.chain.run(p.in, {out.w13, out.w2, dw13.data(), dw2.data(), WeightGradOutput::kAccumulateF32}, nullptr, nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  p.chain.check_device_errors();
  std::vector<float> twice13 = g13, twice2 = g2;
  for (float& v : twice13) v *= 2;
  for (float& v : twice2) v *= 2;
  EXPECT_EQ(dw13.download(), twice13) << "accumulating adds exactly the same gradient once more";
  EXPECT_EQ(dw2.download(), twice2);
  DeviceBuffer<uint16_t> b13(E * 2 * I * H), b2(E * H * I);
  p.chain.run(p.in, {out.w13, out.w2, b13.data(), b2.data(), WeightGradOutput::kBf16}, nullptr, nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  p.chain.check_device_errors();
  // bf16 output is the fp32 gradient rounded once (to nearest even), bit for bit.
  EXPECT_EQ(b13.download(), testing::to_bf16_bits(g13));
  EXPECT_EQ(b2.download(), testing::to_bf16_bits(g2));
}

INSTANTIATE_TEST_SUITE_P(Routings, BackwardChainTest,
                         ::testing::Values(Case{300, 256, 128, 8, 2, RoutingPattern::kUniform},
                                           Case{700, 384, 192, 16, 6, RoutingPattern::kZipf},
                                           Case{500, 256, 256, 8, 8, RoutingPattern::kOneExpert},
                                           Case{333, 192, 128, 16, 3, RoutingPattern::kHalfEmpty},
                                           Case{257, 256, 128, 8, 4, RoutingPattern::kUniform, true},
                                           Case{0, 256, 128, 8, 2, RoutingPattern::kUniform},
                                           Case{1, 128, 64, 4, 1, RoutingPattern::kUniform},
                                           Case{97, 256, 128, 40, 12, RoutingPattern::kUniform}),
                         testing::NameFromPrintTo());

// The data gradients in FP8 (E4M3 weights transposed once per update, dy rows and d(gate, up) quantized
// 1 x 128): within FP8's band of the host reference; dW2, which reads only bf16 rows, is the bf16 chain's
// bit for bit; every output bitwise again on a second run.
class BackwardChainFp8Test : public ::testing::TestWithParam<Case> {};

TEST_P(BackwardChainFp8Test, DataGradientsInFp8MatchTheReferenceWithinFp8Error) {
  POUNCE_REQUIRE_HOPPER();
  auto rng = testing::fresh_rng();
  Problem p(GetParam(), rng, /*spread_blocks=*/true);
  Fp8TransposedWeights fp8(p.E, p.H, p.I);
  ExpertGradients out = p.out;
  out.fp8 = &fp8;
  testing::expect_error([&] { p.chain.run(p.in, out, nullptr, nullptr); },
                        "rank 0's FP8 weights were not refreshed from its w13 and w2");
  Fp8TransposedWeights other(p.E, p.H + 128, p.I);  // never refreshed: its shape is checked first
  out.fp8 = &other;
  testing::expect_error([&] { p.chain.run(p.in, out, nullptr, nullptr); }, "'s FP8 weights are of ");
  out.fp8 = &fp8;
  fp8.refresh(p.out.w13, p.out.w2, nullptr);

  p.run(p.out);
  const std::vector<float> bf16_dw2 = p.dw2.download();
  const std::vector<float> bf16_dx = bf16_floats(p.d_dx);
  p.run(out);
  const auto dx = bf16_floats(p.d_dx), d_topk = p.d_dw.download(), g13 = p.dw13.download(), g2 = p.dw2.download();
  EXPECT_EQ(g2, bf16_dw2) << "dW2 reads bf16 rows only: the bf16 chain's bits";
  if (p.T > 0) {
    EXPECT_NE(dx, bf16_dx) << "the data gradients did not run in FP8";
  }
  if (p.T > 0) {
    const Problem::Errors e = p.errors(dx, d_topk);
    const double dw13 = testing::relative_l2_error(g13, p.want.dw13);
    std::printf(
        "[ measured ] FP8 data gradients: dx %.3g (worst token %.3g), d_topk_weights worst route %.3g, "
        "dW13 %.3g\n",
        e.dx, e.dx_worst_token, e.worst_route, dw13);
    // E4M3 keeps 3 mantissa bits: each quantized operand carries up to 2^-4 relative error per element,
    // a few percent in norm; dx goes through two quantized GEMMs (four operands). Over a handful of
    // tokens the norm is a token's own, held to the per-token band (one token measured 0.103).
    EXPECT_LT(e.dx, p.T >= 16 ? 0.1 : 0.2);
    EXPECT_LT(e.dx_worst_token, 0.2);
    EXPECT_LT(e.worst_route, 0.1);
    EXPECT_LT(dw13, 0.1);
  }
  p.run(out);
  EXPECT_EQ(bf16_floats(p.d_dx), dx);
  EXPECT_EQ(p.d_dw.download(), d_topk);
  EXPECT_EQ(p.dw13.download(), g13);
  EXPECT_EQ(p.dw2.download(), g2);

  // The weight gradients in FP8 too, then alone: dx does not depend on them (the bf16 chain's bits when
  // the data gradients stay bf16); both weight gradients within FP8's band and not the bf16 ones.
  ExpertGradients all_fp8 = out;
  all_fp8.fp8_weight_gradients = true;
  p.run(all_fp8);
  EXPECT_EQ(bf16_floats(p.d_dx), dx) << "the weight gradients changed dx";
  const auto w13_fp8 = p.dw13.download(), w2_fp8 = p.dw2.download();
  ExpertGradients weights_only = p.out;
  weights_only.fp8_weight_gradients = true;
  p.run(weights_only);
  EXPECT_EQ(bf16_floats(p.d_dx), bf16_dx) << "FP8 weight gradients alone changed dx";
  EXPECT_EQ(p.dw2.download(), w2_fp8) << "dW2 reads no data gradient: the same bits either way";
  if (p.T > 0) {
    const double e13 = testing::relative_l2_error(w13_fp8, p.want.dw13),
                 e2 = testing::relative_l2_error(w2_fp8, p.want.dw2);
    std::printf("[ measured ] FP8 weight gradients too: dW13 %.3g, dW2 %.3g\n", e13, e2);
    EXPECT_LT(e13, 0.1);
    EXPECT_LT(e2, 0.1);
    EXPECT_NE(w2_fp8, bf16_dw2) << "the weight gradients did not run in FP8";
  }
  p.run(all_fp8);
  EXPECT_EQ(p.dw13.download(), w13_fp8) << "not deterministic";
  EXPECT_EQ(p.dw2.download(), w2_fp8);
}

INSTANTIATE_TEST_SUITE_P(Routings, BackwardChainFp8Test,
                         ::testing::Values(Case{300, 256, 128, 8, 2, RoutingPattern::kUniform},
                                           Case{700, 384, 256, 16, 6, RoutingPattern::kZipf},
                                           Case{257, 256, 128, 8, 4, RoutingPattern::kHalfEmpty, true},
                                           Case{500, 256, 256, 8, 8, RoutingPattern::kOneExpert},
                                           Case{1, 128, 128, 4, 1, RoutingPattern::kUniform},
                                           Case{0, 256, 128, 8, 2, RoutingPattern::kUniform}),
                         testing::NameFromPrintTo());

// The gather and SwiGLU-backward kernels quantizing the rows they write (the FP8 data gradients'
// operands, with padding rows among them): bit for bit the stand-alone quantizer on their bf16 rows.
TEST(BackwardKernels, QuantizedRowsAreTheQuantizersBits) {
  POUNCE_REQUIRE_HOPPER();
  auto rng = testing::fresh_rng();
  const int64_t T = 37, H = 384, I = 256, k = 2, rows = 64;
  auto x = testing::random_bf16_values(rng, T * H), dy = testing::random_bf16_values(rng, T * H);
  auto h13 = testing::random_bf16_values(rng, rows * 2 * I), da = testing::random_bf16_values(rng, rows * I);
  testing::spread_blocks(rng, dy, T, H, 1);
  testing::spread_blocks(rng, h13, rows, 2 * I, 1);
  testing::spread_blocks(rng, da, rows, I, 1);
  const auto weights = reference::synthetic_topk_weights(T, k, rng);
  std::vector<int32_t> source(rows, 0), token(rows), slot(rows);
  for (int64_t r = 0; r < rows; ++r) {
    token[r] = r % 5 == 4 ? -1 : int32_t((r * 7) % T);  // every fifth row padding
    slot[r] = int32_t(r % k);
  }
  const DeviceBuffer<uint16_t> d_x(testing::to_bf16_bits(x)), d_dy(testing::to_bf16_bits(dy)),
      d_h13(testing::to_bf16_bits(h13)), d_da(testing::to_bf16_bits(da));
  const DeviceBuffer<float> d_weights(weights);
  const DeviceBuffer<int32_t> d_source(source), d_token(token), d_slot(slot);
  DeviceBuffer<uint16_t> x_rows(rows * H), dy_rows(rows * H), dgu(rows * 2 * I), wa(rows * I);
  DeviceBuffer<float> row_weight(rows), route_dot(rows);
  // Each quantized output twice: by the kernel that writes the rows, and by the quantizer after it.
  struct Quantized {
    DeviceBuffer<uint8_t> data;
    DeviceBuffer<float> scales;
    explicit Quantized(int64_t elements) : data(elements), scales(elements / 128) {
      data.fill_bytes(0xAB);
      scales.fill_bytes(0xAB);
    }
    backward::Fp8Rows rows() { return {data.data(), scales.data()}; }
  };
  Quantized dy_fused(rows * H), dy_after(rows * H), dgu_fused(rows * 2 * I), dgu_after(rows * 2 * I);
  backward::RouteSources from{};
  from.tokens[0] = int32_t(T);
  from.x[0] = bf16(d_x);
  from.dy[0] = bf16(d_dy);
  from.topk_weights[0] = d_weights.data();
  backward::gather_route_rows(
      from, d_source.data(), d_token.data(), d_slot.data(), rows, H, k, reinterpret_cast<__nv_bfloat16*>(x_rows.data()),
      true, reinterpret_cast<__nv_bfloat16*>(dy_rows.data()), row_weight.data(), nullptr, dy_fused.rows());
  backward::swiglu_backward_rows(
      bf16(d_h13), bf16(d_da), row_weight.data(), d_token.data(), rows, I, reinterpret_cast<__nv_bfloat16*>(dgu.data()),
      reinterpret_cast<__nv_bfloat16*>(wa.data()), route_dot.data(), nullptr, dgu_fused.rows());
  const formats::ScaleLayout k_block_major{rows};  // as the FP8 data-gradient GEMMs read them
  formats::quantize_1x128_device(dy_rows.data(), rows, H, dy_after.data.data(), dy_after.scales.data(), nullptr,
                                 k_block_major);
  formats::quantize_1x128_device(dgu.data(), rows, 2 * I, dgu_after.data.data(), dgu_after.scales.data(), nullptr,
                                 k_block_major);
  CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_EQ(dy_fused.data.download(), dy_after.data.download());
  EXPECT_EQ(dy_fused.scales.download(), dy_after.scales.download());
  EXPECT_EQ(dgu_fused.data.download(), dgu_after.data.download());
  EXPECT_EQ(dgu_fused.scales.download(), dgu_after.scales.download());
  const std::vector<float> scales = dy_after.scales.download();
  EXPECT_GT(std::set<float>(scales.begin(), scales.end()).size(), 3u) << "blocks of several magnitudes";
  testing::expect_error(
      [&] {
        backward::gather_route_rows(from, d_source.data(), d_token.data(), d_slot.data(), rows, H + 64, k,
                                    reinterpret_cast<__nv_bfloat16*>(x_rows.data()), true,
                                    reinterpret_cast<__nv_bfloat16*>(dy_rows.data()), row_weight.data(), nullptr,
                                    dy_fused.rows());
      },
      "a multiple of 128");
}

TEST(BackwardChain, RejectsBadInputByName) {
  POUNCE_REQUIRE_HOPPER();
  const EpConfig config{
      .ranks = 1, .experts = 8, .topk = 2, .hidden = 128, .intermediate = 64, .max_tokens_per_rank = 16};
  BackwardChain chain(config);
  DeviceBuffer<uint16_t> x(16 * 128);
  BackwardSource in{bf16(x), nullptr, nullptr, 17, bf16(x), nullptr, nullptr};
  testing::expect_error([&] { chain.run(in, {}, nullptr, nullptr); },
                        "17 tokens, outside [0, max_tokens_per_rank = 16]");
  in.tokens = 4;
  testing::expect_error([&] { chain.run(in, {}, nullptr, nullptr); }, "rank 0's topk_ids is a null pointer");
  EpConfig two = config;
  two.ranks = 2;
  testing::expect_error([&] { BackwardChain bad(two); }, "2 ranks need every rank's dx slots, got 0");
}

}  // namespace
}  // namespace pounce::moe

// The fused MoE forward (pounce::FusedMoe) on virtual ranks against the host reference of the
// expert-parallel layer (reference::moe_layer_ep), on fresh random inputs every run; outputs are
// poisoned with NaN first and compared over the whole tensor and token by token. Also: bitwise-
// identical repeats, each rank holding only its experts, a stalled rank that must end in an error (not
// a hang), bad input named and contained.
#include "pounce/fused_moe.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <tuple>
#include <type_traits>

#include "baseline/cublas_moe.h"
#include "baseline/pounce_unfused.h"
#include "bench/device_fill.h"
#include "comm/nccl_window.h"
#include "common/device_buffer.h"
#include "common/gpu.h"
#include "common/testing.h"
#include "common/tiles.h"
#include "common/timeline.h"
#include "moe/layer_testing.h"
#include "reference/moe_layer.h"
#include "reference/moe_layer_ep.h"
#include "reference/synthetic_routing.h"

namespace pounce::moe {
namespace {

using reference::RoutingPattern;
using ::testing::AnyOf;
using ::testing::HasSubstr;

constexpr int kMinRing = -1;  // Case::ring_blocks: the smallest ring the layer accepts

struct Case {
  int ranks;
  int64_t tokens;  // rank r gets tokens + r, capped at max_tokens (so counts differ and are odd too)
  int64_t hidden, intermediate;
  int experts, topk;
  RoutingPattern pattern;
  int ring_blocks = 0;    // 0: default; kMinRing: the smallest ring of one-m-block minibatches (case_options)
  int comm_ctas = 0;      // 0: default
  int ctas_per_rank = 0;  // 0: default
};

void PrintTo(const Case& c, std::ostream* out) {
  *out << "P" << c.ranks << "_T" << c.tokens << "_H" << c.hidden << "_I" << c.intermediate << "_E" << c.experts << "_k"
       << c.topk << "_" << reference::routing_pattern_name(c.pattern);
  if (c.ring_blocks == kMinRing) *out << "_ringmin";
  if (c.comm_ctas) *out << "_comm" << c.comm_ctas;
  if (c.ctas_per_rank) *out << "_ctas" << c.ctas_per_rank;
}

__nv_bfloat16* bf16(const DeviceBuffer<uint16_t>& b) { return reinterpret_cast<__nv_bfloat16*>(b.data()); }

// Inputs of every rank on the host (reference) and on the device (layer).
struct Problem {
  EpConfig config;
  std::vector<int64_t> tokens;
  std::vector<std::vector<float>> x, weights;
  std::vector<std::vector<int32_t>> ids;
  std::vector<float> w13, w2;  // every expert's, for the reference
  std::vector<DeviceBuffer<uint16_t>> d_x, d_y;
  std::vector<DeviceBuffer<int32_t>> d_ids;
  std::vector<DeviceBuffer<float>> d_weights;
  std::vector<DeviceBuffer<uint16_t>> d_w13, d_w2;  // [rank]: its own experts only, an allocation each

  std::vector<RankIO> io() const {
    std::vector<RankIO> out(config.ranks);
    for (int r = 0; r < config.ranks; ++r)
      out[r] = {bf16(d_x[r]), d_ids[r].data(), d_weights[r].data(), tokens[r], bf16(d_y[r])};
    return out;
  }
  std::vector<ExpertWeights> local_weights() const {
    std::vector<ExpertWeights> out;
    for (int r = 0; r < config.ranks; ++r) out.push_back({bf16(d_w13[r]), bf16(d_w2[r])});
    return out;
  }
  void load_weights(FusedMoe& layer) const { layer.set_weights(local_weights()); }
  void poison_outputs() {
    for (auto& y : d_y) y.fill_bytes(0xFF);  // NaN in bf16: an unwritten element fails the comparison
  }
  std::vector<std::vector<uint16_t>> outputs() const {
    std::vector<std::vector<uint16_t>> out;
    for (const auto& y : d_y) out.push_back(y.download());
    return out;
  }
};

Problem make_problem(std::mt19937_64& rng, const Case& c) {
  Problem p;
  p.config = {.ranks = c.ranks,
              .experts = c.experts,
              .topk = c.topk,
              .hidden = c.hidden,
              .intermediate = c.intermediate,
              .max_tokens_per_rank = c.tokens + 3};
  const int64_t H = c.hidden, I = c.intermediate, E = c.experts;
  for (int r = 0; r < c.ranks; ++r) {
    const int64_t t = c.tokens == 0 ? 0 : std::min(c.tokens + r, p.config.max_tokens_per_rank);
    p.tokens.push_back(t);
    p.x.push_back(testing::random_bf16_values(rng, t * H));
    p.ids.push_back(reference::synthetic_topk_ids(c.pattern, t, c.experts, c.topk, rng));
    p.weights.push_back(reference::synthetic_topk_weights(t, c.topk, rng));
    p.d_x.emplace_back(testing::to_bf16_bits(p.x.back()));
    p.d_ids.emplace_back(p.ids.back());
    p.d_weights.emplace_back(p.weights.back());
    p.d_y.emplace_back(t * H);
  }
  p.w13 = testing::random_bf16_values(rng, E * 2 * I * H, -0.1f, 0.1f);
  p.w2 = testing::random_bf16_values(rng, E * H * I, -0.1f, 0.1f);
  // Rank r's weights: experts [r E/P, (r+1) E/P), in an allocation of exactly that size.
  const int64_t w13_share = E / c.ranks * 2 * I * H, w2_share = E / c.ranks * H * I;
  const auto w13_bits = testing::to_bf16_bits(p.w13), w2_bits = testing::to_bf16_bits(p.w2);
  for (int r = 0; r < c.ranks; ++r) {
    p.d_w13.emplace_back(std::span(w13_bits).subspan(r * w13_share, w13_share));
    p.d_w2.emplace_back(std::span(w2_bits).subspan(r * w2_share, w2_share));
  }
  return p;
}

std::vector<reference::EpRankResult> reference_forward(const Problem& p) {
  std::vector<reference::EpRankInputs> in(p.config.ranks);
  for (int r = 0; r < p.config.ranks; ++r) in[r] = {p.tokens[r], p.x[r], p.ids[r], p.weights[r], {}};
  return reference::moe_layer_ep(p.config, in, p.w13, p.w2, /*with_backward=*/false);
}

void run_and_check(FusedMoe& layer, Problem& p) {
  p.poison_outputs();
  const auto io = p.io();
  layer.forward(io, nullptr);
  const cudaError_t synced = cudaDeviceSynchronize();
  layer.check_device_errors();  // first: after a trap its record says more than the CUDA error
  CUDA_CHECK(synced);
}

void expect_matches(const std::vector<std::vector<uint16_t>>& outputs, const std::vector<reference::EpRankResult>& want,
                    int64_t hidden) {
  for (size_t r = 0; r < outputs.size(); ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    std::vector<float> got;
    for (uint16_t b : outputs[r]) got.push_back(formats::bf16_to_float(b));
    if (!got.empty()) {
      EXPECT_LT(testing::relative_l2_error(got, want[r].y), testing::kBf16LayerL2);
      EXPECT_LT(testing::worst_token_error(got, want[r].y, hidden), testing::kBf16LayerWorstToken);
    }
  }
}

// One forward on fresh (poisoned) outputs, checked against the host reference.
void run_and_expect_reference(FusedMoe& layer, Problem& p) {
  run_and_check(layer, p);
  expect_matches(p.outputs(), reference_forward(p), p.config.hidden);
}

// A case's layer options: its CTA counts and ring; kMinRing gives one-m-block minibatches and the
// smallest ring the queue allows (two minibatches, three for the E4M3 forward's queue).
FusedMoeOptions case_options(const Case& c, bool fp8_forward = false) {
  FusedMoeOptions options;
  options.fp8_forward = fp8_forward;
  options.comm_ctas = c.comm_ctas;
  options.ctas_per_rank = c.ctas_per_rank;
  if (c.ring_blocks == kMinRing) {
    options.minibatch_rows = 128;
    options.ring_blocks = fp8_forward ? 3 : 2;
  } else {
    options.ring_blocks = c.ring_blocks;
  }
  return options;
}

class FusedMoeTest : public ::testing::TestWithParam<Case> {};

TEST_P(FusedMoeTest, MatchesHostReferenceAndRepeatsBitwise) {
  POUNCE_REQUIRE_HOPPER();
  auto rng = testing::fresh_rng();
  const Case c = GetParam();
  Problem p = make_problem(rng, c);
  FusedMoe layer(p.config, case_options(c));
  p.load_weights(layer);

  run_and_expect_reference(layer, p);
  const auto first = p.outputs();
  if (c.ring_blocks == kMinRing && layer.max_m_blocks() > 2) {
    EXPECT_EQ(layer.ring_blocks(), 2);
  }

  // Same inputs again: bit for bit the same outputs (counters continue from the previous forward).
  for (int repeat = 0; repeat < 2; ++repeat) {
    run_and_check(layer, p);
    EXPECT_EQ(p.outputs(), first) << "repeat " << repeat;
  }
}

INSTANTIATE_TEST_SUITE_P(
    VirtualRanks, FusedMoeTest,
    ::testing::Values(Case{1, 300, 256, 128, 8, 2, RoutingPattern::kUniform},
                      Case{1, 2000, 1024, 512, 16, 6, RoutingPattern::kZipf, kMinRing, 4},
                      Case{1, 2000, 1024, 512, 16, 6, RoutingPattern::kZipf},
                      Case{1, 700, 256, 192, 8, 4, RoutingPattern::kOneExpert, 0, 0, 40},
                      Case{1, 333, 384, 128, 16, 3, RoutingPattern::kHalfEmpty},
                      Case{1, 0, 256, 128, 8, 2, RoutingPattern::kUniform},
                      Case{1, 1, 128, 64, 4, 1, RoutingPattern::kUniform},
                      Case{1, 97, 256, 128, 40, 33, RoutingPattern::kUniform},  // k > 32: rows past a lane each
                      Case{2, 129, 512, 192, 16, 4, RoutingPattern::kZipf, kMinRing, 1},
                      Case{2, 0, 256, 128, 8, 2, RoutingPattern::kUniform},
                      Case{2, 61, 192, 128, 16, 12, RoutingPattern::kZipf, kMinRing},  // k > 8, 24 vectors a row
                      Case{2, 500, 256, 256, 8, 8, RoutingPattern::kOneExpert, 0, 30},
                      Case{4, 64, 256, 64, 16, 4, RoutingPattern::kHalfEmpty, 0, 3},
                      Case{4, 1000, 384, 256, 8, 3, RoutingPattern::kUniform, kMinRing, 6},
                      Case{8, 1, 128, 64, 8, 1, RoutingPattern::kUniform},
                      Case{8, 257, 256, 128, 16, 4, RoutingPattern::kOneExpert, kMinRing},
                      Case{8, 77, 192, 320, 32, 5, RoutingPattern::kZipf, 0, 8, 12},
                      // Rank counts that are not powers of two (44, 26, 22 and 18 CTAs per rank).
                      Case{3, 211, 256, 192, 12, 3, RoutingPattern::kZipf},
                      Case{5, 50, 192, 64, 10, 7, RoutingPattern::kUniform, kMinRing},
                      Case{6, 101, 128, 128, 12, 4, RoutingPattern::kHalfEmpty},
                      Case{7, 33, 256, 128, 14, 2, RoutingPattern::kOneExpert, kMinRing}),
    testing::NameFromPrintTo());

// ---- the E4M3 forward ----------------------------------------------------------------------------------

// Rank r's outputs from pounce's unfused FP8 chain (baseline::PounceUnfusedMoe::forward_fp8, checked
// against the host model of the same quantization by its own tests) given every expert's weights: the
// same quantizers, FP8 GEMM tiles and weighted sums, so the fused E4M3 forward must give its bits.
std::vector<uint16_t> unfused_fp8_outputs(const Problem& p, int r) {
  const EpConfig& c = p.config;
  const DeviceBuffer<uint16_t> w13(testing::to_bf16_bits(p.w13)), w2(testing::to_bf16_bits(p.w2));
  DeviceBuffer<uint16_t> y(p.tokens[r] * c.hidden);
  y.fill_bytes(0xFF);
  baseline::PounceUnfusedMoe chain({.max_tokens = p.tokens[r],
                                    .hidden = c.hidden,
                                    .intermediate = c.intermediate,
                                    .experts = c.experts,
                                    .topk = c.topk});
  chain.set_weights(bf16(w13), bf16(w2));
  chain.quantize_weights_fp8(nullptr);
  chain.set_routing(p.ids[r], p.tokens[r]);
  chain.forward_fp8(bf16(p.d_x[r]), p.d_weights[r].data(), bf16(y), nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  chain.check_device_errors();
  return y.download();
}

// Each token's 128-blocks spread over several binades (so their scales differ and a scale applied to the
// wrong block fails), and one exact-zero router weight.
void spread_fp8_inputs(std::mt19937_64& rng, Problem& p) {
  for (int r = 0; r < p.config.ranks; ++r) {
    testing::spread_blocks(rng, p.x[r], p.tokens[r], p.config.hidden, 1);
    p.d_x[r] = DeviceBuffer<uint16_t>(testing::to_bf16_bits(p.x[r]));
  }
  if (p.config.topk > 1 && p.tokens[0] > 0) {
    p.weights[0][0] = 0.0f;
    p.d_weights[0] = DeviceBuffer<float>(p.weights[0]);
  }
}

FusedMoeOptions fp8_options(const Case& c) { return case_options(c, /*fp8_forward=*/true); }

// Every rank's outputs against the unfused FP8 chain's bits and, within the FP8 band (E4M3 keeps 3
// fraction bits), the unquantized host layer.
void expect_fp8_forward(const Problem& p, const std::vector<std::vector<uint16_t>>& got) {
  const auto unquantized = reference_forward(p);
  for (int r = 0; r < p.config.ranks; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    if (p.tokens[r] == 0) continue;
    EXPECT_EQ(got[r], unfused_fp8_outputs(p, r)) << "not the unfused FP8 chain's bits";
    std::vector<float> values;
    for (uint16_t b : got[r]) values.push_back(formats::bf16_to_float(b));
    EXPECT_LT(testing::relative_l2_error(values, unquantized[r].y), 0.1) << "FP8 strayed from the unquantized layer";
  }
}

// An E4M3 layer's first forward of p (its weights loaded and their E4M3 copies refreshed), checked by
// expect_fp8_forward; returns its outputs.
std::vector<std::vector<uint16_t>> first_fp8_forward(FusedMoe& layer, Problem& p) {
  p.load_weights(layer);
  layer.refresh_fp8_weights(nullptr);
  run_and_check(layer, p);
  auto outputs = p.outputs();
  expect_fp8_forward(p, outputs);
  return outputs;
}

class FusedFp8Test : public ::testing::TestWithParam<Case> {};

TEST_P(FusedFp8Test, HasTheBitsOfTheUnfusedFp8Chain) {
  POUNCE_REQUIRE_HOPPER();
  auto rng = testing::fresh_rng();
  const Case c = GetParam();
  Problem p = make_problem(rng, c);
  spread_fp8_inputs(rng, p);
  FusedMoe layer(p.config, fp8_options(c));
  const auto first = first_fp8_forward(layer, p);
  for (int repeat = 0; repeat < 2; ++repeat) {
    run_and_check(layer, p);
    EXPECT_EQ(p.outputs(), first) << "repeat " << repeat;
  }
}

// H and I multiples of 128 (E4M3 blocks). I = 1152 splits an m-block's nine blocks over two Q items.
INSTANTIATE_TEST_SUITE_P(VirtualRanks, FusedFp8Test,
                         ::testing::Values(Case{1, 300, 256, 128, 8, 2, RoutingPattern::kUniform},
                                           Case{1, 700, 512, 384, 16, 6, RoutingPattern::kZipf, kMinRing, 4},
                                           Case{1, 333, 384, 256, 16, 3, RoutingPattern::kHalfEmpty},
                                           Case{1, 1, 128, 128, 4, 1, RoutingPattern::kUniform},
                                           Case{1, 0, 256, 128, 8, 2, RoutingPattern::kUniform},
                                           Case{2, 129, 512, 256, 16, 4, RoutingPattern::kZipf, kMinRing, 1},
                                           Case{2, 90, 256, 1152, 8, 2, RoutingPattern::kUniform, kMinRing},
                                           Case{3, 211, 256, 384, 12, 3, RoutingPattern::kZipf},
                                           Case{4, 64, 256, 128, 16, 4, RoutingPattern::kHalfEmpty, 0, 3},
                                           Case{5, 50, 384, 128, 10, 7, RoutingPattern::kUniform, kMinRing},
                                           Case{8, 257, 256, 128, 16, 4, RoutingPattern::kOneExpert, kMinRing}),
                         testing::NameFromPrintTo());

// One layer, forwards whose token counts and routings change (the ring and the quantized tokens reused),
// then a training forward and its backward (the chain's, from the kept gate/up rows of the E4M3 GEMM1)
// against the bf16 layer's gradients within the FP8 band.
TEST(FusedMoe, Fp8ForwardAcrossChangingRoutingsAndItsBackward) {
  POUNCE_REQUIRE_HOPPER();
  auto rng = testing::fresh_rng();
  const Case shape{3, 150, 256, 256, 12, 4, RoutingPattern::kZipf, kMinRing};
  Problem p = make_problem(rng, shape);
  FusedMoe layer(p.config, fp8_options(shape));
  p.load_weights(layer);
  layer.refresh_fp8_weights(nullptr);
  for (const auto& [tokens, pattern] : {std::pair{150, RoutingPattern::kZipf},
                                        {7, RoutingPattern::kUniform},
                                        {131, RoutingPattern::kOneExpert},
                                        {40, RoutingPattern::kHalfEmpty}}) {
    SCOPED_TRACE("tokens " + std::to_string(tokens));
    Problem next = make_problem(rng, {3, tokens, 256, 256, 12, 4, pattern, kMinRing});
    for (int r = 0; r < 3; ++r) {  // the layer's weights stay; the inputs change
      p.tokens[r] = next.tokens[r];
      p.x[r] = std::move(next.x[r]), p.ids[r] = std::move(next.ids[r]), p.weights[r] = std::move(next.weights[r]);
      p.d_x[r] = std::move(next.d_x[r]), p.d_ids[r] = std::move(next.d_ids[r]);
      p.d_weights[r] = std::move(next.d_weights[r]), p.d_y[r] = std::move(next.d_y[r]);
    }
    run_and_check(layer, p);
    expect_fp8_forward(p, p.outputs());
  }

  // Training step: the FP8 layer's gradients against the bf16 layer's.
  FusedMoe bf16_layer(p.config);
  p.load_weights(bf16_layer);
  const int P = p.config.ranks;
  const int64_t H = p.config.hidden, I = p.config.intermediate, E = p.config.local_experts();
  struct Grads {
    std::vector<DeviceBuffer<uint16_t>> dx;
    std::vector<DeviceBuffer<float>> d_weights, dw13, dw2;
  };
  std::vector<DeviceBuffer<uint16_t>> dy;
  for (int r = 0; r < P; ++r) dy.emplace_back(testing::to_bf16_bits(testing::random_bf16_values(rng, p.tokens[r] * H)));
  const auto train = [&](FusedMoe& l) {
    Grads g;
    std::vector<RankGrads> grads(P);
    for (int r = 0; r < P; ++r) {
      g.dx.emplace_back(p.tokens[r] * H);
      g.d_weights.emplace_back(p.tokens[r] * p.config.topk);
      g.dw13.emplace_back(E * 2 * I * H);
      g.dw2.emplace_back(E * H * I);
      g.dx.back().fill_bytes(0xFF);
      grads[r] = {bf16(dy[r]), bf16(g.dx.back()), g.d_weights.back().data(), g.dw13.back().data(), g.dw2.back().data()};
    }
    const auto io = p.io();
    l.forward(io, nullptr, /*keep_for_backward=*/true);
    l.backward(io, grads, WeightGradOutput::kF32, nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    l.check_device_errors();
    EXPECT_FALSE(l.last_backward_replayed());
    return g;
  };
  const Grads fp8 = train(layer), want = train(bf16_layer);
  const auto floats = [](const DeviceBuffer<uint16_t>& b) {
    std::vector<float> out;
    for (uint16_t v : b.download()) out.push_back(formats::bf16_to_float(v));
    return out;
  };
  for (int r = 0; r < P; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    if (p.tokens[r] == 0) continue;
    EXPECT_LT(testing::relative_l2_error(floats(fp8.dx[r]), floats(want.dx[r])), 0.1) << "dx";
    EXPECT_LT(testing::relative_l2_error(fp8.d_weights[r].download(), want.d_weights[r].download()), 0.1)
        << "d_topk_weights";
    EXPECT_LT(testing::relative_l2_error(fp8.dw13[r].download(), want.dw13[r].download()), 0.1) << "dw13";
    EXPECT_LT(testing::relative_l2_error(fp8.dw2[r].download(), want.dw2[r].download()), 0.1) << "dw2";
  }
}

TEST(FusedMoe, Fp8ForwardRefusesWhatItCannotRun) {
  POUNCE_REQUIRE_HOPPER();
  const auto fails_with = [](const std::function<void()>& f, const std::string& what) {
    try {
      f();
      ADD_FAILURE() << "no error; expected one naming " << what;
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), HasSubstr(what));
    }
  };
  const EpConfig off_blocks{
      .ranks = 1, .experts = 4, .topk = 2, .hidden = 192, .intermediate = 128, .max_tokens_per_rank = 16};
  FusedMoeOptions options;
  options.fp8_forward = true;
  fails_with([&] { FusedMoe layer(off_blocks, options); }, "fp8_forward needs H and I multiples of 128");
  EpConfig config = off_blocks;
  config.hidden = 256;
  options.minibatch_rows = 128;
  options.ring_blocks = 2;
  fails_with([&] { FusedMoe layer(config, options); }, "below the minimum 3 (3 minibatches");
  options = {};
  options.fp8_forward = true;
  options.fused_backward = true;
  fails_with([&] { FusedMoe layer(config, options); }, "fused_backward");

  auto rng = testing::fresh_rng();
  Problem p = make_problem(rng, {1, 16, 256, 128, 4, 2, RoutingPattern::kUniform});
  FusedMoe layer(p.config, fp8_options({1, 16, 256, 128, 4, 2, RoutingPattern::kUniform}));
  p.load_weights(layer);
  fails_with([&] { layer.forward(p.io(), nullptr); }, "refresh_fp8_weights");
  layer.refresh_fp8_weights(nullptr);
  run_and_check(layer, p);
  p.load_weights(layer);  // new weights: the copies are stale until refreshed
  fails_with([&] { layer.forward(p.io(), nullptr); }, "refresh_fp8_weights");
}

// Across ranks the default ring holds at least six minibatches (smaller rings cost time: the ring sweep of
// the benchmark): within the default 1 GiB on model shapes, beyond it when six minibatches need more. A
// ring_bytes budget is respected down to the two-minibatch minimum.
TEST(FusedMoe, DefaultRingHoldsSixMinibatches) {
  POUNCE_REQUIRE_HOPPER();
  struct Shape {
    int64_t hidden, intermediate;
    int experts, topk;
    int64_t tokens;
  };
  const auto blocks = [](const FusedMoe& layer) { return (layer.minibatch_rows() + kBlockM - 1) / kBlockM; };
  for (const Shape& m :
       {Shape{7168, 2048, 256, 8, 8192}, Shape{2048, 768, 128, 8, 16384}, Shape{4096, 14336, 8, 2, 8192}})
    for (int P : {2, 4, 8}) {
      SCOPED_TRACE("H " + std::to_string(m.hidden) + ", P " + std::to_string(P));
      const EpConfig config{.ranks = P,
                            .experts = m.experts,
                            .topk = m.topk,
                            .hidden = m.hidden,
                            .intermediate = m.intermediate,
                            .max_tokens_per_rank = m.tokens};
      FusedMoe layer(config);
      EXPECT_GE(layer.ring_blocks(), std::min(6 * blocks(layer), layer.max_m_blocks()));
      // The fused backward's minibatch: the forward's, at least 16 m-blocks, at most all of them.
      EXPECT_EQ(layer.backward_minibatch_rows(),
                std::min(std::max<int64_t>(blocks(layer), 16), layer.max_m_blocks()) * kBlockM);
      EXPECT_LE(layer.ring_blocks() * kBlockM * (2 * m.hidden + m.intermediate) * 2, int64_t(1) << 30);
    }
  // Minibatches so large that six of them exceed 1 GiB: the default grows to six.
  const EpConfig big{
      .ranks = 2, .experts = 16, .topk = 8, .hidden = 4096, .intermediate = 1024, .max_tokens_per_rank = 65536};
  FusedMoeOptions options;
  options.minibatch_rows = 256 * kBlockM;
  FusedMoe grown(big, options);
  EXPECT_EQ(grown.ring_blocks(), 6 * 256);
  options.ring_bytes = int64_t(2) << 30;  // a budget set on purpose is kept (910 m-blocks, above the 512 minimum)
  FusedMoe budgeted(big, options);
  EXPECT_EQ(budgeted.ring_blocks(), (int64_t(2) << 30) / (kBlockM * (2 * 4096 + 1024) * 2));
}

// One rank, default ring: every m-block fits, nothing is combined and the sums read GEMM2's rows in the
// ring while the communication CTAs, done dispatching, run GEMM tiles. The same forward through a ring
// too small for that (rows combined into slots first) must give the same bits, whether the ring is
// bounded by ring_blocks or by a ring_bytes budget (which one rank respects too).
TEST(FusedMoe, OneRankInPlaceMatchesCombinedBitwise) {
  POUNCE_REQUIRE_HOPPER();
  auto rng = testing::fresh_rng();
  Problem p = make_problem(rng, Case{1, 1500, 512, 256, 16, 6, RoutingPattern::kZipf});
  FusedMoe in_place(p.config);
  ASSERT_TRUE(in_place.in_place());
  p.load_weights(in_place);
  run_and_expect_reference(in_place, p);
  const auto want = p.outputs();

  const int64_t block_bytes = 128 * (2 * p.config.hidden + p.config.intermediate) * 2;  // x, h and out rows
  FusedMoeOptions by_blocks, by_bytes;
  by_blocks.minibatch_rows = by_bytes.minibatch_rows = 4 * 128;
  by_blocks.ring_blocks = 8;  // two minibatches: slots reused many times over
  by_bytes.ring_bytes = 10 * block_bytes;
  for (const auto& [options, blocks] : {std::pair{by_blocks, 8}, std::pair{by_bytes, 10}}) {
    FusedMoe combined(p.config, options);
    ASSERT_FALSE(combined.in_place());
    ASSERT_EQ(combined.ring_blocks(), blocks);
    p.load_weights(combined);
    run_and_check(combined, p);
    EXPECT_EQ(p.outputs(), want) << "ring of " << blocks << " m-blocks";
  }

  by_bytes.ring_bytes = in_place.max_m_blocks() * block_bytes;  // just enough: in place again
  EXPECT_TRUE(FusedMoe(p.config, by_bytes).in_place());
}

// Forwards on one layer with token counts and routings that change every time (up, down, zero, up):
// counters carry over from forward to forward, and a forward that uses more m-blocks or tokens than an
// earlier one must still find every counter where it expects it.
// `comm`: run them on this one-rank NCCL communicator's layer (window buffers, forward parity) instead
// of virtual ranks. `in_place`: one rank with the default ring (nothing combined) instead of a two-block
// ring whose slots are reused many times over.
void run_changing_forwards(int ranks, ncclComm_t comm = nullptr, bool in_place = false) {
  auto rng = testing::fresh_rng();
  const Case shape{ranks, 303, 256, 128, 8, 2, RoutingPattern::kUniform};
  Problem p = make_problem(rng, shape);  // up to 306 tokens per rank; buffers hold at least 303
  FusedMoeOptions options;
  options.minibatch_rows = 128;
  options.ring_blocks = in_place ? 0 : 2;
  options.wait_timeout_ns = 2'000'000'000;
  FusedMoe layer = comm ? FusedMoe(p.config, comm, options) : FusedMoe(p.config, options);
  ASSERT_EQ(layer.in_place(), in_place);
  p.load_weights(layer);
  const RoutingPattern patterns[] = {RoutingPattern::kUniform, RoutingPattern::kZipf, RoutingPattern::kOneExpert};
  const int64_t counts[][2] = {{20, 7}, {303, 250}, {0, 1}, {150, 303}, {303, 303}, {5, 0}, {280, 299}};
  int forward = 0;
  for (const auto& count : counts) {
    SCOPED_TRACE("forward " + std::to_string(forward));
    for (int r = 0; r < ranks; ++r) {
      const int64_t t = count[r];
      p.tokens[r] = t;
      p.x[r] = testing::random_bf16_values(rng, t * shape.hidden);
      p.ids[r] = reference::synthetic_topk_ids(patterns[forward % 3], t, shape.experts, shape.topk, rng);
      p.weights[r] = reference::synthetic_topk_weights(t, shape.topk, rng);
      p.d_x[r].upload(testing::to_bf16_bits(p.x[r]));
      p.d_ids[r].upload(p.ids[r]);
      p.d_weights[r].upload(p.weights[r]);
    }
    run_and_check(layer, p);
    auto outputs = p.outputs();
    for (int r = 0; r < ranks; ++r) outputs[r].resize(p.tokens[r] * shape.hidden);  // rows past the count: unused
    expect_matches(outputs, reference_forward(p), shape.hidden);
    ++forward;
  }
}

TEST(FusedMoe, ForwardsWithChangingTokenCountsAndRoutingsOnOneLayer) {
  POUNCE_REQUIRE_HOPPER();
  run_changing_forwards(2);
}

TEST(FusedMoe, ForwardsWithChangingTokenCountsAndRoutingsOnOneRank) {
  POUNCE_REQUIRE_HOPPER();
  run_changing_forwards(1);
}

// In place the sums wait for GEMM2's m-blocks instead of arrivals: counters of m-blocks a forward leaves
// unused must still be topped up for the next, larger forward.
TEST(FusedMoe, ForwardsWithChangingTokenCountsAndRoutingsInPlace) {
  POUNCE_REQUIRE_HOPPER();
  run_changing_forwards(1, nullptr, /*in_place=*/true);
}

TEST(FusedMoe, ForwardsWithChangingTokenCountsAndRoutingsOnOneNcclRank) {
  POUNCE_REQUIRE_HOPPER();
  std::vector<ncclComm_t> comms = comm::init_single_process_comms({0});
  run_changing_forwards(1, comms[0]);
  comm::destroy_single_process_comms(comms);
}

// One rank never moves data (no opening, no comm items): its GEMMs and the other ranks' sums wait for it. The
// forward must end with an error naming the wait, not hang, and the layer must work again afterwards.
TEST(FusedMoe, StalledRankEndsInATimeoutErrorAndTheLayerRecovers) {
  POUNCE_REQUIRE_HOPPER();
  auto rng = testing::fresh_rng();
  Problem p = make_problem(rng, Case{2, 200, 256, 128, 8, 2, RoutingPattern::kUniform});
  FusedMoeOptions options;
  options.wait_timeout_ns = 100'000'000;
  FusedMoe layer(p.config, options);
  p.load_weights(layer);
  LayerTesting::stall_rank(layer, 1);
  const std::string message = testing::error_message([&] { run_and_check(layer, p); });
  EXPECT_THAT(message, HasSubstr("gave up after"));
  // The likely cause first, in a user's words: rows or outputs that never came from the stalled rank.
  EXPECT_THAT(message, AnyOf(HasSubstr("never arrived"), HasSubstr("never all came back")));
  EXPECT_THAT(message, AnyOf(HasSubstr("rank 1, gemm producer"), HasSubstr("arrivals counter"),
                             HasSubstr("rank 1, weighted sum")));

  FusedMoe healthy(p.config);
  p.load_weights(healthy);
  run_and_expect_reference(healthy, p);
}

// Bad routing is found on the device by every rank's planner, before any data moves: a clear error,
// y untouched, and the next good forward is correct.
TEST(FusedMoe, BadRoutingIsReportedAndCorruptsNothing) {
  POUNCE_REQUIRE_HOPPER();
  auto rng = testing::fresh_rng();
  Problem p = make_problem(rng, Case{2, 100, 128, 64, 8, 3, RoutingPattern::kUniform});
  FusedMoe layer(p.config);
  p.load_weights(layer);

  auto forward_with_ids = [&](std::vector<int32_t> bad_ids) {
    p.d_ids[1].upload(bad_ids);
    run_and_check(layer, p);
  };
  auto out_of_range = p.ids[1];
  out_of_range[7 * 3 + 2] = 8;
  testing::expect_error([&] { forward_with_ids(out_of_range); }, "topk_ids[token 7][k 2] = 8 is out of range [0, 8)");
  for (const auto& y : p.outputs()) {
    for (uint16_t b : y) ASSERT_EQ(b, 0xFFFF) << "y was written by a forward that reported bad routing";
  }

  auto repeated = p.ids[1];
  repeated[5 * 3 + 1] = repeated[5 * 3];
  testing::expect_error([&] { forward_with_ids(repeated); }, "twice");

  p.d_ids[1].upload(p.ids[1]);
  run_and_expect_reference(layer, p);
}

// The NCCL transport at one rank (NCCL allows one rank per GPU, and this machine has one): the same
// kernel reading and writing through the symmetric window's LSA pointers must give the virtual-rank
// layer's output bit for bit, forward after forward.
TEST(FusedMoe, NcclOneRankMatchesVirtualRanksBitwise) {
  POUNCE_REQUIRE_HOPPER();
  auto rng = testing::fresh_rng();
  Problem p = make_problem(rng, Case{1, 333, 256, 128, 8, 3, RoutingPattern::kZipf});
  FusedMoe virtual_layer(p.config);
  p.load_weights(virtual_layer);
  run_and_expect_reference(virtual_layer, p);
  const auto want = p.outputs();

  std::vector<ncclComm_t> comms = comm::init_single_process_comms({0});
  {
    FusedMoe nccl_layer(p.config, comms[0]);
    p.load_weights(nccl_layer);
    for (int repeat = 0; repeat < 3; ++repeat) {
      run_and_check(nccl_layer, p);
      EXPECT_EQ(p.outputs(), want) << "forward " << repeat;
    }
    auto io = p.io();
    testing::expect_error([&] { nccl_layer.forward(std::vector<RankIO>(2, io[0]), nullptr); },
                          "got 2 ranks' tensors, the layer has 1 ranks");
  }
  comm::destroy_single_process_comms(comms);
}

// The E4M3 forward over NCCL at one rank: the quantized tokens, their scales and the count of CTAs that
// wrote them live in the symmetric window. Its outputs are the virtual-rank layer's bits forward after
// forward, and so are the gradients of a training step (the backward chain's, from the kept rows).
TEST(FusedMoe, NcclOneRankFp8ForwardMatchesVirtualRanksBitwise) {
  POUNCE_REQUIRE_HOPPER();
  auto rng = testing::fresh_rng();
  const Case c{1, 333, 256, 256, 8, 3, RoutingPattern::kZipf};
  Problem p = make_problem(rng, c);
  spread_fp8_inputs(rng, p);
  const int64_t H = p.config.hidden, I = p.config.intermediate, E = p.config.local_experts();
  const DeviceBuffer<uint16_t> dy(testing::to_bf16_bits(testing::random_bf16_values(rng, p.tokens[0] * H)));
  // A training step's gradients, downloaded: dx, d_topk_weights, dw13, dw2 (fp32, as bits).
  const auto train = [&](FusedMoe& layer) {
    DeviceBuffer<uint16_t> dx(p.tokens[0] * H);
    DeviceBuffer<float> d_weights(p.tokens[0] * p.config.topk), dw13(E * 2 * I * H), dw2(E * H * I);
    dx.fill_bytes(0xFF);
    const auto io = p.io();
    const RankGrads grads{bf16(dy), bf16(dx), d_weights.data(), dw13.data(), dw2.data()};
    layer.forward(io, nullptr, /*keep_for_backward=*/true);
    layer.backward(io, std::span(&grads, 1), WeightGradOutput::kF32, nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    layer.check_device_errors();
    EXPECT_FALSE(layer.last_backward_replayed());
    return std::tuple{dx.download(), d_weights.download(), dw13.download(), dw2.download()};
  };
  FusedMoe virtual_layer(p.config, fp8_options(c));
  const auto want = first_fp8_forward(virtual_layer, p);
  const auto want_grads = train(virtual_layer);

  std::vector<ncclComm_t> comms = comm::init_single_process_comms({0});
  {
    FusedMoe nccl_layer(p.config, comms[0], fp8_options(c));
    p.load_weights(nccl_layer);
    nccl_layer.refresh_fp8_weights(nullptr);
    // Between the forwards checked, one on other tokens: rows quantized by an earlier forward would show.
    const DeviceBuffer<uint16_t> other_x(testing::to_bf16_bits(testing::random_bf16_values(rng, p.tokens[0] * H)));
    DeviceBuffer<uint16_t> other_y(std::max<int64_t>(1, p.tokens[0] * H));
    auto other = p.io();
    other[0].x = bf16(other_x), other[0].y = bf16(other_y);
    for (int repeat = 0; repeat < 3; ++repeat) {
      nccl_layer.forward(other, nullptr);
      run_and_check(nccl_layer, p);
      EXPECT_EQ(p.outputs(), want) << "forward " << repeat;
    }
    EXPECT_TRUE(train(nccl_layer) == want_grads) << "a training step's gradients differ from the virtual rank's";
  }
  comm::destroy_single_process_comms(comms);
}

TEST(FusedMoe, RejectsBadHostInputWithClearErrors) {
  POUNCE_REQUIRE_HOPPER();
  auto rng = testing::fresh_rng();
  Problem p = make_problem(rng, Case{2, 10, 128, 64, 8, 2, RoutingPattern::kUniform});
  FusedMoe layer(p.config);
  p.load_weights(layer);
  auto io = p.io();
  testing::expect_error([&] { layer.forward(std::span(io).first(1), nullptr); },
                        "got 1 ranks' tensors, the layer has 2");
  io[1].tokens = p.config.max_tokens_per_rank + 1;
  testing::expect_error([&] { layer.forward(io, nullptr); },
                        "rank 1 has 14 tokens, outside [0, max_tokens_per_rank = 13]");
  io = p.io();
  io[0].y = nullptr;
  testing::expect_error([&] { layer.forward(io, nullptr); }, "rank 0's y is a null pointer");

  FusedMoeOptions options;
  options.comm_ctas = 20;
  options.ctas_per_rank = 20;
  testing::expect_error([&] { FusedMoe bad(p.config, options); }, "comm_ctas = 20 must be in [1, ctas_per_rank = 20)");
  options = {};
  options.ctas_per_rank = 100;
  testing::expect_error([&] { FusedMoe bad(p.config, options); }, "exceeds the GPU's");
  options = {};
  options.minibatch_rows = 256;
  options.ring_blocks = 3;
  EpConfig big = p.config;
  big.max_tokens_per_rank = 1000;
  testing::expect_error([&] { FusedMoe bad(big, options); }, "is below the minimum 4");
  options = {};
  options.ring_blocks = -1;
  testing::expect_error([&] { FusedMoe bad(p.config, options); }, "must not be negative");
  big.experts = 7;
  testing::expect_error([&] { FusedMoe bad(big); }, "divisible");
}

// Each rank is given its own experts only, each in an allocation of exactly its share (made in
// make_problem): the layer reads no weight outside them (a global expert index would read past the
// allocation, where TMA returns zeros, and fail the comparison), copies none (set_weights allocates no
// device memory), and refuses an allocation too small for a rank's share, naming it.
TEST(FusedMoe, EachRankIsGivenOnlyItsOwnExperts) {
  POUNCE_REQUIRE_HOPPER();
  auto rng = testing::fresh_rng();
  Problem p = make_problem(rng, Case{4, 150, 256, 128, 16, 4, RoutingPattern::kUniform});
  const int64_t E = p.config.experts, P = p.config.ranks, H = p.config.hidden, I = p.config.intermediate;
  for (int r = 0; r < P; ++r) {
    ASSERT_EQ(p.d_w13[r].bytes(), size_t(E / P * 2 * I * H * 2));
    ASSERT_EQ(p.d_w2[r].bytes(), size_t(E / P * H * I * 2));
  }
  FusedMoe layer(p.config);
  size_t free_before = 0, free_after = 0, total = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_before, &total));
  p.load_weights(layer);
  CUDA_CHECK(cudaMemGetInfo(&free_after, &total));
  EXPECT_EQ(free_after, free_before) << "set_weights allocated device memory";
  run_and_expect_reference(layer, p);

  // One expert short for rank 2: a named error, and the weights set before stay in use.
  DeviceBuffer<uint16_t> short_w13((E / P - 1) * 2 * I * H);
  auto weights = p.local_weights();
  weights[2].w13 = bf16(short_w13);
  testing::expect_error([&] { layer.set_weights(weights); },
                        "rank 2's w13 needs " + std::to_string(E / P * 2 * I * H * 2) +
                            " bytes, but its allocation ends " + std::to_string(short_w13.bytes()) + " bytes after");
  run_and_expect_reference(layer, p);
}

// A wrong pointer is named before anything is enqueued, and the layer runs correctly afterwards.
TEST(FusedMoe, BadPointersAreNamedAndTheLayerStillRuns) {
  POUNCE_REQUIRE_HOPPER();
  auto rng = testing::fresh_rng();
  Problem p = make_problem(rng, Case{2, 40, 128, 64, 8, 2, RoutingPattern::kUniform});
  FusedMoe layer(p.config);
  testing::expect_error([&] { layer.forward(p.io(), nullptr); }, "call set_weights first");
  layer.check_device_errors();  // nothing ran: nothing to report
  const auto both = p.local_weights();
  testing::expect_error([&] { layer.set_weights(std::span(both).first(1)); },
                        "got 1 ranks' weights, the layer has 2 ranks");

  auto weights = p.local_weights();
  weights[1].w2 = reinterpret_cast<const __nv_bfloat16*>(reinterpret_cast<const char*>(weights[1].w2) + 2);
  testing::expect_error([&] { layer.set_weights(weights); }, "rank 1's w2 at ");
  testing::expect_error([&] { layer.set_weights(weights); }, "is not 16-byte aligned");
  std::vector<uint16_t> host_weights(p.d_w13[0].size());
  weights = p.local_weights();
  weights[0].w13 = reinterpret_cast<const __nv_bfloat16*>(host_weights.data());
  testing::expect_error([&] { layer.set_weights(weights); }, "rank 0's w13 at ");
  testing::expect_error([&] { layer.set_weights(weights); }, "is not CUDA memory: it must be device memory of GPU");
  weights = p.local_weights();
  weights[1].w13 = nullptr;
  testing::expect_error([&] { layer.set_weights(weights); }, "rank 1's w13 is a null pointer");
  p.load_weights(layer);

  std::vector<float> host_floats(64);
  auto io = p.io();
  io[0].x = reinterpret_cast<const __nv_bfloat16*>(reinterpret_cast<const char*>(io[0].x) + 2);
  testing::expect_error([&] { layer.forward(io, nullptr); }, "rank 0's x at ");
  io = p.io();
  io[1].topk_ids = nullptr;
  testing::expect_error([&] { layer.forward(io, nullptr); }, "rank 1's topk_ids is a null pointer");
  io = p.io();
  io[1].topk_weights = host_floats.data();
  testing::expect_error([&] { layer.forward(io, nullptr); }, "rank 1's topk_weights at ");
  io = p.io();
  io[0].y = reinterpret_cast<__nv_bfloat16*>(reinterpret_cast<char*>(io[0].y) + 8);
  testing::expect_error([&] { layer.forward(io, nullptr); }, "rank 0's y at ");
  // y one token too short for rank 1's tokens.
  DeviceBuffer<uint16_t> short_y((p.tokens[1] - 1) * p.config.hidden);
  io = p.io();
  io[1].y = bf16(short_y);
  testing::expect_error([&] { layer.forward(io, nullptr); }, "rank 1's y needs ");
  run_and_expect_reference(layer, p);
}

// A NaN in one token's x, or in one token's router weight, stays in that token's y; every other token
// is right, and the next clean forward is right everywhere (no NaN left in the ring or the slots).
TEST(FusedMoe, NanStaysInItsToken) {
  POUNCE_REQUIRE_HOPPER();
  for (const int ranks : {1, 2}) {
    SCOPED_TRACE("ranks " + std::to_string(ranks));
    auto rng = testing::fresh_rng();
    Problem p = make_problem(rng, Case{ranks, 300, 256, 128, 8, 4, RoutingPattern::kZipf});
    FusedMoe layer(p.config);
    p.load_weights(layer);
    const auto want = reference_forward(p);
    const int64_t H = p.config.hidden, k = p.config.topk;
    const int64_t bad_x = 5, bad_w = 9;  // tokens of the last rank
    const int last = ranks - 1;
    auto x = testing::to_bf16_bits(p.x[last]);
    x[bad_x * H + 17] = 0x7FC0;  // NaN
    p.d_x[last].upload(x);
    auto w = p.weights[last];
    w[bad_w * k + 1] = std::nanf("");
    p.d_weights[last].upload(w);
    run_and_check(layer, p);

    const auto outputs = p.outputs();
    for (int r = 0; r < ranks; ++r) {
      for (int64_t t = 0; t < p.tokens[r]; ++t) {
        std::vector<float> got(H);
        for (int64_t i = 0; i < H; ++i) got[i] = formats::bf16_to_float(outputs[r][t * H + i]);
        const std::vector<double> ref(want[r].y.begin() + t * H, want[r].y.begin() + (t + 1) * H);
        const double e = testing::relative_l2_error(got, ref);
        if (r == last && (t == bad_x || t == bad_w)) {
          EXPECT_TRUE(std::isnan(e)) << "token " << t << " of rank " << r << " should carry the NaN";
        } else {
          EXPECT_LT(e, testing::kBf16LayerWorstToken) << "token " << t << " of rank " << r;
        }
      }
    }
    p.d_x[last].upload(testing::to_bf16_bits(p.x[last]));
    p.d_weights[last].upload(p.weights[last]);
    run_and_expect_reference(layer, p);
  }
}

// At a real model's size (DeepSeek-V3's expert shape, 32 experts, top-8, thousands of tokens) the
// layer against the unfused cuBLAS chain (bf16 GEMMs with fp32 accumulation) on the same inputs, whole
// tensor and token by token: one rank in place, and four virtual ranks of 8 experts each splitting the
// same tokens.
TEST(FusedMoe, RealModelSizeMatchesTheCublasChainTokenByToken) {
  POUNCE_REQUIRE_HOPPER();
  auto rng = testing::fresh_rng();
  const int64_t T = 4096, H = 7168, I = 2048, E = 32, k = 8;
  DeviceBuffer<__nv_bfloat16> w13(E * 2 * I * H), w2(E * H * I), x(T * H), y_ref(T * H), y(T * H);
  const float w_scale = 1.0f / std::sqrt(float(H));
  bench::fill_random_bf16(w13.data(), w13.size(), rng(), w_scale, nullptr);
  bench::fill_random_bf16(w2.data(), w2.size(), rng(), w_scale, nullptr);
  bench::fill_random_bf16(x.data(), x.size(), rng(), 1.0f, nullptr);
  const auto ids = reference::synthetic_topk_ids(RoutingPattern::kZipf, T, int(E), int(k), rng);
  const auto weights = reference::synthetic_topk_weights(T, int(k), rng);
  DeviceBuffer<int32_t> d_ids(ids);
  DeviceBuffer<float> d_weights(weights);

  baseline::CublasMoe cublas({.max_tokens = T, .hidden = H, .intermediate = I, .experts = E, .topk = k});
  cublas.set_weights(w13.data(), w2.data());
  cublas.set_routing(ids, T);
  cublas.forward(x.data(), d_weights.data(), y_ref.data(), baseline::GemmCalls::kGroupedBatched, nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  const auto floats = [](const DeviceBuffer<__nv_bfloat16>& b) {
    std::vector<uint16_t> bits(b.size());
    CUDA_CHECK(cudaMemcpy(bits.data(), b.data(), b.bytes(), cudaMemcpyDeviceToHost));
    std::vector<float> out;
    for (uint16_t v : bits) out.push_back(formats::bf16_to_float(v));
    return out;
  };
  const std::vector<float> want = floats(y_ref);

  for (const int P : {1, 4}) {
    SCOPED_TRACE("ranks " + std::to_string(P));
    const EpConfig config{
        .ranks = P, .experts = int(E), .topk = int(k), .hidden = H, .intermediate = I, .max_tokens_per_rank = T / P};
    FusedMoe layer(config);
    std::vector<ExpertWeights> local(P);
    std::vector<RankIO> io(P);
    for (int r = 0; r < P; ++r) {
      local[r] = {w13.data() + r * (E / P) * 2 * I * H, w2.data() + r * (E / P) * H * I};
      const int64_t first = r * (T / P);
      io[r] = {x.data() + first * H, d_ids.data() + first * k, d_weights.data() + first * k, T / P,
               y.data() + first * H};
    }
    layer.set_weights(local);
    CUDA_CHECK(cudaMemset(y.data(), 0xFF, y.bytes()));
    layer.forward(io, nullptr);
    const cudaError_t synced = cudaDeviceSynchronize();
    layer.check_device_errors();
    CUDA_CHECK(synced);
    const std::vector<float> got = floats(y);
    const double l2 = testing::relative_l2_error(got, want), worst = testing::worst_token_error(got, want, H);
    std::printf("[ measured ] %d rank(s): relative L2 %.3g, worst token %.3g against the cuBLAS chain\n", P, l2, worst);
    EXPECT_LT(l2, testing::kBf16LayerL2);
    EXPECT_LT(worst, testing::kBf16LayerWorstToken);
  }
}

// The memory formula of the README: ring, combine slots and schedule per rank, against what the layer
// reports it allocated (to within a quarter of a byte per routed row of capacity, plus a few KiB).
TEST(FusedMoe, DeviceBytesFollowTheDocumentedFormula) {
  POUNCE_REQUIRE_HOPPER();
  struct Setup {
    EpConfig config;
    int64_t ring_blocks;  // 0: default
  };
  // The last: routes per rank bounded to twice the balanced load.
  for (const Setup& setup : {Setup{{1, 32, 8, 7168, 2048, 8192}, 0}, Setup{{2, 16, 6, 1024, 512, 3000}, 40},
                             Setup{{4, 256, 8, 2048, 768, 2048}, 0}, Setup{{4, 256, 8, 2048, 768, 2048, 32768}, 0}}) {
    const EpConfig& c = setup.config;
    FusedMoeOptions options;
    options.ring_blocks = setup.ring_blocks;
    if (setup.ring_blocks > 0) options.minibatch_rows = 4 * 128;  // the ring must hold two minibatches
    FusedMoe layer(c, options);
    const int64_t P = c.ranks, T = c.max_tokens_per_rank, k = c.topk, H = c.hidden, I = c.intermediate;
    const int64_t E = c.local_experts(), worst = P * T * std::min(k, E);
    const int64_t R = (c.max_routes_per_rank > 0 ? std::min(worst, c.max_routes_per_rank) : worst) + 127 * E;
    const int64_t ring = layer.ring_blocks() * 128 * (2 * H + I) * 2;
    const int64_t slots = layer.in_place() ? 0 : T * k * H * 2;
    const int64_t schedule = 12 * R + 4 * P * ((T + 63) / 64) * E + 4 * T + (layer.in_place() ? 4 * T * k : 0);
    const int64_t documented = P * (ring + slots + schedule);  // virtual ranks: every rank on this GPU
    EXPECT_NEAR(double(layer.device_bytes()), double(documented), double(P * (R / 4 + 4096)))
        << "P " << P << ", ring " << layer.ring_blocks() << " m-blocks, in place " << layer.in_place();
  }
}

// Router weights that are exactly zero (a route kept with no weight, a token whose weights are all zero)
// contribute exactly nothing: y matches the reference, and a token with only zero weights is exactly 0.
TEST(FusedMoe, ExactZeroRouterWeights) {
  POUNCE_REQUIRE_HOPPER();
  auto rng = testing::fresh_rng();
  Problem p = make_problem(rng, Case{2, 200, 256, 128, 8, 4, RoutingPattern::kZipf});
  const int64_t k = p.config.topk, H = p.config.hidden;
  for (int r = 0; r < 2; ++r) {
    for (int64_t t = 0; t < p.tokens[r]; t += 3) p.weights[r][t * k + t % k] = 0.0f;
    for (int64_t j = 0; j < k; ++j) p.weights[r][7 * k + j] = 0.0f;  // token 7: nothing at all
    p.d_weights[r].upload(p.weights[r]);
  }
  FusedMoe layer(p.config);
  p.load_weights(layer);
  run_and_expect_reference(layer, p);
  for (const auto& y : p.outputs())
    for (int64_t i = 0; i < H; ++i) ASSERT_EQ(y[7 * H + i] & 0x7FFF, 0) << "token 7 has only zero weights";
}

// The gradients of one backward of every rank, in host memory, concatenated in rank order (tokens, and
// experts: the whole layer's weight gradients).
struct Gradients {
  std::vector<uint16_t> dx;
  std::vector<float> d_topk, dw13, dw2;
  bool operator==(const Gradients&) const = default;
};

template <typename T>
void append(std::vector<T>& to, const std::vector<T>& from) {
  to.insert(to.end(), from.begin(), from.end());
}

// Where a backward of every rank of p writes, poisoned first.
struct GradientBuffers {
  std::vector<DeviceBuffer<uint16_t>> dx;
  std::vector<DeviceBuffer<float>> d_topk, dw13, dw2;

  Gradients download() const {
    Gradients got;
    for (size_t r = 0; r < dx.size(); ++r) {
      append(got.dx, dx[r].download());
      append(got.d_topk, d_topk[r].download());
      append(got.dw13, dw13[r].download());
      append(got.dw2, dw2[r].download());
    }
    return got;
  }
};

// Fresh buffers for a backward of every rank of p, poisoned (synchronously: done before any later launch).
GradientBuffers poisoned_gradients(const Problem& p) {
  const EpConfig& c = p.config;
  const int64_t H = c.hidden, I = c.intermediate, E = c.local_experts(), k = c.topk;
  GradientBuffers out;
  for (int r = 0; r < c.ranks; ++r) {
    const int64_t T = p.tokens[r];
    out.dx.emplace_back(T * H);
    out.d_topk.emplace_back(T * k);
    out.dw13.emplace_back(E * 2 * I * H);
    out.dw2.emplace_back(E * H * I);
    for (auto* b : {&out.d_topk[r], &out.dw13[r], &out.dw2[r]}) b->fill_bytes(0xFF);
    out.dx[r].fill_bytes(0xFF);
  }
  CUDA_CHECK(cudaDeviceSynchronize());
  return out;
}

// Enqueues the public backward of every rank of p on `stream`, into `out`.
void enqueue_backward(FusedMoe& layer, const Problem& p, const std::vector<DeviceBuffer<uint16_t>>& d_dy,
                      const GradientBuffers& out, cudaStream_t stream) {
  std::vector<RankGrads> grads;
  for (int r = 0; r < p.config.ranks; ++r)
    grads.push_back({bf16(d_dy[r]), bf16(out.dx[r]), out.d_topk[r].data(), out.dw13[r].data(), out.dw2[r].data()});
  layer.backward(p.io(), grads, WeightGradOutput::kF32, stream);
}

// Runs the public backward of every rank of p on poisoned outputs and downloads what it wrote.
Gradients run_backward(FusedMoe& layer, const Problem& p, const std::vector<DeviceBuffer<uint16_t>>& d_dy) {
  const GradientBuffers out = poisoned_gradients(p);
  enqueue_backward(layer, p, d_dy, out, nullptr);
  const cudaError_t synced = cudaDeviceSynchronize();
  layer.check_device_errors();
  CUDA_CHECK(synced);
  return out.download();
}

// The host reference's gradients of every rank's tokens, concatenated in rank order.
reference::MoeGradients reference_backward(const Problem& p, const std::vector<std::vector<float>>& dy) {
  const EpConfig& c = p.config;
  std::vector<float> x, weights, all_dy;
  std::vector<int32_t> ids;
  int64_t T = 0;
  for (int r = 0; r < c.ranks; ++r) {
    append(x, p.x[r]);
    append(ids, p.ids[r]);
    append(weights, p.weights[r]);
    append(all_dy, dy[r]);
    T += p.tokens[r];
  }
  return reference::moe_backward({T, c.hidden, c.intermediate, c.experts, c.topk}, {x, ids, weights, p.w13, p.w2},
                                 all_dy);
}

// Every gradient against the host reference: dx over the tensor and token by token, the router-weight
// gradients, and each expert's weight gradients on their own (an expert nobody chose gets exact zeros).
void expect_gradients(const Gradients& got, const reference::MoeGradients& want, const EpConfig& c) {
  const int64_t H = c.hidden, I = c.intermediate;
  std::vector<float> dx;
  for (uint16_t b : got.dx) dx.push_back(formats::bf16_to_float(b));
  if (!dx.empty()) {
    EXPECT_LT(testing::relative_l2_error(dx, want.dx), 2e-2);
    EXPECT_LT(testing::worst_token_error(dx, want.dx, H), 5e-2);
    // Each route's dot against the magnitude of its terms (the dot itself may cancel to nearly zero).
    double worst_route = 0;
    for (size_t r = 0; r < got.d_topk.size(); ++r) {
      ASSERT_TRUE(std::isfinite(got.d_topk[r])) << "route " << r;
      const double error = std::abs(got.d_topk[r] - want.d_topk_weights[r]);
      worst_route = std::max(worst_route, want.d_topk_scale[r] > 0 ? error / want.d_topk_scale[r] : error);
    }
    EXPECT_LT(worst_route, 1e-2);
  }
  for (int64_t e = 0; e < c.experts; ++e) {
    const auto slice = [](const auto& v, int64_t at, int64_t n) {
      return std::vector(v.begin() + at, v.begin() + at + n);
    };
    const auto got13 = slice(got.dw13, e * 2 * I * H, 2 * I * H), got2 = slice(got.dw2, e * H * I, H * I);
    const auto want13 = slice(want.dw13, e * 2 * I * H, 2 * I * H), want2 = slice(want.dw2, e * H * I, H * I);
    if (std::all_of(want13.begin(), want13.end(), [](double v) { return v == 0; })) {
      // Nobody chose it, or only with zero weights: both gradients exactly zero.
      EXPECT_TRUE(std::all_of(got13.begin(), got13.end(), [](float v) { return v == 0; })) << "expert " << e;
      EXPECT_TRUE(std::all_of(got2.begin(), got2.end(), [](float v) { return v == 0; })) << "expert " << e;
      continue;
    }
    EXPECT_LT(testing::relative_l2_error(got13, want13), 2e-2) << "dW13 of expert " << e;
    EXPECT_LT(testing::relative_l2_error(got2, want2), 2e-2) << "dW2 of expert " << e;
  }
}

class FusedMoeBackwardTest : public ::testing::TestWithParam<Case> {};

// Training forwards and the backward from what they kept, against the host reference, on one layer
// whose routing, inputs and router weights (some exactly zero) change every round; then the same
// backward replayed (after a forward that kept nothing) must give the same bits, and so must a layer
// that runs the kept backward's data path as the chain of kernels instead of the fused kernel.
TEST_P(FusedMoeBackwardTest, FromKeptForwardMatchesReferenceAndReplay) {
  POUNCE_REQUIRE_HOPPER();
  auto rng = testing::fresh_rng();
  const Case c = GetParam();
  Problem p = make_problem(rng, c);
  FusedMoeOptions options{.fused_backward = true};
  if (c.ring_blocks == kMinRing) options.minibatch_rows = 128, options.ring_blocks = 2;
  FusedMoe layer(p.config, options);
  p.load_weights(layer);
  FusedMoeOptions chain_options = options;
  chain_options.fused_backward = false;  // the default
  FusedMoe chained(p.config, chain_options);
  p.load_weights(chained);
  const int64_t H = p.config.hidden;
  for (int round = 0; round < 3; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    std::vector<std::vector<float>> dy;
    std::vector<DeviceBuffer<uint16_t>> d_dy;
    for (int r = 0; r < c.ranks; ++r) {
      const int64_t T = p.tokens[r];
      if (round > 0) {
        p.x[r] = testing::random_bf16_values(rng, T * H);
        p.ids[r] = reference::synthetic_topk_ids(c.pattern, T, c.experts, c.topk, rng);
        p.weights[r] = reference::synthetic_topk_weights(T, c.topk, rng);
        for (int64_t route = round; route < T * c.topk; route += 3) p.weights[r][route] = 0.0f;
        p.d_x[r].upload(testing::to_bf16_bits(p.x[r]));
        p.d_ids[r].upload(p.ids[r]);
        p.d_weights[r].upload(p.weights[r]);
      }
      dy.push_back(testing::random_bf16_values(rng, T * H));
      d_dy.emplace_back(testing::to_bf16_bits(dy.back()));
    }
    const auto want = reference_backward(p, dy);

    p.poison_outputs();
    layer.forward(p.io(), nullptr, /*keep_for_backward=*/true);
    const cudaError_t synced = cudaDeviceSynchronize();
    layer.check_device_errors();
    CUDA_CHECK(synced);
    expect_matches(p.outputs(), reference_forward(p), H);
    const Gradients kept = run_backward(layer, p, d_dy);
    EXPECT_FALSE(layer.last_backward_replayed());
    expect_gradients(kept, want, p.config);
    // Again from the same kept rows: the backward does not consume them.
    EXPECT_TRUE(run_backward(layer, p, d_dy) == kept);
    chained.forward(p.io(), nullptr, /*keep_for_backward=*/true);
    EXPECT_TRUE(run_backward(chained, p, d_dy) == kept) << "the fused and the chained backward differ";
    EXPECT_FALSE(chained.last_backward_replayed());

    layer.forward(p.io(), nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    const Gradients replayed = run_backward(layer, p, d_dy);
    EXPECT_TRUE(layer.last_backward_replayed());
    EXPECT_TRUE(replayed == kept) << "the kept and the replayed backward differ";
  }
}

INSTANTIATE_TEST_SUITE_P(VirtualRanks, FusedMoeBackwardTest,
                         ::testing::Values(Case{1, 400, 256, 128, 8, 4, RoutingPattern::kZipf},
                                           Case{1, 333, 384, 192, 16, 6, RoutingPattern::kUniform, kMinRing},
                                           Case{1, 700, 256, 128, 8, 4, RoutingPattern::kOneExpert},
                                           Case{1, 257, 128, 64, 16, 3, RoutingPattern::kHalfEmpty},
                                           Case{1, 97, 128, 128, 16, 12, RoutingPattern::kUniform},  // k > 8
                                           Case{1, 1, 128, 64, 4, 1, RoutingPattern::kUniform},
                                           Case{1, 0, 128, 64, 4, 2, RoutingPattern::kUniform},
                                           Case{2, 129, 256, 192, 16, 4, RoutingPattern::kZipf, kMinRing},
                                           Case{2, 0, 128, 64, 8, 2, RoutingPattern::kUniform},
                                           Case{3, 211, 256, 128, 12, 3, RoutingPattern::kOneExpert},
                                           Case{5, 50, 192, 64, 10, 7, RoutingPattern::kUniform, kMinRing},
                                           Case{6, 101, 128, 128, 12, 4, RoutingPattern::kHalfEmpty},
                                           Case{7, 33, 256, 128, 14, 2, RoutingPattern::kOneExpert, kMinRing},
                                           Case{4, 64, 256, 64, 32, 9, RoutingPattern::kHalfEmpty},
                                           Case{8, 77, 192, 128, 32, 5, RoutingPattern::kZipf},
                                           Case{8, 1, 128, 64, 8, 1, RoutingPattern::kUniform},
                                           // rows of several router-weight segments, the last one short
                                           Case{1, 300, 128, 1536, 8, 4, RoutingPattern::kZipf},
                                           Case{2, 150, 256, 2176, 8, 2, RoutingPattern::kUniform}),
                         testing::NameFromPrintTo());

// The fused backward runs the weight gradients inside its kernel (one rank: from the x rows the forward
// kept; virtual ranks: from the x rows its X items pull): in each output a training step asks for (bf16,
// fp32, fp32 added into main gradients) they have the bits of the chain's k-grouped GEMMs, experts nobody
// chose included (zeros; added: the main gradients unchanged).
TEST(FusedMoe, FusedBackwardWeightGradientsInEveryOutputMatchTheChain) {
  POUNCE_REQUIRE_HOPPER();
  auto rng = testing::fresh_rng();
  for (const Case& c : {Case{1, 300, 256, 192, 16, 4, RoutingPattern::kHalfEmpty},
                        Case{3, 111, 128, 192, 12, 3, RoutingPattern::kZipf}}) {
    SCOPED_TRACE(::testing::PrintToString(c));
    Problem p = make_problem(rng, c);
    FusedMoe fused(p.config, {.fused_backward = true}), chained(p.config);
    p.load_weights(fused);
    p.load_weights(chained);
    const int64_t H = p.config.hidden, I = p.config.intermediate, E = p.config.local_experts();
    std::vector<DeviceBuffer<uint16_t>> dy;
    for (int r = 0; r < c.ranks; ++r)
      dy.emplace_back(testing::to_bf16_bits(testing::random_bf16_values(rng, p.tokens[r] * H)));
    const std::vector<float> main_dw13 = testing::random_bf16_values(rng, E * 2 * I * H),
                             main_dw2 = testing::random_bf16_values(rng, E * H * I);
    for (const WeightGradOutput mode :
         {WeightGradOutput::kBf16, WeightGradOutput::kF32, WeightGradOutput::kAccumulateF32}) {
      SCOPED_TRACE("mode " + std::to_string(int(mode)));
      const int64_t bytes = mode == WeightGradOutput::kBf16 ? 2 : 4;
      std::vector<std::vector<uint8_t>> got;
      for (FusedMoe* layer : {&fused, &chained}) {
        std::vector<DeviceBuffer<uint16_t>> dx;
        std::vector<DeviceBuffer<float>> d_topk;
        std::vector<DeviceBuffer<uint8_t>> dw13, dw2;
        std::vector<RankGrads> grads;
        for (int r = 0; r < c.ranks; ++r) {
          dx.emplace_back(p.tokens[r] * H);
          d_topk.emplace_back(p.tokens[r] * c.topk);
          dw13.emplace_back(E * 2 * I * H * bytes);
          dw2.emplace_back(E * H * I * bytes);
          if (mode == WeightGradOutput::kAccumulateF32) {
            CUDA_CHECK(cudaMemcpy(dw13[r].data(), main_dw13.data(), dw13[r].size(), cudaMemcpyHostToDevice));
            CUDA_CHECK(cudaMemcpy(dw2[r].data(), main_dw2.data(), dw2[r].size(), cudaMemcpyHostToDevice));
          } else {
            dw13[r].fill_bytes(0xFF);
            dw2[r].fill_bytes(0xFF);
          }
        }
        for (int r = 0; r < c.ranks; ++r)
          grads.push_back({bf16(dy[r]), bf16(dx[r]), d_topk[r].data(), dw13[r].data(), dw2[r].data()});
        layer->forward(p.io(), nullptr, /*keep_for_backward=*/true);
        layer->backward(p.io(), grads, mode, nullptr);
        const cudaError_t synced = cudaDeviceSynchronize();
        layer->check_device_errors();
        CUDA_CHECK(synced);
        EXPECT_FALSE(layer->last_backward_replayed());
        std::vector<uint8_t> all;
        for (int r = 0; r < c.ranks; ++r)
          for (const auto* b : {&dw13[r], &dw2[r]}) {
            const std::vector<uint8_t> bits = b->download();
            all.insert(all.end(), bits.begin(), bits.end());
          }
        got.push_back(std::move(all));
      }
      EXPECT_TRUE(got[0] == got[1]) << "the fused backward's weight gradients differ from the chain's";
    }
  }
}

// keep_x_rows = false at one rank: the forward's x ring is the shared one (R x H x 2 bytes less of the
// layer's own memory) and the backward copies the x rows again, fused (X items) or chained (a gather).
// Every gradient has the kept layer's bits over rounds of changing routing, inputs and zero router
// weights (rows not copied again would be the previous round's), with both forwards run before either
// backward.
TEST(FusedMoe, BackwardWithoutKeptXRowsHasTheBitsOfTheKeptOne) {
  POUNCE_REQUIRE_HOPPER();
  auto rng = testing::fresh_rng();
  const Case c{1, 333, 256, 192, 16, 6, RoutingPattern::kZipf};
  Problem p = make_problem(rng, c);
  FusedMoe kept(p.config, {.fused_backward = true});
  FusedMoe fused(p.config, {.fused_backward = true, .keep_x_rows = false});
  FusedMoe chained(p.config, {.keep_x_rows = false});
  for (FusedMoe* layer : {&kept, &fused, &chained}) {
    p.load_weights(*layer);
    ASSERT_TRUE(layer->in_place());
  }
  const int64_t H = p.config.hidden;
  const auto own_bytes = [](const FusedMoe& layer) { return layer.device_bytes() - layer.shared_device_bytes(); };
  EXPECT_EQ(own_bytes(kept) - own_bytes(fused), kept.max_m_blocks() * kBlockM * H * 2);
  EXPECT_EQ(own_bytes(fused), own_bytes(chained));
  for (int round = 0; round < 3; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    if (round > 0) {
      p.x[0] = testing::random_bf16_values(rng, p.tokens[0] * H);
      p.ids[0] = reference::synthetic_topk_ids(round == 1 ? RoutingPattern::kOneExpert : RoutingPattern::kUniform,
                                               p.tokens[0], c.experts, c.topk, rng);
      p.weights[0] = reference::synthetic_topk_weights(p.tokens[0], c.topk, rng);
      for (int64_t route = round; route < p.tokens[0] * c.topk; route += 4) p.weights[0][route] = 0.0f;
      p.d_x[0].upload(testing::to_bf16_bits(p.x[0]));
      p.d_ids[0].upload(p.ids[0]);
      p.d_weights[0].upload(p.weights[0]);
    }
    const std::vector<std::vector<float>> dy = {testing::random_bf16_values(rng, p.tokens[0] * H)};
    std::vector<DeviceBuffer<uint16_t>> d_dy;
    d_dy.emplace_back(testing::to_bf16_bits(dy[0]));
    kept.forward(p.io(), nullptr, /*keep_for_backward=*/true);
    const Gradients want = run_backward(kept, p, d_dy);
    expect_gradients(want, reference_backward(p, dy), p.config);
    // Both forwards first: the second one's x rows overwrite the first one's in the shared ring.
    fused.forward(p.io(), nullptr, /*keep_for_backward=*/true);
    chained.forward(p.io(), nullptr, /*keep_for_backward=*/true);
    const cudaError_t synced = cudaDeviceSynchronize();
    for (FusedMoe* layer : {&fused, &chained}) layer->check_device_errors();
    CUDA_CHECK(synced);
    EXPECT_TRUE(run_backward(fused, p, d_dy) == want) << "the fused backward without kept x rows differs";
    EXPECT_TRUE(run_backward(chained, p, d_dy) == want) << "the chained backward without kept x rows differs";
    EXPECT_FALSE(fused.last_backward_replayed());
    EXPECT_FALSE(chained.last_backward_replayed());
  }
}

// Virtual ranks give every gradient with the bits of one rank that holds all their tokens and experts:
// each route's work is the same, and an expert's rows come in the same order (source rank, token, k),
// so even the weight gradients sum them alike.
TEST(FusedMoe, BackwardOnVirtualRanksHasTheBitsOfOneRank) {
  POUNCE_REQUIRE_HOPPER();
  auto rng = testing::fresh_rng();
  Problem many = make_problem(rng, Case{4, 150, 256, 128, 16, 4, RoutingPattern::kZipf});
  const int64_t H = many.config.hidden;
  Problem one;
  one.config = many.config;
  one.config.ranks = 1;
  one.tokens = {0};
  one.x.resize(1), one.ids.resize(1), one.weights.resize(1);
  std::vector<std::vector<float>> dy_many, dy_one(1);
  std::vector<DeviceBuffer<uint16_t>> d_dy_many, d_dy_one;
  for (int r = 0; r < many.config.ranks; ++r) {
    one.tokens[0] += many.tokens[r];
    append(one.x[0], many.x[r]);
    append(one.ids[0], many.ids[r]);
    append(one.weights[0], many.weights[r]);
    dy_many.push_back(testing::random_bf16_values(rng, many.tokens[r] * H));
    d_dy_many.emplace_back(testing::to_bf16_bits(dy_many.back()));
    append(dy_one[0], dy_many.back());
  }
  one.config.max_tokens_per_rank = one.tokens[0];
  one.w13 = many.w13, one.w2 = many.w2;
  one.d_x.emplace_back(testing::to_bf16_bits(one.x[0]));
  one.d_ids.emplace_back(one.ids[0]);
  one.d_weights.emplace_back(one.weights[0]);
  one.d_y.emplace_back(one.tokens[0] * H);
  one.d_w13.emplace_back(testing::to_bf16_bits(one.w13));
  one.d_w2.emplace_back(testing::to_bf16_bits(one.w2));
  d_dy_one.emplace_back(testing::to_bf16_bits(dy_one[0]));

  FusedMoe layer_many(many.config, {.fused_backward = true}), layer_one(one.config, {.fused_backward = true});
  many.load_weights(layer_many);
  one.load_weights(layer_one);
  for (bool keep : {true, false}) {
    SCOPED_TRACE(keep ? "from kept forwards" : "replayed");
    layer_many.forward(many.io(), nullptr, keep);
    layer_one.forward(one.io(), nullptr, keep);
    CUDA_CHECK(cudaDeviceSynchronize());
    const Gradients got_many = run_backward(layer_many, many, d_dy_many),
                    got_one = run_backward(layer_one, one, d_dy_one);
    EXPECT_EQ(layer_many.last_backward_replayed(), !keep);
    EXPECT_TRUE(got_many == got_one);
    expect_gradients(got_many, reference_backward(one, dy_one), one.config);
  }
}

// FP8 weight gradients through the public layer (FusedMoeOptions::fp8_weight_gradients) on the chain
// and on the fused backward kernel, at three virtual ranks: dx and the router-weight gradients keep the
// bf16 layer's bits (nothing of theirs passes the weight gradients), both weight gradients lie within
// FP8's band of the host reference and are not the bf16 ones.
TEST(FusedMoe, Fp8WeightGradientsThroughTheLayer) {
  POUNCE_REQUIRE_HOPPER();
  auto rng = testing::fresh_rng();
  Problem p = make_problem(rng, Case{3, 200, 256, 128, 12, 4, RoutingPattern::kZipf});
  std::vector<std::vector<float>> dy;
  std::vector<DeviceBuffer<uint16_t>> d_dy;
  for (int r = 0; r < p.config.ranks; ++r) {
    dy.push_back(testing::random_bf16_values(rng, p.tokens[r] * p.config.hidden));
    d_dy.emplace_back(testing::to_bf16_bits(dy.back()));
  }
  const reference::MoeGradients want = reference_backward(p, dy);
  for (bool fused : {false, true}) {
    SCOPED_TRACE(fused ? "fused backward" : "chain");
    FusedMoe fp8_layer(p.config, {.fused_backward = fused, .fp8_weight_gradients = true});
    FusedMoe bf16_layer(p.config, {.fused_backward = fused});
    p.load_weights(fp8_layer);
    p.load_weights(bf16_layer);
    fp8_layer.forward(p.io(), nullptr, /*keep_for_backward=*/true);
    bf16_layer.forward(p.io(), nullptr, /*keep_for_backward=*/true);
    const Gradients fp8 = run_backward(fp8_layer, p, d_dy), bf16 = run_backward(bf16_layer, p, d_dy);
    EXPECT_EQ(fp8.dx, bf16.dx);
    EXPECT_EQ(fp8.d_topk, bf16.d_topk);
    EXPECT_NE(fp8.dw13, bf16.dw13) << "the weight gradients did not run in FP8";
    const double dw13 = testing::relative_l2_error(fp8.dw13, want.dw13),
                 dw2 = testing::relative_l2_error(fp8.dw2, want.dw2);
    std::printf("[ measured ] FP8 weight gradients, layer: dW13 %.3g, dW2 %.3g\n", dw13, dw2);
    EXPECT_LT(dw13, 0.1);
    EXPECT_LT(dw2, 0.1);
  }
  EpConfig config{.ranks = 1, .experts = 4, .topk = 2, .hidden = 256, .intermediate = 192, .max_tokens_per_rank = 8};
  testing::expect_error([&] { FusedMoe bad(config, {.fp8_weight_gradients = true}); },
                        "fp8_weight_gradients needs H and I multiples of 128");
}

// FP8 data and weight gradients on one layer whose routing changes every round (one hot expert, Zipf,
// half the experts empty; inputs and router weights, some exactly zero, drawn again), at three virtual
// ranks: every gradient within FP8's band of the host reference, and each backward deterministic.
TEST(FusedMoe, Fp8GradientsAcrossChangingRoutings) {
  POUNCE_REQUIRE_HOPPER();
  auto rng = testing::fresh_rng();
  Problem p = make_problem(rng, Case{3, 150, 256, 128, 12, 4, RoutingPattern::kUniform});
  FusedMoe layer(p.config, {.fp8_data_gradients = true, .fp8_weight_gradients = true});
  p.load_weights(layer);
  layer.refresh_fp8_weights(nullptr);
  const int64_t H = p.config.hidden;
  int round = 0;
  for (RoutingPattern pattern : {RoutingPattern::kOneExpert, RoutingPattern::kZipf, RoutingPattern::kHalfEmpty}) {
    SCOPED_TRACE("round " + std::to_string(round));
    std::vector<std::vector<float>> dy;
    std::vector<DeviceBuffer<uint16_t>> d_dy;
    for (int r = 0; r < p.config.ranks; ++r) {
      const int64_t T = p.tokens[r];
      p.x[r] = testing::random_bf16_values(rng, T * H);
      p.ids[r] = reference::synthetic_topk_ids(pattern, T, p.config.experts, p.config.topk, rng);
      p.weights[r] = reference::synthetic_topk_weights(T, p.config.topk, rng);
      for (int64_t route = round; route < T * p.config.topk; route += 5) p.weights[r][route] = 0.0f;
      p.d_x[r].upload(testing::to_bf16_bits(p.x[r]));
      p.d_ids[r].upload(p.ids[r]);
      p.d_weights[r].upload(p.weights[r]);
      dy.push_back(testing::random_bf16_values(rng, T * H));
      d_dy.emplace_back(testing::to_bf16_bits(dy.back()));
    }
    const reference::MoeGradients want = reference_backward(p, dy);
    layer.forward(p.io(), nullptr, /*keep_for_backward=*/true);
    const Gradients got = run_backward(layer, p, d_dy);
    EXPECT_TRUE(run_backward(layer, p, d_dy) == got) << "not deterministic";
    std::vector<float> dx;
    for (uint16_t b : got.dx) dx.push_back(formats::bf16_to_float(b));
    EXPECT_LT(testing::relative_l2_error(dx, want.dx), 0.1);
    EXPECT_LT(testing::worst_token_error(dx, want.dx, H), 0.2);
    EXPECT_LT(testing::relative_l2_error(got.d_topk, want.d_topk_weights), 0.1);
    EXPECT_LT(testing::relative_l2_error(got.dw13, want.dw13), 0.1);
    EXPECT_LT(testing::relative_l2_error(got.dw2, want.dw2), 0.1);
    ++round;
  }
}

// A null communicator literal (or `{}`) in the communicator's place is a compile error, not the NCCL
// constructor's run-time one.
static_assert(!std::is_constructible_v<FusedMoe, const EpConfig&, std::nullptr_t>);
static_assert(std::is_constructible_v<FusedMoe, const EpConfig&, const FusedMoeOptions&>);

// FP8 data gradients through the public layer (FusedMoeOptions::fp8_data_gradients) at one and three
// virtual ranks, from kept forwards and replayed: dW2 (which reads bf16 rows only) has the bf16 layer's
// bits, every other gradient lies within FP8's band of the host reference. A backward before
// refresh_fp8_weights, or after set_weights without it, is refused; so are options it cannot run with.
TEST(FusedMoe, Fp8DataGradientsThroughTheLayer) {
  POUNCE_REQUIRE_HOPPER();
  auto rng = testing::fresh_rng();
  for (int ranks : {1, 3}) {
    SCOPED_TRACE(::testing::Message() << ranks << " virtual ranks");
    Problem p = make_problem(rng, Case{ranks, 200, 256, 128, 12, 4, RoutingPattern::kZipf});
    std::vector<std::vector<float>> dy;
    std::vector<DeviceBuffer<uint16_t>> d_dy;
    for (int r = 0; r < ranks; ++r) {
      dy.push_back(testing::random_bf16_values(rng, p.tokens[r] * p.config.hidden));
      d_dy.emplace_back(testing::to_bf16_bits(dy.back()));
    }
    const reference::MoeGradients want = reference_backward(p, dy);
    FusedMoe fp8_layer(p.config, {.fp8_data_gradients = true}), bf16_layer(p.config);
    p.load_weights(fp8_layer);
    p.load_weights(bf16_layer);
    fp8_layer.forward(p.io(), nullptr, /*keep_for_backward=*/true);
    testing::expect_error([&] { run_backward(fp8_layer, p, d_dy); },
                          "fp8_data_gradients needs refresh_fp8_weights() after set_weights");
    fp8_layer.refresh_fp8_weights(nullptr);
    for (bool keep : {true, false}) {
      SCOPED_TRACE(keep ? "from kept forwards" : "replayed");
      fp8_layer.forward(p.io(), nullptr, keep);
      bf16_layer.forward(p.io(), nullptr, keep);
      const Gradients fp8 = run_backward(fp8_layer, p, d_dy), bf16 = run_backward(bf16_layer, p, d_dy);
      EXPECT_EQ(fp8_layer.last_backward_replayed(), !keep);
      EXPECT_EQ(fp8.dw2, bf16.dw2);
      if (!fp8.dx.empty()) {
        EXPECT_NE(fp8.dx, bf16.dx) << "the data gradients did not run in FP8";
      }
      std::vector<float> dx;
      for (uint16_t b : fp8.dx) dx.push_back(formats::bf16_to_float(b));
      const double dx_l2 = testing::relative_l2_error(dx, want.dx),
                   dw13 = testing::relative_l2_error(fp8.dw13, want.dw13);
      std::printf("[ measured ] FP8 data gradients, layer: dx %.3g, dW13 %.3g\n", dx_l2, dw13);
      EXPECT_LT(dx_l2, 0.1);
      EXPECT_LT(testing::worst_token_error(dx, want.dx, p.config.hidden), 0.2);
      EXPECT_LT(dw13, 0.1);
    }
    p.load_weights(fp8_layer);  // new weights: the copies are stale until refreshed
    testing::expect_error([&] { run_backward(fp8_layer, p, d_dy); },
                          "fp8_data_gradients needs refresh_fp8_weights() after set_weights");
  }
  EpConfig config{.ranks = 1, .experts = 4, .topk = 2, .hidden = 256, .intermediate = 128, .max_tokens_per_rank = 8};
  testing::expect_error([&] { FusedMoe bad(config, {.fused_backward = true, .fp8_data_gradients = true}); },
                        "fused_backward has no FP8 path yet");
  FusedMoe plain(config);
  testing::expect_error([&] { plain.refresh_fp8_weights(nullptr); }, "made without fp8_data_gradients");
  config.intermediate = 192;
  testing::expect_error([&] { FusedMoe bad(config, {.fp8_data_gradients = true}); },
                        "fp8_data_gradients needs H and I multiples of 128");
}

// The fused backward over the NCCL window at one rank (dy, the router weights and their gradients
// through the window, the backward's own arrivals and start flags there) gives the virtual-rank layer's
// gradients bit for bit, backward after backward.
TEST(FusedMoe, NcclOneRankBackwardMatchesVirtualRanksBitwise) {
  POUNCE_REQUIRE_HOPPER();
  auto rng = testing::fresh_rng();
  Problem p = make_problem(rng, Case{1, 333, 256, 1536, 8, 3, RoutingPattern::kZipf});
  for (int64_t route = 0; route < p.tokens[0] * p.config.topk; route += 4) p.weights[0][route] = 0.0f;
  p.d_weights[0].upload(p.weights[0]);
  const std::vector<DeviceBuffer<uint16_t>> d_dy = [&] {
    std::vector<DeviceBuffer<uint16_t>> dy;
    dy.emplace_back(testing::to_bf16_bits(testing::random_bf16_values(rng, p.tokens[0] * p.config.hidden)));
    return dy;
  }();
  FusedMoe virtual_layer(p.config, {.fused_backward = true});
  p.load_weights(virtual_layer);
  virtual_layer.forward(p.io(), nullptr, /*keep_for_backward=*/true);
  const Gradients want = run_backward(virtual_layer, p, d_dy);

  std::vector<ncclComm_t> comms = comm::init_single_process_comms({0});
  {
    FusedMoe nccl_layer(p.config, comms[0], {.fused_backward = true});
    p.load_weights(nccl_layer);
    for (int repeat = 0; repeat < 3; ++repeat) {
      nccl_layer.forward(p.io(), nullptr, /*keep_for_backward=*/true);
      EXPECT_TRUE(run_backward(nccl_layer, p, d_dy) == want) << "backward " << repeat;
      EXPECT_FALSE(nccl_layer.last_backward_replayed());
    }
  }
  comm::destroy_single_process_comms(comms);
}

// Padding rows of the ring and of the kept gate/up rows hold whatever earlier forwards left there: after a
// forward whose every x is NaN, the next forward's backward must still be finite and right, in place and
// through a bounded ring.
TEST(FusedMoe, BackwardIgnoresWhatEarlierForwardsLeftInPaddingRows) {
  POUNCE_REQUIRE_HOPPER();
  auto rng = testing::fresh_rng();
  for (int ring : {0, kMinRing}) {
    SCOPED_TRACE(ring == 0 ? "in place" : "bounded ring");
    Problem p = make_problem(rng, Case{1, 300, 256, 128, 8, 3, RoutingPattern::kZipf});
    FusedMoeOptions options{.fused_backward = true};
    if (ring == kMinRing) options.minibatch_rows = 128, options.ring_blocks = 2;
    FusedMoe layer(p.config, options);
    p.load_weights(layer);
    const int64_t T = p.tokens[0], H = p.config.hidden;
    p.d_x[0].fill_bytes(0xFF);  // NaN everywhere
    layer.forward(p.io()[0], nullptr, /*keep_for_backward=*/true);
    CUDA_CHECK(cudaDeviceSynchronize());
    p.d_x[0].upload(testing::to_bf16_bits(p.x[0]));
    p.ids[0] = reference::synthetic_topk_ids(RoutingPattern::kUniform, T, p.config.experts, p.config.topk, rng);
    p.d_ids[0].upload(p.ids[0]);
    const std::vector<std::vector<float>> dy{testing::random_bf16_values(rng, T * H)};
    std::vector<DeviceBuffer<uint16_t>> d_dy;
    d_dy.emplace_back(testing::to_bf16_bits(dy[0]));
    layer.forward(p.io()[0], nullptr, /*keep_for_backward=*/true);
    CUDA_CHECK(cudaDeviceSynchronize());
    const Gradients got = run_backward(layer, p, d_dy);
    EXPECT_FALSE(layer.last_backward_replayed());
    expect_gradients(got, reference_backward(p, dy), p.config);
  }
}

// What the backward uses depends on the forward it follows: a later forward on other inputs makes the
// backward of the earlier one replay (and still be right).
TEST(FusedMoe, BackwardReplaysWhenItsForwardIsNotTheLatest) {
  POUNCE_REQUIRE_HOPPER();
  auto rng = testing::fresh_rng();
  Problem p = make_problem(rng, Case{1, 300, 256, 128, 8, 4, RoutingPattern::kZipf});
  Problem other = make_problem(rng, Case{1, 200, 256, 128, 8, 4, RoutingPattern::kUniform});
  FusedMoe layer(p.config);
  p.load_weights(layer);
  const std::vector<std::vector<float>> dy{testing::random_bf16_values(rng, p.tokens[0] * p.config.hidden)};
  std::vector<DeviceBuffer<uint16_t>> d_dy;
  d_dy.emplace_back(testing::to_bf16_bits(dy[0]));
  layer.forward(p.io(), nullptr, /*keep_for_backward=*/true);
  layer.forward(other.io(), nullptr, /*keep_for_backward=*/true);
  CUDA_CHECK(cudaDeviceSynchronize());
  const Gradients got = run_backward(layer, p, d_dy);
  EXPECT_TRUE(layer.last_backward_replayed());
  expect_gradients(got, reference_backward(p, dy), p.config);

  // A layer that must not replay refuses such a backward by name, before enqueuing anything, and takes
  // the one right after a training forward.
  FusedMoeOptions strict;
  strict.backward_replays = false;
  FusedMoe strict_layer(p.config, strict);
  p.load_weights(strict_layer);
  strict_layer.forward(p.io(), nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  testing::expect_error([&] { run_backward(strict_layer, p, d_dy); }, "no kept forward for these inputs");
  strict_layer.forward(p.io(), nullptr, /*keep_for_backward=*/true);
  CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_TRUE(run_backward(strict_layer, p, d_dy) == got);
  EXPECT_FALSE(strict_layer.last_backward_replayed());
}

// Holds a stream at a host function until open() (or its end): the work enqueued behind it waits.
class StreamGate {
 public:
  explicit StreamGate(cudaStream_t stream) : stream_(stream) {
    CUDA_CHECK(cudaLaunchHostFunc(stream, &StreamGate::wait, this));
  }
  ~StreamGate() {
    open();
    (void)cudaStreamSynchronize(stream_);  // the host function has returned before this object goes
  }
  void open() {
    std::lock_guard lock(mutex_);
    open_ = true;
    opened_.notify_all();
  }

 private:
  static void CUDART_CB wait(void* gate) {
    auto* self = static_cast<StreamGate*>(gate);
    std::unique_lock lock(self->mutex_);
    self->opened_.wait(lock, [self] { return self->open_; });
  }
  cudaStream_t stream_;
  std::mutex mutex_;
  std::condition_variable opened_;
  bool open_ = false;
};

// The layers of one config on a GPU share the forward's hidden and output rings and the backward's route
// rows (FusedMoe::shared_buffers_id): the second layer's first backward allocates none of its own, and
// neither another layer's forward and backward between a layer's forward and its backward nor the two
// layers' forwards and backwards enqueued on two streams without a host synchronization between them
// (the second waits for the first on the GPU) changes any of their bits (across ranks the x rows are
// shared too: a backward pulls its own again). A layer with a smaller ring
// shares the set (with rings of its size) and gives the same bits; a layer of another config has rows of
// its own. The one-rank case is large enough that its rows dwarf the test's own allocations (and
// too large for the host reference: the three-rank case checks that).
TEST(FusedMoe, LayersOfOneConfigShareTheirRows) {
  POUNCE_REQUIRE_HOPPER();
  auto rng = testing::fresh_rng();
  for (const bool fused : {true, false}) {
    for (const Case& c : {Case{1, 6000, 512, 512, 8, 4, RoutingPattern::kZipf},
                          Case{3, 700, 256, 128, 12, 3, RoutingPattern::kUniform}}) {
      SCOPED_TRACE(std::string(fused ? "fused" : "chain") + ", " + ::testing::PrintToString(c));
      Problem a = make_problem(rng, c), b = make_problem(rng, c);
      const FusedMoeOptions options{.fused_backward = fused};
      FusedMoe layer_a(a.config, options), layer_b(b.config, options);
      a.load_weights(layer_a);
      b.load_weights(layer_b);
      EpConfig other = c.ranks == 1 ? a.config : b.config;
      other.max_tokens_per_rank += 1;
      EXPECT_EQ(layer_a.shared_buffers_id(), layer_b.shared_buffers_id());
      EXPECT_NE(FusedMoe(other, options).shared_buffers_id(), layer_a.shared_buffers_id());
      std::vector<std::vector<float>> dy_a, dy_b;
      std::vector<DeviceBuffer<uint16_t>> d_dy_a, d_dy_b;
      for (int r = 0; r < c.ranks; ++r) {
        dy_a.push_back(testing::random_bf16_values(rng, a.tokens[r] * c.hidden));
        dy_b.push_back(testing::random_bf16_values(rng, b.tokens[r] * c.hidden));
        d_dy_a.emplace_back(testing::to_bf16_bits(dy_a.back()));
        d_dy_b.emplace_back(testing::to_bf16_bits(dy_b.back()));
      }
      const auto train = [](FusedMoe& layer, Problem& p, cudaStream_t stream) {
        layer.forward(p.io(), stream, /*keep_for_backward=*/true);
      };

      // One after the other: each checked against the host reference.
      const bool small = c.ranks > 1;
      train(layer_a, a, nullptr);
      CUDA_CHECK(cudaDeviceSynchronize());
      const auto y_a = a.outputs();
      if (small) expect_matches(y_a, reference_forward(a), c.hidden);
      const Gradients want_a = run_backward(layer_a, a, d_dy_a);
      if (small) expect_gradients(want_a, reference_backward(a, dy_a), a.config);
      train(layer_b, b, nullptr);
      CUDA_CHECK(cudaDeviceSynchronize());
      const auto y_b = b.outputs();
      size_t free_before = 0, free_after = 0, total = 0;
      CUDA_CHECK(cudaMemGetInfo(&free_before, &total));
      const Gradients want_b = run_backward(layer_b, b, d_dy_b);
      CUDA_CHECK(cudaMemGetInfo(&free_after, &total));
      if (small) expect_gradients(want_b, reference_backward(b, dy_b), b.config);
      // The rings are shared, the x rows too unless in place at one rank (the backward reads them there).
      const int64_t ring_rows = c.ranks * layer_a.ring_blocks() * 128;
      const int64_t ring_bytes = ring_rows * (c.intermediate + (layer_a.in_place() ? 1 : 2) * c.hidden) * 2;
      EXPECT_GE(layer_a.shared_device_bytes(), ring_bytes);
      EXPECT_EQ(layer_a.shared_device_bytes(), layer_b.shared_device_bytes());
      EXPECT_EQ(layer_a.device_bytes(), layer_b.device_bytes());
      if (!small) {
        EXPECT_LT(int64_t(free_before) - int64_t(free_after), layer_a.shared_device_bytes() / 2)
            << "the second layer's first backward allocated rows of its own";
      }

      // A layer of the same config with a bounded ring (one-m-block minibatches, two of them) shares the
      // route rows too, with a ring pair of its size, and gives layer a's bits on a's inputs.
      {
        FusedMoeOptions bounded = options;
        bounded.minibatch_rows = 128;
        bounded.ring_blocks = 2;
        const int64_t shared_before = layer_a.shared_device_bytes();
        FusedMoe layer_c(a.config, bounded);
        a.load_weights(layer_c);
        EXPECT_EQ(layer_c.shared_buffers_id(), layer_a.shared_buffers_id());
        EXPECT_LT(layer_c.ring_blocks(), layer_a.ring_blocks());
        const int64_t c_ring_rows = c.ranks * layer_c.ring_blocks() * 128;
        EXPECT_GE(layer_a.shared_device_bytes() - shared_before, c_ring_rows * (c.intermediate + c.hidden) * 2)
            << "no ring pair of layer c's size";
        a.poison_outputs();
        train(layer_c, a, nullptr);
        CUDA_CHECK(cudaDeviceSynchronize());
        EXPECT_TRUE(a.outputs() == y_a) << "bounded ring";
        EXPECT_TRUE(run_backward(layer_c, a, d_dy_a) == want_a) << "bounded ring";
        EXPECT_FALSE(layer_c.last_backward_replayed());
        EXPECT_EQ(layer_c.shared_device_bytes(), layer_a.shared_device_bytes());
      }

      // Both forwards, then the backwards in the other order; then the same from plain forwards (the
      // backwards replay them: planning and GEMM1 again, into the shared rows too).
      a.poison_outputs();
      b.poison_outputs();
      train(layer_a, a, nullptr);
      train(layer_b, b, nullptr);
      CUDA_CHECK(cudaDeviceSynchronize());
      EXPECT_TRUE(a.outputs() == y_a && b.outputs() == y_b) << "forwards back to back";
      EXPECT_TRUE(run_backward(layer_b, b, d_dy_b) == want_b);
      EXPECT_TRUE(run_backward(layer_a, a, d_dy_a) == want_a);
      EXPECT_FALSE(layer_a.last_backward_replayed() || layer_b.last_backward_replayed());
      layer_a.forward(a.io(), nullptr);
      layer_b.forward(b.io(), nullptr);
      EXPECT_TRUE(run_backward(layer_b, b, d_dy_b) == want_b) << "replayed";
      EXPECT_TRUE(run_backward(layer_a, a, d_dy_a) == want_a) << "replayed";
      EXPECT_TRUE(layer_a.last_backward_replayed() && layer_b.last_backward_replayed());

      // On two streams, enqueued back to back while the first is held: the second must wait for it.
      cudaStream_t stream_a = nullptr, stream_b = nullptr;
      CUDA_CHECK(cudaStreamCreateWithFlags(&stream_a, cudaStreamNonBlocking));
      CUDA_CHECK(cudaStreamCreateWithFlags(&stream_b, cudaStreamNonBlocking));
      const GradientBuffers got_a = poisoned_gradients(a), got_b = poisoned_gradients(b);
      a.poison_outputs();
      b.poison_outputs();
      CUDA_CHECK(cudaDeviceSynchronize());
      train(layer_a, a, stream_a);
      train(layer_b, b, stream_b);
      {
        StreamGate gate(stream_a);
        enqueue_backward(layer_a, a, d_dy_a, got_a, stream_a);
        enqueue_backward(layer_b, b, d_dy_b, got_b, stream_b);
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        EXPECT_EQ(cudaStreamQuery(stream_b), cudaErrorNotReady) << "the second backward did not wait for the first";
        (void)cudaGetLastError();  // not-ready is no error for a later launch check to find
        gate.open();
      }
      const cudaError_t synced = cudaDeviceSynchronize();
      layer_a.check_device_errors();
      layer_b.check_device_errors();
      CUDA_CHECK(synced);
      EXPECT_TRUE(a.outputs() == y_a && b.outputs() == y_b) << "two streams";
      EXPECT_TRUE(got_a.download() == want_a) << "two streams";
      EXPECT_TRUE(got_b.download() == want_b) << "two streams";
      CUDA_CHECK(cudaStreamDestroy(stream_a));
      CUDA_CHECK(cudaStreamDestroy(stream_b));
    }
  }
}

// Routes each rank receives from a problem's routing.
std::vector<int64_t> routes_per_rank(const Problem& p) {
  std::vector<int64_t> routes(p.config.ranks, 0);
  for (const auto& ids : p.ids)
    for (int32_t id : ids) ++routes[id / p.config.local_experts()];
  return routes;
}

// EpConfig::max_routes_per_rank sizes a rank's rows for the routes it may receive. A routing within it
// runs as with rows for the worst case (forward and backward against the host reference); one that sends
// some rank more stops every rank before any data moves (y keeps its poison) with an error naming that
// rank, a backward enqueued behind that forward finds an empty schedule (and one enqueued after the
// error replays the forward, which stops the same way), and the layer then runs the first routing
// again, bit for bit.
// One rank (three more tokens past the capacity) and three virtual ranks (every token on rank 0's
// experts), the backward as a chain and fused.
TEST(FusedMoe, RoutingPastTheRouteCapacityIsNamedAndTheLayerRecovers) {
  POUNCE_REQUIRE_HOPPER();
  auto rng = testing::fresh_rng();
  for (const bool fused : {false, true}) {
    for (const Case& c : {Case{1, 300, 256, 128, 8, 3, RoutingPattern::kUniform},
                          Case{3, 200, 256, 128, 12, 3, RoutingPattern::kUniform}}) {
      SCOPED_TRACE(std::string(fused ? "fused" : "chain") + ", " + ::testing::PrintToString(c));
      Case past_case = c;
      if (c.ranks == 1) past_case.tokens += 3;  // still within the config's max_tokens_per_rank (tokens + 3)
      Problem fits = make_problem(rng, c), past = make_problem(rng, past_case);
      if (c.ranks > 1) {  // every token of every rank on experts 0 .. k - 1, all of them rank 0's
        ASSERT_LE(c.topk, c.experts / c.ranks);
        for (int r = 0; r < c.ranks; ++r) {
          for (size_t i = 0; i < past.ids[r].size(); ++i) past.ids[r][i] = int32_t(i % c.topk);
          past.d_ids[r].upload(past.ids[r]);
        }
      }
      const std::vector<int64_t> fit_routes = routes_per_rank(fits), past_routes = routes_per_rank(past);
      const int64_t capacity = *std::max_element(fit_routes.begin(), fit_routes.end());
      const int busiest = int(std::max_element(past_routes.begin(), past_routes.end()) - past_routes.begin());
      ASSERT_GT(past_routes[busiest], capacity);
      EpConfig worst = fits.config;
      fits.config.max_routes_per_rank = capacity;
      past.config = fits.config;
      const FusedMoeOptions options{.fused_backward = fused};
      FusedMoe layer(fits.config, options);
      fits.load_weights(layer);
      if (c.ranks > 1) {
        EXPECT_LT(layer.device_bytes(), FusedMoe(worst, options).device_bytes());
      }

      std::vector<std::vector<float>> dy;
      std::vector<DeviceBuffer<uint16_t>> d_dy, d_dy_past;
      for (int r = 0; r < c.ranks; ++r) {
        dy.push_back(testing::random_bf16_values(rng, fits.tokens[r] * c.hidden));
        d_dy.emplace_back(testing::to_bf16_bits(dy.back()));
        d_dy_past.emplace_back(testing::to_bf16_bits(testing::random_bf16_values(rng, past.tokens[r] * c.hidden)));
      }
      const auto train = [&](Problem& p) {
        p.poison_outputs();
        layer.forward(p.io(), nullptr, /*keep_for_backward=*/true);
      };

      train(fits);
      CUDA_CHECK(cudaDeviceSynchronize());
      layer.check_device_errors();
      const auto y = fits.outputs();
      expect_matches(y, reference_forward(fits), c.hidden);
      const Gradients want = run_backward(layer, fits, d_dy);
      expect_gradients(want, reference_backward(fits, dy), fits.config);

      // Past the capacity, with its backward enqueued behind it while the stream is held (so that the
      // backward runs on what the stopped forward left, rather than seeing its error on the host first).
      const GradientBuffers past_grads = poisoned_gradients(past);
      past.poison_outputs();
      cudaStream_t stream = nullptr;
      CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      {
        StreamGate gate(stream);
        layer.forward(past.io(), stream, /*keep_for_backward=*/true);
        enqueue_backward(layer, past, d_dy_past, past_grads, stream);
        gate.open();
      }
      CUDA_CHECK(cudaStreamSynchronize(stream));
      const std::string past_capacity = "the routing sends rank " + std::to_string(busiest) + " " +
                                        std::to_string(past_routes[busiest]) + " routes, more than the " +
                                        std::to_string(capacity);
      testing::expect_error([&] { layer.check_device_errors(); }, past_capacity);
      for (const auto& y_past : past.outputs()) {
        for (uint16_t b : y_past) ASSERT_EQ(b, 0xFFFF) << "y was written by a forward past the capacity";
      }
      // Its kept rows are void: a backward for it now replays the forward, and stops the same way.
      enqueue_backward(layer, past, d_dy_past, past_grads, stream);
      EXPECT_TRUE(layer.last_backward_replayed());
      CUDA_CHECK(cudaStreamSynchronize(stream));
      testing::expect_error([&] { layer.check_device_errors(); }, past_capacity);
      CUDA_CHECK(cudaStreamDestroy(stream));

      train(fits);
      CUDA_CHECK(cudaDeviceSynchronize());
      layer.check_device_errors();
      EXPECT_TRUE(fits.outputs() == y) << "after the error";
      EXPECT_TRUE(run_backward(layer, fits, d_dy) == want) << "after the error";
      EXPECT_FALSE(layer.last_backward_replayed());
    }
  }
}

// A forward and a backward captured once in a CUDA graph and replayed on new data in the same buffers:
// every replay is a new forward (the forward number lives on the device), y matches the host reference
// and the gradients are the bits a direct backward gives. Both a training forward (the backward from
// its kept rows) and a plain one (the backward replays it).
class FusedMoeGraphTest : public ::testing::TestWithParam<bool> {};

TEST_P(FusedMoeGraphTest, ForwardAndBackwardReplayInACudaGraph) {
  POUNCE_REQUIRE_HOPPER();
  const bool keep = GetParam();
  auto rng = testing::fresh_rng();
  Problem p = make_problem(rng, Case{1, 300, 256, 128, 8, 4, RoutingPattern::kZipf});
  const int64_t T = p.tokens[0], H = p.config.hidden, I = p.config.intermediate, E = p.config.experts,
                k = p.config.topk;
  FusedMoe layer(p.config, {.fused_backward = true});
  p.load_weights(layer);
  DeviceBuffer<uint16_t> d_dy(T * H), d_dx(T * H);
  DeviceBuffer<float> d_topk(T * k), dw13(E * 2 * I * H), dw2(E * H * I);
  const RankGrads grads{bf16(d_dy), bf16(d_dx), d_topk.data(), dw13.data(), dw2.data()};
  const RankIO io = p.io()[0];
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  layer.forward(io, stream, keep);  // the first backward (and kept forward) allocates: not inside a capture
  layer.backward(io, grads, WeightGradOutput::kF32, stream);
  CUDA_CHECK(cudaStreamSynchronize(stream));

  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  layer.forward(io, stream, keep);
  layer.backward(io, grads, WeightGradOutput::kF32, stream);
  CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  EXPECT_EQ(layer.last_backward_replayed(), !keep);
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 3; ++replay) {
    SCOPED_TRACE("replay " + std::to_string(replay));
    p.x[0] = testing::random_bf16_values(rng, T * H);
    p.d_x[0].upload(testing::to_bf16_bits(p.x[0]));
    d_dy.upload(testing::to_bf16_bits(testing::random_bf16_values(rng, T * H)));
    p.poison_outputs();
    d_dx.fill_bytes(0xFF);
    CUDA_CHECK(cudaGraphLaunch(exec, stream));
    const cudaError_t synced = cudaStreamSynchronize(stream);
    layer.check_device_errors();
    CUDA_CHECK(synced);
    expect_matches(p.outputs(), reference_forward(p), H);
    const auto graph_dx = d_dx.download();
    const auto graph_dw13 = dw13.download(), graph_dw2 = dw2.download();
    const auto graph_dtopk = d_topk.download();
    layer.backward(io, grads, WeightGradOutput::kF32, stream);  // from the rows the replay kept, if it kept
    CUDA_CHECK(cudaStreamSynchronize(stream));
    layer.check_device_errors();
    EXPECT_EQ(layer.last_backward_replayed(), !keep);
    EXPECT_EQ(d_dx.download(), graph_dx);
    EXPECT_EQ(d_topk.download(), graph_dtopk);
    EXPECT_EQ(dw13.download(), graph_dw13);
    EXPECT_EQ(dw2.download(), graph_dw2);
  }
  CUDA_CHECK(cudaGraphExecDestroy(exec));
  CUDA_CHECK(cudaGraphDestroy(graph));
  CUDA_CHECK(cudaStreamDestroy(stream));
}

// A forward replayed from a CUDA graph between a training forward and its backward replaces the kept
// rows without the host seeing it: the backward's device-side check names it instead of giving wrong
// gradients silently, and the layer works on after the error is collected.
TEST(FusedMoe, BackwardAfterAGraphReplayedForwardIsAnError) {
  POUNCE_REQUIRE_HOPPER();
  auto rng = testing::fresh_rng();
  Problem a = make_problem(rng, Case{1, 200, 256, 128, 8, 4, RoutingPattern::kZipf});
  Problem b = make_problem(rng, Case{1, 150, 256, 128, 8, 4, RoutingPattern::kUniform});
  b.config = a.config;
  FusedMoe layer(a.config);
  a.load_weights(layer);
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  layer.forward(b.io()[0], stream);
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  layer.forward(b.io()[0], stream);
  CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));

  const std::vector<std::vector<float>> dy{testing::random_bf16_values(rng, a.tokens[0] * a.config.hidden)};
  std::vector<DeviceBuffer<uint16_t>> d_dy;
  d_dy.emplace_back(testing::to_bf16_bits(dy[0]));
  layer.forward(a.io()[0], stream, /*keep_for_backward=*/true);
  CUDA_CHECK(cudaGraphLaunch(exec, stream));  // forward b again, unseen by the host
  CUDA_CHECK(cudaStreamSynchronize(stream));
  testing::expect_error([&] { run_backward(layer, a, d_dy); }, "those rows were another forward's");
  EXPECT_FALSE(layer.last_backward_replayed());

  // Collected: the layer runs on, and in order the kept rows are right again.
  layer.forward(a.io()[0], stream, /*keep_for_backward=*/true);
  CUDA_CHECK(cudaStreamSynchronize(stream));
  expect_gradients(run_backward(layer, a, d_dy), reference_backward(a, dy), a.config);
  CUDA_CHECK(cudaGraphExecDestroy(exec));
  CUDA_CHECK(cudaGraphDestroy(graph));
  CUDA_CHECK(cudaStreamDestroy(stream));
}

// Spans named `name` in a Chrome trace.
int64_t count_spans(const std::string& trace, const std::string& name) {
  const std::string key = "\"name\":\"" + name + "\",\"ph\":\"X\"";
  int64_t n = 0;
  for (size_t at = trace.find(key); at != std::string::npos; at = trace.find(key, at + 1)) ++n;
  return n;
}

// The in-kernel timeline (a POUNCE_TIMELINE build): every GEMM tile of a forward and of the backward's
// GEMMs leaves one mainloop and one epilogue span per consumer warpgroup, every CTA plans, and
// recording changes no bit of any output. Without the build option it refuses to start, by name.
TEST(FusedMoe, TimelineRecordsEveryTileAndChangesNoBits) {
  POUNCE_REQUIRE_HOPPER();
  auto rng = testing::fresh_rng();
  Problem p = make_problem(rng, Case{1, 300, 256, 128, 8, 3, RoutingPattern::kZipf});
  FusedMoe layer(p.config, {.fused_backward = true});
  p.load_weights(layer);
  if (!timeline_compiled_in()) {
    testing::expect_error([&] { layer.start_timeline(); }, "-DPOUNCE_TIMELINE=ON");
    GTEST_SKIP() << "this build records no timeline";
  }
  testing::expect_error([&] { layer.stop_timeline(); }, "no timeline was started");
  const int64_t H = p.config.hidden, I = p.config.intermediate, E = p.config.experts;
  std::vector<int64_t> routes(E);
  for (int32_t e : p.ids[0]) ++routes[e];
  int64_t m_blocks = 0;
  for (int64_t r : routes) m_blocks += (r + kBlockM - 1) / kBlockM;

  run_and_check(layer, p);
  const auto plain = p.outputs();
  layer.start_timeline();
  run_and_check(layer, p);
  const std::string forward = layer.stop_timeline();
  EXPECT_EQ(p.outputs(), plain) << "recording changed the forward's output";
  const int64_t consumers = 2;
  for (const char* span : {"mainloop", "epilogue"}) {
    EXPECT_EQ(count_spans(forward, std::string(span) + " G1"), consumers * m_blocks * n_blocks(2 * I)) << span;
    EXPECT_EQ(count_spans(forward, std::string(span) + " G2"), consumers * m_blocks * n_blocks(H)) << span;
  }
  EXPECT_EQ(count_spans(forward, "plan"), layer.ctas_per_rank());
  EXPECT_THAT(forward, HasSubstr("\"name\":\"fused forward\""));

  const std::vector<std::vector<float>> dy{testing::random_bf16_values(rng, p.tokens[0] * H)};
  std::vector<DeviceBuffer<uint16_t>> d_dy;
  d_dy.emplace_back(testing::to_bf16_bits(dy[0]));
  layer.forward(p.io()[0], nullptr, /*keep_for_backward=*/true);
  const Gradients unrecorded = run_backward(layer, p, d_dy);
  layer.forward(p.io()[0], nullptr, /*keep_for_backward=*/true);
  layer.start_timeline();
  const Gradients recorded = run_backward(layer, p, d_dy);
  const std::string backward = layer.stop_timeline();
  EXPECT_TRUE(recorded == unrecorded) << "recording changed the gradients";
  // From the kept rows: the fused kernel's dgrad down (G1) and gate/up (G2) tiles, then the weight
  // gradients' k-grouped GEMMs (each G1 of its own kernel: every expert's tiles, empty ones too).
  const int64_t wgrad_tiles =
      E * ((H + kBlockM - 1) / kBlockM) * n_blocks(I) + E * ((2 * I + kBlockM - 1) / kBlockM) * n_blocks(H);
  for (const char* span : {"mainloop", "epilogue"}) {
    EXPECT_EQ(count_spans(backward, std::string(span) + " G1"), consumers * (m_blocks * n_blocks(I) + wgrad_tiles));
    EXPECT_EQ(count_spans(backward, std::string(span) + " G2"), consumers * m_blocks * n_blocks(H));
  }
  for (const char* kernel : {"fused backward", "backward: wgrad down", "backward: wgrad gate/up"})
    EXPECT_THAT(backward, HasSubstr(std::string("\"name\":\"") + kernel + "\"")) << kernel;
  EXPECT_THAT(backward, ::testing::Not(HasSubstr("GEMM1 again")));
}

INSTANTIATE_TEST_SUITE_P(Forwards, FusedMoeGraphTest, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& info) { return info.param ? "Training" : "Plain"; });

}  // namespace
}  // namespace pounce::moe

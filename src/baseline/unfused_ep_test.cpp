// The unfused expert-parallel chain against the host reference's expert-parallel layer: virtual ranks on
// one GPU (the exchanges as copies), P = 1 to 8, routings that change between forwards on the same chain
// objects, each routing's inference forward and then a training forward with its backward (every
// gradient); and one NCCL rank (the exchanges as NCCL sends and receives to itself).
#include "baseline/unfused_ep.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <deque>
#include <tuple>

#include "comm/nccl_window.h"
#include "common/gpu.h"
#include "common/testing.h"
#include "reference/moe_layer_ep.h"
#include "reference/synthetic_routing.h"

namespace pounce::baseline {
namespace {

using reference::RoutingPattern;

__nv_bfloat16* bf16(const DeviceBuffer<uint16_t>& b) { return reinterpret_cast<__nv_bfloat16*>(b.data()); }

// Every rank's inputs on the host and the device, and every expert's weights.
struct Layer {
  EpConfig config;
  std::vector<float> w13, w2;
  std::vector<DeviceBuffer<uint16_t>> d_w13, d_w2;  // [rank]: its experts only
};

struct Inputs {
  std::vector<std::vector<float>> x, weights, dy;
  std::vector<std::vector<int32_t>> ids;
  std::vector<DeviceBuffer<uint16_t>> d_x, d_y, d_dy, d_dx, d_dw13, d_dw2;  // gradients: poisoned
  std::vector<DeviceBuffer<float>> d_weights, d_dweights;
};

Layer make_layer(std::mt19937_64& rng, const EpConfig& config) {
  Layer l{config, {}, {}, {}, {}};
  const int64_t E = config.experts, H = config.hidden, I = config.intermediate, P = config.ranks;
  l.w13 = testing::random_bf16_values(rng, E * 2 * I * H, -0.1f, 0.1f);
  l.w2 = testing::random_bf16_values(rng, E * H * I, -0.1f, 0.1f);
  const auto w13_bits = testing::to_bf16_bits(l.w13), w2_bits = testing::to_bf16_bits(l.w2);
  const int64_t w13_share = E / P * 2 * I * H, w2_share = E / P * H * I;
  for (int r = 0; r < P; ++r) {
    l.d_w13.emplace_back(std::span(w13_bits).subspan(r * w13_share, w13_share));
    l.d_w2.emplace_back(std::span(w2_bits).subspan(r * w2_share, w2_share));
  }
  return l;
}

// Rank r gets tokens + 3 r tokens (capped), a third of its router weights exactly zero.
Inputs make_inputs(std::mt19937_64& rng, const EpConfig& c, int64_t tokens, RoutingPattern pattern) {
  Inputs in;
  for (int r = 0; r < c.ranks; ++r) {
    const int64_t t = std::min<int64_t>(tokens == 0 ? 0 : tokens + 3 * r, c.max_tokens_per_rank);
    in.x.push_back(testing::random_bf16_values(rng, t * c.hidden));
    in.ids.push_back(reference::synthetic_topk_ids(pattern, t, c.experts, c.topk, rng));
    in.weights.push_back(reference::synthetic_topk_weights(t, c.topk, rng));
    for (size_t i = 0; i < in.weights.back().size(); i += 3) in.weights.back()[i] = 0.0f;
    in.dy.push_back(testing::random_bf16_values(rng, t * c.hidden));
    in.d_x.emplace_back(testing::to_bf16_bits(in.x.back()));
    in.d_dy.emplace_back(testing::to_bf16_bits(in.dy.back()));
    in.d_weights.emplace_back(in.weights.back());
    const int64_t local = c.local_experts();
    for (auto [buffers, count] : {std::pair(&in.d_y, t * c.hidden), std::pair(&in.d_dx, t * c.hidden),
                                  std::pair(&in.d_dw13, local * 2 * c.intermediate * c.hidden),
                                  std::pair(&in.d_dw2, local * c.hidden * c.intermediate)}) {
      buffers->emplace_back(count);
      buffers->back().fill_bytes(0xFF);  // NaN in bf16: an unwritten element fails the comparison
    }
    in.d_dweights.emplace_back(t * c.topk);
    in.d_dweights.back().fill_bytes(0xFF);
  }
  return in;
}

std::vector<float> floats(const DeviceBuffer<uint16_t>& bf16_bits) {
  std::vector<float> out;
  for (uint16_t b : bf16_bits.download()) out.push_back(formats::bf16_to_float(b));
  return out;
}

void expect_reference(const Layer& l, const Inputs& in) {
  const EpConfig& c = l.config;
  std::vector<reference::EpRankInputs> ref(c.ranks);
  for (int r = 0; r < c.ranks; ++r)
    ref[r] = {int64_t(in.ids[r].size()) / c.topk, in.x[r], in.ids[r], in.weights[r], {}};
  const auto want = reference::moe_layer_ep(c, ref, l.w13, l.w2, /*with_backward=*/false);
  for (int r = 0; r < c.ranks; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    std::vector<float> got;
    for (uint16_t b : in.d_y[r].download()) got.push_back(formats::bf16_to_float(b));
    if (got.empty()) continue;
    EXPECT_LT(testing::relative_l2_error(got, want[r].y), testing::kBf16LayerL2);
    EXPECT_LT(testing::worst_token_error(got, want[r].y, c.hidden), testing::kBf16LayerWorstToken);
  }
}

// Every rank's gradients (bf16 weight gradients) against the reference's: dx over the tensor and token
// by token, the router-weight gradients, and each local expert's dW13 and dW2 on their own (exact zeros
// for an expert nobody chose).
void expect_backward_reference(const Layer& l, const Inputs& in) {
  const EpConfig& c = l.config;
  const int64_t H = c.hidden, I = c.intermediate;
  std::vector<reference::EpRankInputs> ref(c.ranks);
  for (int r = 0; r < c.ranks; ++r)
    ref[r] = {int64_t(in.ids[r].size()) / c.topk, in.x[r], in.ids[r], in.weights[r], in.dy[r]};
  const auto want = reference::moe_layer_ep(c, ref, l.w13, l.w2, /*with_backward=*/true);
  for (int r = 0; r < c.ranks; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    const std::vector<float> dx = floats(in.d_dx[r]), dweights = in.d_dweights[r].download();
    if (!dx.empty()) {
      EXPECT_LT(testing::relative_l2_error(dx, want[r].dx), 2e-2);
      EXPECT_LT(testing::worst_token_error(dx, want[r].dx, H), 5e-2);
      EXPECT_LT(testing::relative_l2_error(dweights, want[r].d_topk_weights), 2e-2);
    }
    const std::vector<float> dw13 = floats(in.d_dw13[r]), dw2 = floats(in.d_dw2[r]);
    for (int64_t e = 0; e < c.local_experts(); ++e) {
      const auto slice = [](const auto& v, int64_t at, int64_t n) {
        return std::vector(v.begin() + at, v.begin() + at + n);
      };
      const auto got13 = slice(dw13, e * 2 * I * H, 2 * I * H), got2 = slice(dw2, e * H * I, H * I);
      const auto want13 = slice(want[r].dw13, e * 2 * I * H, 2 * I * H), want2 = slice(want[r].dw2, e * H * I, H * I);
      if (std::all_of(want13.begin(), want13.end(), [](double v) { return v == 0; })) {
        // Nobody chose it, or only with zero weights: both gradients exactly zero.
        EXPECT_TRUE(std::all_of(got13.begin(), got13.end(), [](float v) { return v == 0; })) << "expert " << e;
        EXPECT_TRUE(std::all_of(got2.begin(), got2.end(), [](float v) { return v == 0; })) << "expert " << e;
        continue;
      }
      EXPECT_LT(testing::relative_l2_error(got13, want13), 2e-2) << "dW13 of local expert " << e;
      EXPECT_LT(testing::relative_l2_error(got2, want2), 2e-2) << "dW2 of local expert " << e;
    }
  }
}

struct Case {
  int ranks;
  int64_t tokens;
  int experts, topk;
  RoutingPattern pattern;
};

void PrintTo(const Case& c, std::ostream* out) {
  *out << "P" << c.ranks << "_T" << c.tokens << "_E" << c.experts << "_k" << c.topk << "_"
       << reference::routing_pattern_name(c.pattern);
}

class UnfusedEpTest : public ::testing::TestWithParam<Case> {};

TEST_P(UnfusedEpTest, VirtualRanksMatchTheReferenceAsRoutingChanges) {
  // Each routing: an inference forward, then a training forward and its backward on the same chains.
  POUNCE_REQUIRE_HOPPER();
  auto rng = testing::fresh_rng();
  const Case p = GetParam();
  const EpConfig config{.ranks = p.ranks,
                        .experts = p.experts,
                        .topk = p.topk,
                        .hidden = 256,
                        .intermediate = 128,
                        .max_tokens_per_rank = std::max<int64_t>(p.tokens + 3 * p.ranks, 1)};
  const Layer l = make_layer(rng, config);
  std::deque<UnfusedEpMoe> chains;  // not movable: they own their GEMM's error record
  for (int r = 0; r < p.ranks; ++r) {
    chains.emplace_back(config, r);
    chains.back().set_weights(bf16(l.d_w13[r]), bf16(l.d_w2[r]));
  }
  std::vector<UnfusedEpMoe*> ranks;
  for (auto& chain : chains) ranks.push_back(&chain);
  for (const RoutingPattern pattern : {p.pattern, RoutingPattern::kUniform, RoutingPattern::kOneExpert}) {
    SCOPED_TRACE(reference::routing_pattern_name(pattern));
    Inputs in = make_inputs(rng, config, p.tokens, pattern);
    for (auto& chain : chains) chain.set_routing(in.ids);
    for (const bool training : {false, true}) {
      SCOPED_TRACE(training ? "training forward and backward" : "inference forward");
      for (int r = 0; r < p.ranks; ++r) {
        in.d_y[r].fill_bytes(0xFF);  // poisoned again: the second forward must write every element too
        chains[r].permute_for_dispatch(bf16(in.d_x[r]), nullptr);
      }
      exchange_on_one_gpu(ranks, Exchange::kDispatch, nullptr);
      for (auto& chain : chains) chain.run_experts(nullptr, training);
      exchange_on_one_gpu(ranks, Exchange::kReturn, nullptr);
      for (int r = 0; r < p.ranks; ++r) chains[r].combine(in.d_weights[r].data(), bf16(in.d_y[r]), nullptr);
      if (training) {
        for (int r = 0; r < p.ranks; ++r)
          chains[r].permute_for_backward(bf16(in.d_dy[r]), in.d_weights[r].data(), nullptr);
        exchange_on_one_gpu(ranks, Exchange::kDispatch, nullptr);
        exchange_on_one_gpu(ranks, Exchange::kWeights, nullptr);
        for (int r = 0; r < p.ranks; ++r)
          chains[r].run_experts_backward(in.d_dw13[r].data(), in.d_dw2[r].data(), WeightGradOutput::kBf16, nullptr);
        exchange_on_one_gpu(ranks, Exchange::kReturn, nullptr);
        exchange_on_one_gpu(ranks, Exchange::kDots, nullptr);
        for (int r = 0; r < p.ranks; ++r)
          chains[r].combine_backward(bf16(in.d_dx[r]), in.d_dweights[r].data(), nullptr);
      }
      CUDA_CHECK(cudaDeviceSynchronize());
      for (auto& chain : chains) chain.check_device_errors();
      expect_reference(l, in);
      if (training) {
        expect_backward_reference(l, in);
      } else {  // an inference forward kept nothing: its backward is refused by name
        testing::expect_error(
            [&] { chains[0].permute_for_backward(bf16(in.d_dy[0]), in.d_weights[0].data(), nullptr); },
            "backward without a training forward on this routing");
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    VirtualRanks, UnfusedEpTest,
    ::testing::Values(Case{1, 301, 8, 3, RoutingPattern::kZipf}, Case{2, 129, 8, 8, RoutingPattern::kUniform},
                      Case{3, 97, 12, 4, RoutingPattern::kZipf}, Case{4, 200, 16, 5, RoutingPattern::kHalfEmpty},
                      Case{8, 64, 16, 2, RoutingPattern::kZipf}, Case{5, 0, 10, 3, RoutingPattern::kUniform}),
    [](const auto& info) {
      std::ostringstream name;
      PrintTo(info.param, &name);
      return name.str();
    });

// One NCCL rank sends to and receives from itself: the same rows as the copies.
TEST(UnfusedEp, OneNcclRankMatchesTheReference) {
  POUNCE_REQUIRE_HOPPER();
  auto rng = testing::fresh_rng();
  const EpConfig config{
      .ranks = 1, .experts = 8, .topk = 3, .hidden = 256, .intermediate = 128, .max_tokens_per_rank = 333};
  const Layer l = make_layer(rng, config);
  std::vector<ncclComm_t> comms = comm::init_single_process_comms({0});
  {
    UnfusedEpMoe chain(config, 0);
    chain.set_weights(bf16(l.d_w13[0]), bf16(l.d_w2[0]));
    for (int round = 0; round < 2; ++round) {  // round 1: a training forward and its backward
      const bool training = round == 1;
      Inputs in = make_inputs(rng, config, 333, RoutingPattern::kZipf);
      chain.set_routing(in.ids);
      chain.permute_for_dispatch(bf16(in.d_x[0]), nullptr);
      exchange_over_nccl(chain.exchange(Exchange::kDispatch), comms[0], nullptr);
      chain.run_experts(nullptr, training);
      exchange_over_nccl(chain.exchange(Exchange::kReturn), comms[0], nullptr);
      chain.combine(in.d_weights[0].data(), bf16(in.d_y[0]), nullptr);
      if (training) {
        chain.permute_for_backward(bf16(in.d_dy[0]), in.d_weights[0].data(), nullptr);
        NCCL_CHECK(ncclGroupStart());  // both outgoing exchanges in one group, as a training loop would
        exchange_over_nccl(chain.exchange(Exchange::kDispatch), comms[0], nullptr);
        exchange_over_nccl(chain.exchange(Exchange::kWeights), comms[0], nullptr);
        NCCL_CHECK(ncclGroupEnd());
        chain.run_experts_backward(in.d_dw13[0].data(), in.d_dw2[0].data(), WeightGradOutput::kBf16, nullptr);
        NCCL_CHECK(ncclGroupStart());
        exchange_over_nccl(chain.exchange(Exchange::kReturn), comms[0], nullptr);
        exchange_over_nccl(chain.exchange(Exchange::kDots), comms[0], nullptr);
        NCCL_CHECK(ncclGroupEnd());
        chain.combine_backward(bf16(in.d_dx[0]), in.d_dweights[0].data(), nullptr);
      }
      CUDA_CHECK(cudaDeviceSynchronize());
      chain.check_device_errors();
      expect_reference(l, in);
      if (!training) continue;
      expect_backward_reference(l, in);
      // The fp32 outputs of the weight gradients: stored, their bf16 rounding is what kBf16 gave; added
      // twice into zeros, exactly twice the stored values.
      const int64_t w13_elems = in.d_dw13[0].size(), w2_elems = in.d_dw2[0].size();
      DeviceBuffer<float> dw13(w13_elems), dw2(w2_elems), sum13(w13_elems), sum2(w2_elems);
      dw13.fill_bytes(0xFF), dw2.fill_bytes(0xFF), sum13.fill_bytes(0), sum2.fill_bytes(0);
      chain.run_experts_backward(dw13.data(), dw2.data(), WeightGradOutput::kF32, nullptr);
      for (int twice = 0; twice < 2; ++twice)
        chain.run_experts_backward(sum13.data(), sum2.data(), WeightGradOutput::kAccumulateF32, nullptr);
      CUDA_CHECK(cudaDeviceSynchronize());
      chain.check_device_errors();
      for (auto [f32, sum, bf16_grad] :
           {std::tuple(&dw13, &sum13, &in.d_dw13[0]), std::tuple(&dw2, &sum2, &in.d_dw2[0])}) {
        const std::vector<float> stored = f32->download(), added = sum->download();
        const std::vector<uint16_t> rounded = bf16_grad->download();
        for (size_t i = 0; i < stored.size(); ++i) {
          ASSERT_EQ(formats::bf16_from_float(stored[i]), rounded[i]) << "element " << i;
          ASSERT_EQ(added[i], 2.0f * stored[i]) << "element " << i;
        }
      }
    }
  }
  comm::destroy_single_process_comms(comms);
}

TEST(UnfusedEp, BadRoutingIsNamed) {
  POUNCE_REQUIRE_HOPPER();
  const EpConfig config{
      .ranks = 2, .experts = 8, .topk = 2, .hidden = 256, .intermediate = 128, .max_tokens_per_rank = 16};
  UnfusedEpMoe chain(config, 1);
  testing::expect_error(
      [&] {
        chain.set_routing(std::vector<std::vector<int32_t>>{{0, 1}, {3, 8}});
      },
      "rank 1 token 0 routes to expert 8, outside [0, 8)");
  testing::expect_error(
      [&] {
        chain.set_routing(std::vector<std::vector<int32_t>>{{0, 1}});
      },
      "routing of 1 ranks, the chain has 2");
  // A backward needs a training forward on the current routing.
  chain.set_routing(std::vector<std::vector<int32_t>>{{0, 1}, {3, 4}});
  testing::expect_error([&] { chain.permute_for_backward(nullptr, nullptr, nullptr); },
                        "backward without a training forward on this routing");
}

}  // namespace
}  // namespace pounce::baseline

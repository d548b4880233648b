// The fused layer across GPUs: one NCCL rank per visible GPU (2 to 8), driven from one process with a
// thread per GPU, against the host reference of the expert-parallel layer, over several forwards (and
// training steps) whose token counts and routings change. Skips with fewer than two Hopper GPUs.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <optional>

#include "comm/gpu_threads.h"
#include "comm/nccl_window.h"
#include "common/device_buffer.h"
#include "common/gpu.h"
#include "common/testing.h"
#include "pounce/fused_moe.h"
#include "reference/moe_layer_ep.h"
#include "reference/synthetic_routing.h"

namespace pounce::moe {
namespace {

int visible_gpus() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess ? count : 0;
}

// Runs steps(layer, r) on every GPU r at once (a thread each), with a layer over NCCL whose rank r holds
// its own experts [r E/P, (r+1) E/P) of w13 and w2 only (their E4M3 copies refreshed for fp8_forward);
// every rank must finish without an error.
void on_every_gpu(const EpConfig& config, const std::vector<float>& w13, const std::vector<float>& w2,
                  const std::function<void(FusedMoe& layer, int rank)>& steps, const FusedMoeOptions& options = {}) {
  const int P = config.ranks;
  const int64_t w13_share = config.local_experts() * 2 * config.intermediate * config.hidden;
  const int64_t w2_share = config.local_experts() * config.hidden * config.intermediate;
  std::vector<ncclComm_t> comms = comm::init_single_process_comms_on_first(P);
  std::vector<std::optional<DeviceBuffer<uint16_t>>> d_w13(P), d_w2(P);
  std::vector<std::optional<FusedMoe>> layers(P);
  const std::vector<std::string> failures = comm::run_on_every_gpu(
      P,
      [&](int r) {
        const auto w13_bits = testing::to_bf16_bits(w13), w2_bits = testing::to_bf16_bits(w2);
        d_w13[r].emplace(std::span(w13_bits).subspan(r * w13_share, w13_share));
        d_w2[r].emplace(std::span(w2_bits).subspan(r * w2_share, w2_share));
      },
      [&](int r) {
        FusedMoe& layer = layers[r].emplace(config, comms[r], options);
        layer.set_weights(
            {reinterpret_cast<__nv_bfloat16*>(d_w13[r]->data()), reinterpret_cast<__nv_bfloat16*>(d_w2[r]->data())});
        if (options.fp8_forward) layer.refresh_fp8_weights(nullptr);
        steps(layer, r);
      },
      [&](int r) {
        layers[r].reset();
        d_w13[r].reset();
        d_w2[r].reset();
      });
  comm::destroy_single_process_comms(comms);
  for (int r = 0; r < P; ++r) ASSERT_EQ(failures[r], "") << "rank " << r;
}

// Forwards whose token counts and routings change, BF16 or (fp8_forward) E4M3, against the reference; the
// E4M3 layer within the FP8 band (E4M3 keeps 3 fraction bits), and bit for bit against the same forwards
// on P virtual ranks of one GPU (a row's E4M3 result does not depend on where its ranks run, so a stale or
// half-quantized row pulled over NVLink shows there even where the band would hide it).
void changing_forwards(const FusedMoeOptions& options) {
  const int P = std::min(visible_gpus(), 8);
  if (P < 2) GTEST_SKIP() << "needs at least two GPUs; this machine has " << P;
  auto rng = testing::fresh_rng();
  const EpConfig config{
      .ranks = P, .experts = 4 * P, .topk = 3, .hidden = 256, .intermediate = 128, .max_tokens_per_rank = 200};
  const int64_t H = config.hidden, I = config.intermediate, E = config.experts, k = config.topk;
  const auto w13 = testing::random_bf16_values(rng, E * 2 * I * H, -0.1f, 0.1f);
  const auto w2 = testing::random_bf16_values(rng, E * H * I, -0.1f, 0.1f);
  constexpr int kForwards = 4;
  // Rank r gets counts[f] - r tokens (at least 0): up, down to one token (zero for the other ranks), up
  // again, so counters topped up for unused m-blocks and tokens are read by a later, larger forward.
  const int64_t counts[kForwards] = {50, 200, 1, 200};

  // Inputs of every forward and rank, on the host.
  std::vector<std::vector<int64_t>> tokens(kForwards, std::vector<int64_t>(P));
  std::vector<std::vector<std::vector<float>>> x(kForwards), weights(kForwards);
  std::vector<std::vector<std::vector<int32_t>>> ids(kForwards);
  for (int f = 0; f < kForwards; ++f)
    for (int r = 0; r < P; ++r) {
      tokens[f][r] = std::max<int64_t>(0, counts[f] - r);
      x[f].push_back(testing::random_bf16_values(rng, tokens[f][r] * H));
      ids[f].push_back(
          reference::synthetic_topk_ids(reference::RoutingPattern::kZipf, tokens[f][r], int(E), int(k), rng));
      weights[f].push_back(reference::synthetic_topk_weights(tokens[f][r], int(k), rng));
    }

  std::vector<std::vector<std::vector<uint16_t>>> got(kForwards, std::vector<std::vector<uint16_t>>(P));
  on_every_gpu(
      config, w13, w2,
      [&](FusedMoe& layer, int r) {
        for (int f = 0; f < kForwards; ++f) {
          DeviceBuffer<uint16_t> d_x(testing::to_bf16_bits(x[f][r])), d_y(std::max<int64_t>(1, tokens[f][r] * H));
          DeviceBuffer<int32_t> d_ids(ids[f][r]);
          DeviceBuffer<float> d_weights(weights[f][r]);
          d_y.fill_bytes(0xFF);
          const RankIO io{reinterpret_cast<__nv_bfloat16*>(d_x.data()), d_ids.data(), d_weights.data(), tokens[f][r],
                          reinterpret_cast<__nv_bfloat16*>(d_y.data())};
          layer.forward(io, nullptr);
          const cudaError_t synced = cudaDeviceSynchronize();
          layer.check_device_errors();  // first: after a trap its record says more than the CUDA error
          CUDA_CHECK(synced);
          got[f][r] = d_y.download();
          got[f][r].resize(tokens[f][r] * H);
        }
      },
      options);
  if (::testing::Test::HasFatalFailure()) return;

  for (int f = 0; f < kForwards; ++f) {
    std::vector<reference::EpRankInputs> in(P);
    for (int r = 0; r < P; ++r) in[r] = {tokens[f][r], x[f][r], ids[f][r], weights[f][r], {}};
    const auto want = reference::moe_layer_ep(config, in, w13, w2, /*with_backward=*/false);
    for (int r = 0; r < P; ++r) {
      if (tokens[f][r] == 0) continue;
      std::vector<float> y;
      for (uint16_t b : got[f][r]) y.push_back(formats::bf16_to_float(b));
      if (options.fp8_forward) {
        EXPECT_LT(testing::relative_l2_error(y, want[r].y), 0.1) << "forward " << f << ", rank " << r;
        continue;
      }
      EXPECT_LT(testing::relative_l2_error(y, want[r].y), testing::kBf16LayerL2) << "forward " << f << ", rank " << r;
      EXPECT_LT(testing::worst_token_error(y, want[r].y, H), testing::kBf16LayerWorstToken)
          << "forward " << f << ", rank " << r;
    }
  }
  if (!options.fp8_forward) return;

  CUDA_CHECK(cudaSetDevice(0));
  const auto w13_bits = testing::to_bf16_bits(w13), w2_bits = testing::to_bf16_bits(w2);
  const int64_t w13_share = config.local_experts() * 2 * I * H, w2_share = config.local_experts() * H * I;
  std::vector<DeviceBuffer<uint16_t>> d_w13, d_w2;
  std::vector<ExpertWeights> shares;
  for (int r = 0; r < P; ++r) {
    d_w13.emplace_back(std::span(w13_bits).subspan(r * w13_share, w13_share));
    d_w2.emplace_back(std::span(w2_bits).subspan(r * w2_share, w2_share));
    shares.push_back(
        {reinterpret_cast<__nv_bfloat16*>(d_w13.back().data()), reinterpret_cast<__nv_bfloat16*>(d_w2.back().data())});
  }
  FusedMoe virtual_layer(config, options);
  virtual_layer.set_weights(shares);
  virtual_layer.refresh_fp8_weights(nullptr);
  for (int f = 0; f < kForwards; ++f) {
    std::vector<DeviceBuffer<uint16_t>> d_x, d_y;
    std::vector<DeviceBuffer<int32_t>> d_ids;
    std::vector<DeviceBuffer<float>> d_weights;
    std::vector<RankIO> io;
    for (int r = 0; r < P; ++r) {
      d_x.emplace_back(testing::to_bf16_bits(x[f][r]));
      d_y.emplace_back(std::max<int64_t>(1, tokens[f][r] * H));
      d_y.back().fill_bytes(0xFF);
      d_ids.emplace_back(ids[f][r]);
      d_weights.emplace_back(weights[f][r]);
      io.push_back({reinterpret_cast<__nv_bfloat16*>(d_x.back().data()), d_ids.back().data(), d_weights.back().data(),
                    tokens[f][r], reinterpret_cast<__nv_bfloat16*>(d_y.back().data())});
    }
    virtual_layer.forward(io, nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    virtual_layer.check_device_errors();
    for (int r = 0; r < P; ++r) {
      std::vector<uint16_t> bits = d_y[r].download();
      bits.resize(tokens[f][r] * H);
      EXPECT_EQ(got[f][r], bits) << "forward " << f << ", rank " << r << ": not the virtual ranks' bits";
    }
  }
}

TEST(FusedMoeMultiGpu, OneRankPerGpuMatchesReferenceAcrossChangingForwards) {
  POUNCE_REQUIRE_HOPPER();
  changing_forwards({});
}

// The E4M3 forward across GPUs: each rank quantizes its tokens into its window, peers pull E4M3 rows and
// scales over NVLink.
TEST(FusedMoeMultiGpu, OneRankPerGpuFp8ForwardMatchesReferenceAcrossChangingForwards) {
  POUNCE_REQUIRE_HOPPER();
  FusedMoeOptions options;
  options.fp8_forward = true;
  changing_forwards(options);
}

// Training steps across GPUs: a forward (BF16, or E4M3 with fp8_forward) that keeps its rows, then the
// fused backward over NCCL, twice (the same bits), for routings and token counts (down to zero on some
// ranks) that change every step, with a quarter of the router weights exactly zero; every gradient against
// the EP reference (after an E4M3 forward within the FP8 band).
void training_steps(const FusedMoeOptions& options) {
  const int P = std::min(visible_gpus(), 8);
  if (P < 2) GTEST_SKIP() << "needs at least two GPUs; this machine has " << P;
  auto rng = testing::fresh_rng();
  const EpConfig config{
      .ranks = P, .experts = 4 * P, .topk = 3, .hidden = 256, .intermediate = 1152, .max_tokens_per_rank = 200};
  const int64_t H = config.hidden, I = config.intermediate, E = config.experts, El = config.local_experts();
  const int64_t k = config.topk;
  const auto w13 = testing::random_bf16_values(rng, E * 2 * I * H, -0.1f, 0.1f);
  const auto w2 = testing::random_bf16_values(rng, E * H * I, -0.1f, 0.1f);
  constexpr int kSteps = 3;
  const int64_t counts[kSteps] = {200, 1, 150};

  std::vector<std::vector<int64_t>> tokens(kSteps, std::vector<int64_t>(P));
  std::vector<std::vector<std::vector<float>>> x(kSteps), weights(kSteps), dy(kSteps);
  std::vector<std::vector<std::vector<int32_t>>> ids(kSteps);
  for (int f = 0; f < kSteps; ++f)
    for (int r = 0; r < P; ++r) {
      tokens[f][r] = std::max<int64_t>(0, counts[f] - r);
      x[f].push_back(testing::random_bf16_values(rng, tokens[f][r] * H));
      dy[f].push_back(testing::random_bf16_values(rng, tokens[f][r] * H));
      ids[f].push_back(
          reference::synthetic_topk_ids(reference::RoutingPattern::kZipf, tokens[f][r], int(E), int(k), rng));
      weights[f].push_back(reference::synthetic_topk_weights(tokens[f][r], int(k), rng));
      for (int64_t route = f; route < tokens[f][r] * k; route += 4) weights[f][r][route] = 0.0f;
    }

  struct Got {
    std::vector<uint16_t> dx;
    std::vector<float> d_topk, dw13, dw2;
    bool operator==(const Got&) const = default;
  };
  std::vector<std::vector<Got>> got(kSteps, std::vector<Got>(P));
  std::vector<std::vector<bool>> same_bits(kSteps, std::vector<bool>(P));
  // Every step's inputs are uploaded first and the steps then enqueued back to back, with no host
  // synchronization between them: ranks drift apart across forward -> backward -> backward -> forward,
  // which the window buffers' reuse must survive.
  on_every_gpu(
      config, w13, w2,
      [&](FusedMoe& layer, int r) {
        const auto bf16 = [](DeviceBuffer<uint16_t>& b) { return reinterpret_cast<__nv_bfloat16*>(b.data()); };
        struct Outputs {
          DeviceBuffer<uint16_t> dx;
          DeviceBuffer<float> d_topk, dw13, dw2;
        };
        struct Step {
          DeviceBuffer<uint16_t> x, y, dy;
          DeviceBuffer<int32_t> ids;
          DeviceBuffer<float> weights;
          std::vector<Outputs> out;  // one per backward
        };
        std::vector<Step> steps;
        for (int f = 0; f < kSteps; ++f) {
          const int64_t T = tokens[f][r], rows = std::max<int64_t>(1, T);
          Step& step = steps.emplace_back(Step{DeviceBuffer<uint16_t>(testing::to_bf16_bits(x[f][r])),
                                               DeviceBuffer<uint16_t>(rows * H),
                                               DeviceBuffer<uint16_t>(testing::to_bf16_bits(dy[f][r])),
                                               DeviceBuffer<int32_t>(ids[f][r]),
                                               DeviceBuffer<float>(weights[f][r]),
                                               {}});
          for (int repeat = 0; repeat < 2; ++repeat) {
            Outputs& o = step.out.emplace_back(
                Outputs{DeviceBuffer<uint16_t>(rows * H), DeviceBuffer<float>(std::max<int64_t>(1, T * k)),
                        DeviceBuffer<float>(El * 2 * I * H), DeviceBuffer<float>(El * H * I)});
            for (auto* b : {&o.d_topk, &o.dw13, &o.dw2}) b->fill_bytes(0xFF);
            o.dx.fill_bytes(0xFF);
          }
        }
        CUDA_CHECK(cudaDeviceSynchronize());
        for (int f = 0; f < kSteps; ++f) {
          Step& step = steps[f];
          const RankIO io{bf16(step.x), step.ids.data(), step.weights.data(), tokens[f][r], bf16(step.y)};
          layer.forward(io, nullptr, /*keep_for_backward=*/true);
          for (Outputs& o : step.out)
            layer.backward(io, {bf16(step.dy), bf16(o.dx), o.d_topk.data(), o.dw13.data(), o.dw2.data()},
                           WeightGradOutput::kF32, nullptr);
        }
        const cudaError_t synced = cudaDeviceSynchronize();
        layer.check_device_errors();
        CUDA_CHECK(synced);
        for (int f = 0; f < kSteps; ++f) {
          std::vector<Got> g;
          for (Outputs& o : steps[f].out) {
            g.push_back({o.dx.download(), o.d_topk.download(), o.dw13.download(), o.dw2.download()});
            g.back().dx.resize(tokens[f][r] * H);
            g.back().d_topk.resize(tokens[f][r] * k);
          }
          same_bits[f][r] = g[1] == g[0];
          got[f][r] = std::move(g[0]);
        }
      },
      options);
  if (::testing::Test::HasFatalFailure()) return;

  const double l2 = options.fp8_forward ? 0.1 : 2e-2;  // E4M3 keeps 3 fraction bits

  for (int f = 0; f < kSteps; ++f) {
    std::vector<reference::EpRankInputs> in(P);
    for (int r = 0; r < P; ++r) in[r] = {tokens[f][r], x[f][r], ids[f][r], weights[f][r], dy[f][r]};
    const auto want = reference::moe_layer_ep(config, in, w13, w2, /*with_backward=*/true);
    for (int r = 0; r < P; ++r) {
      SCOPED_TRACE("step " + std::to_string(f) + ", rank " + std::to_string(r));
      EXPECT_TRUE(same_bits[f][r]) << "a second backward from the same kept rows gave other bits";
      const Got& g = got[f][r];
      if (tokens[f][r] > 0) {
        std::vector<float> dx;
        for (uint16_t b : g.dx) dx.push_back(formats::bf16_to_float(b));
        EXPECT_LT(testing::relative_l2_error(dx, want[r].dx), l2);
        if (!options.fp8_forward) {
          EXPECT_LT(testing::worst_token_error(dx, want[r].dx, H), 5e-2);
        }
        EXPECT_LT(testing::relative_l2_error(g.d_topk, want[r].d_topk_weights), l2);
      }
      for (int64_t e = 0; e < El; ++e) {
        const auto slice = [](const auto& v, int64_t at, int64_t n) {
          return std::vector(v.begin() + at, v.begin() + at + n);
        };
        const auto got13 = slice(g.dw13, e * 2 * I * H, 2 * I * H), got2 = slice(g.dw2, e * H * I, H * I);
        const auto want13 = slice(want[r].dw13, e * 2 * I * H, 2 * I * H);
        const auto want2 = slice(want[r].dw2, e * H * I, H * I);
        if (std::all_of(want13.begin(), want13.end(), [](double v) { return v == 0; })) {
          EXPECT_TRUE(std::all_of(got13.begin(), got13.end(), [](float v) { return v == 0; })) << "expert " << e;
          continue;
        }
        EXPECT_LT(testing::relative_l2_error(got13, want13), l2) << "dW13 of local expert " << e;
        EXPECT_LT(testing::relative_l2_error(got2, want2), l2) << "dW2 of local expert " << e;
      }
    }
  }
}

// A routing past max_routes_per_rank: every rank stops before any data moves (y keeps its poison) and
// names the rank past it; across GPUs the layers then refuse further forwards until rebuilt.
TEST(FusedMoeMultiGpu, RoutingPastTheRouteBoundIsNamedOnEveryRank) {
  const int P = std::min(visible_gpus(), 8);
  if (P < 2) GTEST_SKIP() << "needs at least two GPUs; this machine has " << P;
  auto rng = testing::fresh_rng();
  const int64_t T = 100, k = 3;
  const EpConfig config{.ranks = P,
                        .experts = 4 * P,
                        .topk = int(k),
                        .hidden = 256,
                        .intermediate = 128,
                        .max_tokens_per_rank = T,
                        .max_routes_per_rank = T * k};  // the balanced load
  const int64_t H = config.hidden, I = config.intermediate, E = config.experts;
  const auto w13 = testing::random_bf16_values(rng, E * 2 * I * H, -0.1f, 0.1f);
  const auto w2 = testing::random_bf16_values(rng, E * H * I, -0.1f, 0.1f);
  std::vector<int32_t> ids(T * k);
  for (int64_t i = 0; i < T * k; ++i) ids[i] = int32_t(i % k);  // every route on rank 0's experts
  const auto x = testing::random_bf16_values(rng, T * H);
  const auto weights = reference::synthetic_topk_weights(T, int(k), rng);
  std::vector<std::string> stopped(P), refused(P);
  std::vector<int> written(P, 0);
  on_every_gpu(config, w13, w2, [&](FusedMoe& layer, int r) {
    DeviceBuffer<uint16_t> d_x(testing::to_bf16_bits(x)), d_y(T * H);
    DeviceBuffer<int32_t> d_ids(ids);
    DeviceBuffer<float> d_weights(weights);
    d_y.fill_bytes(0xFF);
    const RankIO io{reinterpret_cast<__nv_bfloat16*>(d_x.data()), d_ids.data(), d_weights.data(), T,
                    reinterpret_cast<__nv_bfloat16*>(d_y.data())};
    layer.forward(io, nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    stopped[r] = testing::error_message([&] { layer.check_device_errors(); });
    for (uint16_t b : d_y.download()) written[r] += b != 0xFFFF;
    refused[r] = testing::error_message([&] { layer.forward(io, nullptr); });
  });
  for (int r = 0; r < P; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_THAT(stopped[r], ::testing::HasSubstr("the routing sends rank 0 " + std::to_string(P * T * k) +
                                                 " routes, more than the " + std::to_string(T * k)));
    EXPECT_EQ(written[r], 0) << "y was written by a forward past the bound";
    EXPECT_THAT(refused[r], ::testing::HasSubstr("rebuild the layer on every rank"));
  }
}

TEST(FusedMoeMultiGpu, OneRankPerGpuBackwardMatchesReference) {
  POUNCE_REQUIRE_HOPPER();
  training_steps({});
}

// The fused backward from an E4M3 forward's kept rows (bf16 gate/up rows; x rows pulled again in bf16).
TEST(FusedMoeMultiGpu, OneRankPerGpuBackwardAfterFp8ForwardMatchesReference) {
  POUNCE_REQUIRE_HOPPER();
  FusedMoeOptions options;
  options.fp8_forward = true;
  training_steps(options);
}

}  // namespace
}  // namespace pounce::moe

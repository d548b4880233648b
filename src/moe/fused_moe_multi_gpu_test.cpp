// The fused layer across GPUs: one NCCL rank per visible GPU (2 to 8), driven from one process with a
// thread per GPU, against the host reference of the expert-parallel layer, over several forwards whose
// token counts and routings change. Skips with fewer than two Hopper GPUs.
#include <gtest/gtest.h>

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

TEST(FusedMoeMultiGpu, OneRankPerGpuMatchesReferenceAcrossChangingForwards) {
  POUNCE_REQUIRE_HOPPER();
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

  std::vector<ncclComm_t> comms = comm::init_single_process_comms_on_first(P);
  std::vector<std::vector<std::vector<uint16_t>>> got(kForwards, std::vector<std::vector<uint16_t>>(P));
  std::vector<std::optional<DeviceBuffer<uint16_t>>> d_w13(P), d_w2(P);
  std::vector<std::optional<FusedMoe>> layers(P);
  const std::vector<std::string> failures = comm::run_on_every_gpu(
      P,
      [&](int r) {
        // Each GPU holds its own experts only: [r E/P, (r+1) E/P).
        const auto w13_bits = testing::to_bf16_bits(w13), w2_bits = testing::to_bf16_bits(w2);
        const int64_t w13_share = E / P * 2 * I * H, w2_share = E / P * H * I;
        d_w13[r].emplace(std::span(w13_bits).subspan(r * w13_share, w13_share));
        d_w2[r].emplace(std::span(w2_bits).subspan(r * w2_share, w2_share));
      },
      [&](int r) {
        FusedMoe& layer = layers[r].emplace(config, comms[r]);
        layer.set_weights(
            {reinterpret_cast<__nv_bfloat16*>(d_w13[r]->data()), reinterpret_cast<__nv_bfloat16*>(d_w2[r]->data())});
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
      [&](int r) {
        layers[r].reset();
        d_w13[r].reset();
        d_w2[r].reset();
      });
  comm::destroy_single_process_comms(comms);
  for (int r = 0; r < P; ++r) ASSERT_EQ(failures[r], "") << "rank " << r;

  for (int f = 0; f < kForwards; ++f) {
    std::vector<reference::EpRankInputs> in(P);
    for (int r = 0; r < P; ++r) in[r] = {tokens[f][r], x[f][r], ids[f][r], weights[f][r], {}};
    const auto want = reference::moe_layer_ep(config, in, w13, w2, /*with_backward=*/false);
    for (int r = 0; r < P; ++r) {
      if (tokens[f][r] == 0) continue;
      std::vector<float> y;
      for (uint16_t b : got[f][r]) y.push_back(formats::bf16_to_float(b));
      EXPECT_LT(testing::relative_l2_error(y, want[r].y), testing::kBf16LayerL2) << "forward " << f << ", rank " << r;
      EXPECT_LT(testing::worst_token_error(y, want[r].y, H), testing::kBf16LayerWorstToken)
          << "forward " << f << ", rank " << r;
    }
  }
}

}  // namespace
}  // namespace pounce::moe

// The C ABI returns every failure as a status and a message, never as an exception; these checks need
// no GPU: each fails before the layer touches one (or, for a valid config, either makes a layer on a
// Hopper GPU or says why it cannot).
#include "pounce/pounce_c.h"

#include <cuda_runtime.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <thread>

#include "common/gpu.h"
#include "pounce/fused_moe.h"

namespace {

using ::testing::HasSubstr;

pounce_config small_config() {
  return {.ranks = 2,
          .experts = 8,
          .topk = 2,
          .hidden = 128,
          .intermediate = 64,
          .max_tokens_per_rank = 256,
          .max_routes_per_rank = 0};
}

// The status of `status`, and the message it left.
std::pair<int, std::string> outcome(int status) { return {status, pounce_last_error()}; }

TEST(CApi, BadConfigIsAStatusNamingTheProblem) {
  pounce_config config = small_config();
  config.ranks = 9;
  pounce_moe* layer = reinterpret_cast<pounce_moe*>(1);  // overwritten with NULL on failure
  const auto [status, message] = outcome(pounce_moe_create(&config, nullptr, &layer));
  EXPECT_EQ(status, POUNCE_ERROR);
  EXPECT_THAT(message, HasSubstr("ranks = 9 is not supported"));
  EXPECT_EQ(layer, nullptr);

  config = small_config();
  config.hidden = 100;
  EXPECT_EQ(pounce_moe_create(&config, nullptr, &layer), POUNCE_ERROR);
  EXPECT_THAT(pounce_last_error(), HasSubstr("hidden = 100 is not supported"));
}

TEST(CApi, NullArgumentsAreNamed) {
  pounce_moe* layer = nullptr;
  const pounce_config config = small_config();
  EXPECT_EQ(pounce_moe_create(nullptr, nullptr, &layer), POUNCE_ERROR);
  EXPECT_STREQ(pounce_last_error(), "config is NULL");
  EXPECT_EQ(pounce_moe_create(&config, nullptr, nullptr), POUNCE_ERROR);
  EXPECT_STREQ(pounce_last_error(), "out is NULL");
  EXPECT_EQ(pounce_moe_forward(nullptr, 0, nullptr, 0, nullptr), POUNCE_ERROR);
  EXPECT_STREQ(pounce_last_error(), "layer is NULL");
  EXPECT_EQ(pounce_moe_set_weights(nullptr, 0, nullptr, nullptr), POUNCE_ERROR);
  EXPECT_EQ(pounce_moe_check_device_errors(nullptr), POUNCE_ERROR);
  pounce_moe_info info;
  EXPECT_EQ(pounce_moe_get_info(nullptr, &info), POUNCE_ERROR);
  EXPECT_EQ(pounce_default_options(nullptr), POUNCE_ERROR);
  EXPECT_EQ(pounce_nccl_unique_id(nullptr), POUNCE_ERROR);
  EXPECT_EQ(pounce_moe_destroy(nullptr), POUNCE_OK);  // like free(NULL)
}

// The MXFP8 converters check their arguments before any CUDA call: the error names what is wrong.
TEST(CApi, MxConvertersNameBadArguments) {
  EXPECT_EQ(pounce_bf16_to_mxfp8(nullptr, 2, 48, nullptr, nullptr, nullptr), POUNCE_ERROR);
  EXPECT_THAT(pounce_last_error(), ::testing::HasSubstr("cols = 48 is not a multiple of 32"));
  EXPECT_EQ(pounce_bf16_to_mxfp8(nullptr, 2, 64, nullptr, nullptr, nullptr), POUNCE_ERROR);
  EXPECT_THAT(pounce_last_error(), ::testing::HasSubstr("x is null"));
  EXPECT_EQ(pounce_mxfp8_to_bf16(nullptr, nullptr, 2, 40, nullptr, nullptr), POUNCE_ERROR);
  EXPECT_THAT(pounce_last_error(), ::testing::HasSubstr("not made of whole 1 x 32 blocks"));
  EXPECT_EQ(pounce_mxfp8_to_bf16(nullptr, nullptr, 2, 64, nullptr, nullptr), POUNCE_ERROR);
  EXPECT_THAT(pounce_last_error(), ::testing::HasSubstr("q, scales and out must be set"));
  EXPECT_EQ(pounce_mxfp8_to_bf16(nullptr, nullptr, 0, 64, nullptr, nullptr), POUNCE_OK);  // nothing to do
  EXPECT_EQ(pounce_bf16_to_mxfp8(nullptr, INT64_MAX / 32, 64, nullptr, nullptr, nullptr), POUNCE_ERROR);
  EXPECT_THAT(pounce_last_error(), ::testing::HasSubstr("has more than 2^63 - 1 elements"));
  EXPECT_EQ(pounce_mxfp8_to_bf16(nullptr, nullptr, INT64_MAX / 32, 64, nullptr, nullptr), POUNCE_ERROR);
  EXPECT_THAT(pounce_last_error(), ::testing::HasSubstr("has more than 2^63 - 1 elements"));
}

// On a GPU, host memory handed to the MX converters is named instead of faulting in the kernel.
TEST(CApi, MxConvertersRefuseHostMemory) {
  if (!pounce::gpu_is_hopper()) GTEST_SKIP() << "needs a Hopper GPU";
  alignas(16) static uint16_t host_x[2 * 64];
  void* q = nullptr;
  void* scales = nullptr;
  ASSERT_EQ(cudaMalloc(&q, 2 * 64), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&scales, 2 * 2), cudaSuccess);
  EXPECT_EQ(pounce_bf16_to_mxfp8(host_x, 2, 64, q, scales, nullptr), POUNCE_ERROR);
  EXPECT_THAT(pounce_last_error(), ::testing::HasSubstr("pounce_bf16_to_mxfp8: x at"));
  EXPECT_THAT(pounce_last_error(), ::testing::HasSubstr("device memory of GPU"));
  EXPECT_EQ(pounce_mxfp8_to_bf16(q, scales, 2, 64, host_x, nullptr), POUNCE_ERROR);
  EXPECT_THAT(pounce_last_error(), ::testing::HasSubstr("pounce_mxfp8_to_bf16: out at"));
  ASSERT_EQ(cudaFree(q), cudaSuccess);
  ASSERT_EQ(cudaFree(scales), cudaSuccess);
}

TEST(CApi, DefaultOptionsAreTheLibrarys) {
  pounce_options options;
  ASSERT_EQ(pounce_default_options(&options), POUNCE_OK);
  const pounce::FusedMoeOptions d;
  EXPECT_EQ(options.ctas_per_rank, d.ctas_per_rank);
  EXPECT_EQ(options.comm_ctas, d.comm_ctas);
  EXPECT_EQ(options.engine_rows, d.engine_rows);
  EXPECT_EQ(options.minibatch_rows, d.minibatch_rows);
  EXPECT_EQ(options.ring_blocks, d.ring_blocks);
  EXPECT_EQ(options.ring_bytes, d.ring_bytes);
  EXPECT_EQ(options.wait_timeout_ns, d.wait_timeout_ns);
  EXPECT_EQ(options.backward_replays != 0, d.backward_replays);
  EXPECT_EQ(options.fused_backward != 0, d.fused_backward);
  EXPECT_EQ(options.fp8_data_gradients != 0, d.fp8_data_gradients);
  EXPECT_EQ(options.fp8_weight_gradients != 0, d.fp8_weight_gradients);
  EXPECT_EQ(options.fp8_forward != 0, d.fp8_forward);
  EXPECT_EQ(pounce_abi_version(), POUNCE_C_ABI_VERSION);
}

// Rank and config are checked before NCCL is asked for anything, so no rank waits on a doomed group.
TEST(CApi, NcclLayerChecksRankAndConfigFirst) {
  const char id[POUNCE_NCCL_UNIQUE_ID_BYTES] = {};
  pounce_config config = small_config();
  pounce_moe* layer = nullptr;
  EXPECT_EQ(pounce_moe_create_nccl(&config, nullptr, id, 2, &layer), POUNCE_ERROR);
  EXPECT_THAT(pounce_last_error(), HasSubstr("rank 2 is not a rank of a group of 2"));
  config.topk = 9;
  EXPECT_EQ(pounce_moe_create_nccl(&config, nullptr, id, 0, &layer), POUNCE_ERROR);
  EXPECT_THAT(pounce_last_error(), HasSubstr("topk = 9"));
  EXPECT_EQ(pounce_moe_create_nccl(&config, nullptr, nullptr, 0, &layer), POUNCE_ERROR);
  EXPECT_STREQ(pounce_last_error(), "unique_id is NULL");
}

// A valid config makes a layer on a Hopper GPU; elsewhere it is a status saying why (never a throw).
TEST(CApi, ValidConfigMakesALayerOrSaysWhyNot) {
  const pounce_config config = small_config();
  pounce_moe* layer = nullptr;
  const int status = pounce_moe_create(&config, nullptr, &layer);
  if (!pounce::gpu_is_hopper()) {
    EXPECT_NE(status, POUNCE_OK);
    EXPECT_NE(std::string(pounce_last_error()), "");
    EXPECT_EQ(layer, nullptr);
    return;
  }
  ASSERT_EQ(status, POUNCE_OK) << pounce_last_error();
  pounce_moe_info info;
  ASSERT_EQ(pounce_moe_get_info(layer, &info), POUNCE_OK);
  EXPECT_EQ(info.ranks_on_this_gpu, 2);
  EXPECT_GT(info.device_bytes, 0);
  // Forward before set_weights, and a wrong rank count: named, and the layer stays usable.
  pounce_rank_io ios[2] = {};
  EXPECT_EQ(pounce_moe_forward(layer, 2, ios, 0, nullptr), POUNCE_ERROR);
  EXPECT_THAT(pounce_last_error(), HasSubstr("call set_weights first"));
  const void* w[1] = {nullptr};
  EXPECT_EQ(pounce_moe_set_weights(layer, 1, w, w), POUNCE_ERROR);
  EXPECT_THAT(pounce_last_error(), HasSubstr("got 1 ranks' weights, the layer has 2 ranks"));
  EXPECT_EQ(pounce_moe_check_device_errors(layer), POUNCE_OK);
  EXPECT_EQ(pounce_moe_destroy(layer), POUNCE_OK);
}

// Each thread keeps its own message: another thread's failure does not overwrite this one's.
TEST(CApi, LastErrorIsPerThread) {
  pounce_moe* layer = nullptr;
  ASSERT_EQ(pounce_moe_create(nullptr, nullptr, &layer), POUNCE_ERROR);
  std::string other;
  std::thread([&] {
    other = pounce_last_error();
    pounce_config config = small_config();
    config.experts = 7;
    pounce_moe_create(&config, nullptr, &layer);
  }).join();
  EXPECT_EQ(other, "");
  EXPECT_STREQ(pounce_last_error(), "config is NULL");
}

}  // namespace

#include <algorithm>

#include "common/cuda_check.h"
#include "planner/device_planner.h"
#include "planner/plan_steps.cuh"

namespace pounce::planner {
namespace {

using steps::kChunkTokens;
using steps::kMaxLocalExperts;

__global__ void count_kernel(steps::Routing r, steps::Outputs o, DeviceErrorSink error) {
  __shared__ int32_t counts[kMaxLocalExperts];
  __shared__ int32_t rank_counts[steps::kMaxRanks];
  steps::clear_rows(o, blockIdx.x * int64_t(blockDim.x) + threadIdx.x, int64_t(gridDim.x) * blockDim.x);
  steps::count_chunk(r, blockIdx.x, o, counts, rank_counts, error);
}

__global__ void scan_kernel(steps::Routing r, steps::Outputs o) {
  __shared__ int32_t warp_sums[32];
  steps::scan_expert(r, o, blockIdx.x, warp_sums);
}

__global__ void place_kernel(steps::Routing r, steps::Outputs o, DeviceErrorSink error) {
  __shared__ int32_t offsets[kMaxLocalExperts + 1];
  __shared__ int32_t running[kMaxLocalExperts];
  __shared__ int32_t warp_sums[32];
  // Past the capacity: block 0 reports it and leaves an empty schedule; nobody places a route.
  if (!steps::routes_fit(r, o, error, /*report=*/blockIdx.x == 0 && threadIdx.x == 0)) {
    if (blockIdx.x == 0 && threadIdx.x == 0) steps::publish_empty_schedule(r, o);
    return;
  }
  steps::expert_offsets(r, o, offsets, warp_sums, /*publish=*/blockIdx.x == 0);
  steps::place_chunk(r, blockIdx.x, o, offsets, running);
}

}  // namespace

DevicePlanner::DevicePlanner(const EpConfig& config, int64_t minibatch_rows) : config_(config) {
  capacity_ = row_capacity(config);  // validates the config
  POUNCE_REQUIRE(config.ranks <= kMaxRanks, "device planner: ", config.ranks, " ranks; at most ", kMaxRanks,
                 " are supported");
  POUNCE_REQUIRE(config.local_experts() <= kMaxLocalExperts, "device planner: ", config.local_experts(),
                 " local experts per rank; at most ", kMaxLocalExperts, " are supported");
  POUNCE_REQUIRE(minibatch_rows > 0, "device planner: minibatch_rows = ", minibatch_rows, ", must be positive");
  // A minibatch past every m-block of the capacity is all of them (and fits int32).
  blocks_per_minibatch_ =
      int32_t(std::min((minibatch_rows + kBlockM - 1) / kBlockM, std::max<int64_t>(capacity_.max_m_blocks, 1)));
  chunks_per_rank_ = int32_t(std::max<int64_t>(1, (config.max_tokens_per_rank + kChunkTokens - 1) / kChunkTokens));
  chunk_counts_ = DeviceBuffer<int32_t>(int64_t(config.ranks) * chunks_per_rank_ * config.local_experts());
  expert_routes_ = DeviceBuffer<int32_t>(config.local_experts());
  expert_offsets_ = DeviceBuffer<int32_t>(config.local_experts() + 1);
  row_source_rank_ = DeviceBuffer<int32_t>(capacity_.max_padded_rows);
  row_token_ = DeviceBuffer<int32_t>(capacity_.max_padded_rows);
  row_k_ = DeviceBuffer<int32_t>(capacity_.max_padded_rows);
  minibatch_starts_ = DeviceBuffer<int32_t>(capacity_.max_m_blocks + 2);
  route_row_ = DeviceBuffer<int32_t>(std::max<int64_t>(1, config.ranks * config.max_tokens_per_rank * config.topk));
  route_row_.fill_bytes(0);
  rank_routes_ = DeviceBuffer<int32_t>(capacity_.bounded ? config.ranks : 0);
  sizes_ = DeviceBuffer<DeviceScheduleSizes>(1);
}

int64_t DevicePlanner::device_bytes() const {
  int64_t bytes = int64_t(sizes_.bytes());
  for (const DeviceBuffer<int32_t>* b : {&chunk_counts_, &expert_routes_, &expert_offsets_, &row_source_rank_,
                                         &row_token_, &row_k_, &minibatch_starts_, &route_row_, &rank_routes_})
    bytes += int64_t(b->bytes());
  return bytes;
}

void DevicePlanner::plan(int rank, const int32_t* const* topk_ids, const int32_t* tokens, cudaStream_t stream) {
  POUNCE_REQUIRE(rank >= 0 && rank < config_.ranks, "device planner: rank = ", rank, " is outside [0, ", config_.ranks,
                 ")");
  POUNCE_REQUIRE(topk_ids && tokens, "device planner: topk_ids and tokens must be set");
  const steps::Routing r{topk_ids,
                         tokens,
                         config_.ranks,
                         config_.experts,
                         config_.topk,
                         config_.first_local_expert(rank),
                         config_.local_experts(),
                         chunks_per_rank_,
                         int32_t(config_.max_tokens_per_rank)};
  const steps::Outputs o{chunk_counts_.data(),     expert_routes_.data(), expert_offsets_.data(),
                         row_source_rank_.data(),  row_token_.data(),     row_k_.data(),
                         minibatch_starts_.data(), sizes_.data(),         capacity_.max_padded_rows,
                         blocks_per_minibatch_,    route_row_.data(),     rank_routes_.data(),
                         capacity_.max_routes};
  const int chunks = r.chunks();
  if (capacity_.bounded) CUDA_CHECK(cudaMemsetAsync(rank_routes_.data(), 0, rank_routes_.bytes(), stream));
  count_kernel<<<chunks, kChunkTokens, 0, stream>>>(r, o, errors_.device_sink());
  CUDA_CHECK_LAUNCH();
  scan_kernel<<<config_.local_experts(), 256, 0, stream>>>(r, o);
  CUDA_CHECK_LAUNCH();
  place_kernel<<<chunks, 32, 0, stream>>>(r, o, errors_.device_sink());
  CUDA_CHECK_LAUNCH();
}

}  // namespace pounce::planner

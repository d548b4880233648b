#include "planner/device_planner.h"

#include <algorithm>

#include "common/cuda_check.h"

namespace pounce::planner {
namespace {

constexpr int kChunkTokens = 256;        // tokens per chunk: one CTA counts them, one warp places them
constexpr int kMaxLocalExperts = 1024;   // one scan thread per local expert

struct Routing {
  const int32_t* const* topk_ids;  // [P] device pointers to [tokens, k]
  const int32_t* tokens;           // [P]
  int32_t ranks, experts, topk, first_local, local_experts, chunks_per_rank, max_tokens;
};

// Tokens of rank s the planner reads: its count, clamped to [0, max_tokens] (bad counts are reported).
__device__ int32_t tokens_of(const Routing& r, int32_t s) { return min(max(r.tokens[s], 0), r.max_tokens); }

// Entry j of a token is planned iff its id is in range and no earlier entry of the token has it. The
// count and place kernels both decide with this function, so they always agree.
__device__ bool entry_is_valid(const int32_t* ids, int32_t j, int32_t experts) {
  const int32_t id = ids[j];
  if (id < 0 || id >= experts) return false;
  for (int32_t i = 0; i < j; ++i)
    if (ids[i] == id) return false;
  return true;
}

__global__ void count_kernel(Routing r, int32_t* chunk_counts, int64_t capacity_rows, int32_t* row_source_rank,
                             int32_t* row_token, int32_t* row_k, DeviceErrorRecord* error) {
  __shared__ int32_t counts[kMaxLocalExperts];
  // Every row starts as padding; the place kernel overwrites the routed ones.
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < capacity_rows;
       i += int64_t(gridDim.x) * blockDim.x)
    row_source_rank[i] = row_token[i] = row_k[i] = -1;
  for (int32_t e = threadIdx.x; e < r.local_experts; e += blockDim.x) counts[e] = 0;
  __syncthreads();

  const int32_t s = blockIdx.x / r.chunks_per_rank;
  const int32_t t = (blockIdx.x % r.chunks_per_rank) * kChunkTokens + threadIdx.x;
  if (threadIdx.x == 0 && blockIdx.x % r.chunks_per_rank == 0 && (r.tokens[s] < 0 || r.tokens[s] > r.max_tokens))
    report_device_error(error, DeviceErrorCode::kBadRouting, DeviceRole::kPlanner, WaitTarget::kTokenCount, 0,
                        uint64_t(r.max_tokens), uint64_t(int64_t(r.tokens[s])), 0, s);
  if (t < tokens_of(r, s)) {
    const int32_t* ids = r.topk_ids[s] + int64_t(t) * r.topk;
    for (int32_t j = 0; j < r.topk; ++j) {
      const int32_t id = ids[j];
      if (id < 0 || id >= r.experts) {
        report_device_error(error, DeviceErrorCode::kBadRouting, DeviceRole::kPlanner, WaitTarget::kExpertIdInRange,
                            t, uint64_t(r.experts), uint64_t(uint32_t(id)), 0, s, j);
        continue;
      }
      bool repeated = false;
      for (int32_t i = 0; i < j && !repeated; ++i)
        if (ids[i] == id) {
          report_device_error(error, DeviceErrorCode::kBadRouting, DeviceRole::kPlanner, WaitTarget::kDistinctExperts,
                              t, uint64_t(i), uint64_t(id), 0, s, j);
          repeated = true;
        }
      const int32_t e = id - r.first_local;
      if (!repeated && e >= 0 && e < r.local_experts) atomicAdd(&counts[e], 1);
    }
  }
  __syncthreads();
  for (int32_t e = threadIdx.x; e < r.local_experts; e += blockDim.x)
    chunk_counts[int64_t(blockIdx.x) * r.local_experts + e] = counts[e];
}

// One CTA, thread e = local expert e: turns chunk counts into chunk bases (prefix over chunks, which run
// in (source rank, token) order), and expert totals into padded offsets (prefix over experts).
__global__ void scan_kernel(Routing r, int32_t* chunk_counts, int32_t blocks_per_minibatch, int32_t* expert_routes,
                            int32_t* expert_offsets, int32_t* minibatch_starts, DeviceScheduleSizes* sizes) {
  __shared__ int32_t padded[kMaxLocalExperts];
  __shared__ int32_t routed[kMaxLocalExperts];
  const int32_t e = threadIdx.x;
  const int32_t chunks = r.ranks * r.chunks_per_rank;
  int32_t running = 0;
  if (e < r.local_experts)
    for (int32_t c = 0; c < chunks; ++c) {
      int32_t* slot = &chunk_counts[int64_t(c) * r.local_experts + e];
      const int32_t count = *slot;
      *slot = running;
      running += count;
    }
  routed[e] = e < r.local_experts ? running : 0;
  padded[e] = e < r.local_experts ? (running + kBlockM - 1) / kBlockM * kBlockM : 0;
  __syncthreads();
  // Inclusive scan over experts (Hillis-Steele; at most 1024 entries, once per plan).
  for (int32_t step = 1; step < kMaxLocalExperts; step *= 2) {
    const int32_t add = e >= step ? padded[e - step] : 0, add_routed = e >= step ? routed[e - step] : 0;
    __syncthreads();
    padded[e] += add;
    routed[e] += add_routed;
    __syncthreads();
  }
  if (e < r.local_experts) {
    expert_routes[e] = running;
    expert_offsets[e + 1] = padded[e];
  }
  if (e == 0) expert_offsets[0] = 0;
  const int32_t padded_rows = padded[r.local_experts - 1];
  const int32_t m_blocks = padded_rows / kBlockM;
  const int32_t minibatches = (m_blocks + blocks_per_minibatch - 1) / blocks_per_minibatch;
  for (int32_t i = e; i < minibatches; i += blockDim.x) minibatch_starts[i] = i * blocks_per_minibatch;
  if (e == 0) {
    minibatch_starts[minibatches] = m_blocks;
    *sizes = {routed[r.local_experts - 1], padded_rows, m_blocks, minibatches};
  }
}

// One warp per chunk walks its entries in (token, k) order, 32 at a time. Lanes holding the same local
// expert find each other with match.any; a lane's row is the expert's offset, plus the routes of earlier
// chunks (the chunk base), plus those of earlier steps (running), plus its rank among its peers.
__global__ void place_kernel(Routing r, const int32_t* chunk_bases, const int32_t* expert_offsets,
                             int32_t* row_source_rank, int32_t* row_token, int32_t* row_k) {
  __shared__ int32_t running[kMaxLocalExperts];
  const int32_t lane = threadIdx.x;
  for (int32_t e = lane; e < r.local_experts; e += 32)
    running[e] = expert_offsets[e] + chunk_bases[int64_t(blockIdx.x) * r.local_experts + e];
  __syncwarp();

  const int32_t s = blockIdx.x / r.chunks_per_rank;
  const int32_t first_token = (blockIdx.x % r.chunks_per_rank) * kChunkTokens;
  const int32_t chunk_tokens = min(kChunkTokens, tokens_of(r, s) - first_token);
  const int32_t entries = max(chunk_tokens, 0) * r.topk;
  const uint32_t lower_lanes = (1u << lane) - 1;
  for (int32_t step = 0; step < entries; step += 32) {
    const int32_t i = step + lane;
    int32_t e = -1, t = 0, j = 0;
    if (i < entries) {
      t = first_token + i / r.topk;
      j = i % r.topk;
      const int32_t* ids = r.topk_ids[s] + int64_t(t) * r.topk;
      if (entry_is_valid(ids, j, r.experts) && ids[j] - r.first_local >= 0 && ids[j] - r.first_local < r.local_experts)
        e = ids[j] - r.first_local;
    }
    const uint32_t peers = __match_any_sync(0xFFFFFFFFu, e);
    if (e >= 0) {
      const int32_t row = running[e] + __popc(peers & lower_lanes);
      row_source_rank[row] = s;
      row_token[row] = t;
      row_k[row] = j;
    }
    __syncwarp();  // every peer has read running[e] before the last of them advances it
    if (e >= 0 && lane == 31 - __clz(peers)) running[e] += __popc(peers);
    __syncwarp();
  }
}

}  // namespace

DevicePlanner::DevicePlanner(const EpConfig& config, int64_t minibatch_rows) : config_(config) {
  capacity_ = worst_case_capacity(config);  // validates the config
  POUNCE_REQUIRE(config.local_experts() <= kMaxLocalExperts, "device planner: ", config.local_experts(),
                 " local experts per rank; at most ", kMaxLocalExperts, " are supported");
  POUNCE_REQUIRE(minibatch_rows > 0, "device planner: minibatch_rows = ", minibatch_rows, ", must be positive");
  blocks_per_minibatch_ = int32_t((minibatch_rows + kBlockM - 1) / kBlockM);
  chunks_per_rank_ = int32_t(std::max<int64_t>(1, (config.max_tokens_per_rank + kChunkTokens - 1) / kChunkTokens));
  chunk_counts_ = DeviceBuffer<int32_t>(int64_t(config.ranks) * chunks_per_rank_ * config.local_experts());
  expert_routes_ = DeviceBuffer<int32_t>(config.local_experts());
  expert_offsets_ = DeviceBuffer<int32_t>(config.local_experts() + 1);
  row_source_rank_ = DeviceBuffer<int32_t>(capacity_.max_padded_rows);
  row_token_ = DeviceBuffer<int32_t>(capacity_.max_padded_rows);
  row_k_ = DeviceBuffer<int32_t>(capacity_.max_padded_rows);
  minibatch_starts_ = DeviceBuffer<int32_t>(capacity_.max_m_blocks + 2);
  sizes_ = DeviceBuffer<DeviceScheduleSizes>(1);
}

void DevicePlanner::plan(int rank, const int32_t* const* topk_ids, const int32_t* tokens, cudaStream_t stream) {
  POUNCE_REQUIRE(rank >= 0 && rank < config_.ranks, "device planner: rank = ", rank, " is outside [0, ",
                 config_.ranks, ")");
  POUNCE_REQUIRE(topk_ids && tokens, "device planner: topk_ids and tokens must be set");
  const Routing r{topk_ids,
                  tokens,
                  config_.ranks,
                  config_.experts,
                  config_.topk,
                  config_.first_local_expert(rank),
                  config_.local_experts(),
                  chunks_per_rank_,
                  int32_t(config_.max_tokens_per_rank)};
  const int chunks = config_.ranks * chunks_per_rank_;
  count_kernel<<<chunks, kChunkTokens, 0, stream>>>(r, chunk_counts_.data(), capacity_.max_padded_rows,
                                                    row_source_rank_.data(), row_token_.data(), row_k_.data(),
                                                    errors_.device_record());
  CUDA_CHECK_LAUNCH();
  scan_kernel<<<1, kMaxLocalExperts, 0, stream>>>(r, chunk_counts_.data(), blocks_per_minibatch_,
                                                  expert_routes_.data(), expert_offsets_.data(),
                                                  minibatch_starts_.data(), sizes_.data());
  CUDA_CHECK_LAUNCH();
  place_kernel<<<chunks, 32, 0, stream>>>(r, chunk_counts_.data(), expert_offsets_.data(), row_source_rank_.data(),
                                          row_token_.data(), row_k_.data());
  CUDA_CHECK_LAUNCH();
}

}  // namespace pounce::planner

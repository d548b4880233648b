// The device planner's steps as CTA- and warp-level functions, so that one code path serves both the
// stand-alone planner kernels (planner/device_planner.cu) and the fused MoE kernel's planning phase.
// The schedule they build is planner::build_schedule's, bit for bit (see device_planner.h).
//
//   count:  per chunk of kChunkTokens tokens (CTA-level): routes per local expert, and per rank (every
//           rank's, so that each rank sees a routing past any rank's capacity); reports bad ids.
//   fit:    every rank's routes within the capacity? If not, reported, and the schedule is empty.
//   scan:   per local expert (CTA-level): its chunk counts become chunk bases, their sum its total.
//   place:  every placing CTA first turns the expert totals into padded expert offsets in shared memory
//           (expert_offsets; one CTA also writes them out), then per chunk (warp-level) the chunk's
//           routes go to their rows in (source rank, token, k) order.
// count must finish on every chunk before fit and scan, and scan before place: callers put a grid-wide
// (or rank-wide) barrier between them.
#pragma once

#include <cstdint>

#include "common/device_error.h"
#include "planner/device_planner.h"

namespace pounce::planner::steps {

constexpr int kChunkTokens = kPlannerChunkTokens;
constexpr int kMaxLocalExperts = kPlannerMaxLocalExperts;  // bounds the shared-memory tables below
constexpr int kMaxRanks = pounce::kMaxRanks;

struct Routing {
  const int32_t* const* topk_ids;  // [P] device pointers to [tokens, k]
  const int32_t* tokens;           // [P]
  int32_t ranks, experts, topk, first_local, local_experts, chunks_per_rank, max_tokens;
  __host__ __device__ int32_t chunks() const { return ranks * chunks_per_rank; }
};

struct Outputs {
  int32_t* chunk_counts;  // [chunks, E_local]: counts, then bases
  int32_t* expert_routes;
  int32_t* expert_offsets;
  int32_t* row_source_rank;
  int32_t* row_token;
  int32_t* row_k;
  int32_t* minibatch_starts;
  DeviceScheduleSizes* sizes;
  int64_t capacity_rows;
  int32_t blocks_per_minibatch;
  int32_t* route_row;    // optional [P, max_tokens, k]: the row each placed route went to
  int32_t* rank_routes;  // [P]: routes to each rank, zeroed before count; null: an unbounded capacity
  int64_t max_routes;    // routes one rank may receive (the capacity's)
};

// Tokens of rank s the planner reads: its count, clamped to [0, max_tokens] (bad counts are reported).
__device__ inline int32_t tokens_of(const Routing& r, int32_t s) { return min(max(r.tokens[s], 0), r.max_tokens); }

// Every row starts as padding; place overwrites the routed ones. `worker` of `workers` threads.
__device__ inline void clear_rows(const Outputs& o, int64_t worker, int64_t workers) {
  for (int64_t i = worker; i < o.capacity_rows; i += workers) o.row_source_rank[i] = o.row_token[i] = o.row_k[i] = -1;
}

// CTA-level (all threads call it). counts: shared [kMaxLocalExperts], rank_counts: shared [kMaxRanks]
// (used only with o.rank_routes: a capacity of every route needs no per-rank count).
// Entry j of a token is counted iff its id is in range and no earlier entry of the token has it;
// place_chunk applies the same rule, so the two steps always agree.
__device__ inline void count_chunk(const Routing& r, int32_t chunk, const Outputs& o, int32_t* counts,
                                   int32_t* rank_counts, const DeviceErrorSink& error) {
  for (int32_t e = threadIdx.x; e < r.local_experts; e += blockDim.x) counts[e] = 0;
  for (int32_t q = threadIdx.x; q < r.ranks; q += blockDim.x) rank_counts[q] = 0;
  __syncthreads();
  const int32_t s = chunk / r.chunks_per_rank;
  const int32_t first_token = (chunk % r.chunks_per_rank) * kChunkTokens;
  if (threadIdx.x == 0 && chunk % r.chunks_per_rank == 0 && (r.tokens[s] < 0 || r.tokens[s] > r.max_tokens))
    report_device_error(error, DeviceErrorCode::kBadRouting, DeviceRole::kPlanner, WaitTarget::kTokenCount, 0,
                        uint64_t(r.max_tokens), uint64_t(int64_t(r.tokens[s])), 0, s);
  const int32_t end = min(first_token + kChunkTokens, tokens_of(r, s));
  for (int32_t t = first_token + threadIdx.x; t < end; t += blockDim.x) {
    const int32_t* ids = r.topk_ids[s] + int64_t(t) * r.topk;
    for (int32_t j = 0; j < r.topk; ++j) {
      const int32_t id = ids[j];
      if (id < 0 || id >= r.experts) {
        report_device_error(error, DeviceErrorCode::kBadRouting, DeviceRole::kPlanner, WaitTarget::kExpertIdInRange, t,
                            uint64_t(r.experts), uint64_t(uint32_t(id)), 0, s, j);
        continue;
      }
      bool repeated = false;
      for (int32_t i = 0; i < j && !repeated; ++i)
        if (ids[i] == id) {
          report_device_error(error, DeviceErrorCode::kBadRouting, DeviceRole::kPlanner, WaitTarget::kDistinctExperts,
                              t, uint64_t(i), uint64_t(id), 0, s, j);
          repeated = true;
        }
      if (repeated) continue;
      const int32_t e = id - r.first_local;
      if (e >= 0 && e < r.local_experts) atomicAdd(&counts[e], 1);
      if (o.rank_routes != nullptr) atomicAdd(&rank_counts[id / r.local_experts], 1);
    }
  }
  __syncthreads();
  for (int32_t e = threadIdx.x; e < r.local_experts; e += blockDim.x)
    o.chunk_counts[int64_t(chunk) * r.local_experts + e] = counts[e];
  if (o.rank_routes != nullptr) {
    for (int32_t q = threadIdx.x; q < r.ranks; q += blockDim.x)
      if (rank_counts[q] > 0) atomicAdd(&o.rank_routes[q], rank_counts[q]);
  }
}

// After every chunk's count: whether every rank's routes fit the capacity. Every rank counted every
// rank's routes from the same topk_ids, so all of them agree and stop together, before any data moves.
// With `report`, a routing past the capacity is reported (naming the first rank over it). Any thread.
__device__ inline bool routes_fit(const Routing& r, const Outputs& o, const DeviceErrorSink& error, bool report) {
  if (o.rank_routes == nullptr) return true;  // unbounded: no routing exceeds it
  for (int32_t q = 0; q < r.ranks; ++q) {
    const int32_t routes = *reinterpret_cast<volatile const int32_t*>(&o.rank_routes[q]);
    if (routes > o.max_routes) {
      if (report)
        report_device_error(error, DeviceErrorCode::kBadRouting, DeviceRole::kPlanner, WaitTarget::kRouteCapacity, q,
                            uint64_t(o.max_routes), uint64_t(routes), 0, q);
      return false;
    }
  }
  return true;
}

// The schedule of a routing past the capacity: no rows, so whatever reads it does nothing. One thread.
__device__ inline void publish_empty_schedule(const Routing& r, const Outputs& o) {
  for (int32_t e = 0; e < r.local_experts; ++e) o.expert_routes[e] = 0;
  for (int32_t e = 0; e <= r.local_experts; ++e) o.expert_offsets[e] = 0;
  o.minibatch_starts[0] = 0;
  *o.sizes = {0, 0, 0, 0};
}

// CTA-level exclusive prefix sum of one value per thread, in thread order; *total gets the CTA's sum.
// Every thread of the CTA calls it, and blockDim.x is a multiple of 32 (full-warp shuffles). warp_sums:
// shared [32]. Safe to call back to back with the same warp_sums.
__device__ inline int32_t cta_exclusive_sum(int32_t value, int32_t* warp_sums, int32_t* total) {
  const int32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = (blockDim.x + 31) / 32;
  int32_t inclusive = value;
  for (int32_t step = 1; step < 32; step *= 2) {
    const int32_t below = __shfl_up_sync(0xFFFFFFFFu, inclusive, step);
    if (lane >= step) inclusive += below;
  }
  __syncthreads();  // the previous call's readers are done with warp_sums
  if (lane == 31) warp_sums[warp] = inclusive;
  __syncthreads();
  int32_t before = 0, sum = 0;
  for (int32_t w = 0; w < warps; ++w) {  // at most 32 shared reads, broadcast
    const int32_t ws = warp_sums[w];
    before += w < warp ? ws : 0;
    sum += ws;
  }
  *total = sum;
  return before + inclusive - value;
}

// CTA-level, for local expert e (the CTAs split the experts): its chunk counts become chunk bases, the
// routes to e in earlier chunks (chunks run in (source rank, token) order), and expert_routes[e] their
// total. One load per thread per blockDim chunks, so the scan costs a few memory round trips instead of
// one per chunk. warp_sums: shared [32].
__device__ inline void scan_expert(const Routing& r, const Outputs& o, int32_t e, int32_t* warp_sums) {
  const int32_t chunks = r.chunks();
  int32_t carry = 0;
  for (int32_t c0 = 0; c0 < chunks; c0 += blockDim.x) {
    const int32_t c = c0 + threadIdx.x;
    int32_t* count = o.chunk_counts + int64_t(c) * r.local_experts + e;
    int32_t total;
    const int32_t before = cta_exclusive_sum(c < chunks ? *count : 0, warp_sums, &total);
    if (c < chunks) *count = carry + before;
    carry += total;
  }
  if (threadIdx.x == 0) o.expert_routes[e] = carry;
}

// CTA-level, after every expert's scan: the padded expert offsets [local_experts + 1] into shared
// `offsets` (place_chunk reads them there), from the expert totals. The CTA with `publish` also writes
// them out with the schedule's sizes and minibatch starts. offsets: shared [kMaxLocalExperts + 1];
// warp_sums: shared [32].
__device__ inline void expert_offsets(const Routing& r, const Outputs& o, int32_t* offsets, int32_t* warp_sums,
                                      bool publish) {
  int32_t padded_carry = 0, routed_carry = 0;
  for (int32_t e0 = 0; e0 < r.local_experts; e0 += blockDim.x) {
    const int32_t e = e0 + threadIdx.x;
    const int32_t routed = e < r.local_experts ? o.expert_routes[e] : 0;
    int32_t padded_total, routed_total = 0;
    const int32_t before = cta_exclusive_sum((routed + kBlockM - 1) / kBlockM * kBlockM, warp_sums, &padded_total);
    if (publish) cta_exclusive_sum(routed, warp_sums, &routed_total);  // the routes' total: sizes only
    if (e < r.local_experts) offsets[e] = padded_carry + before;
    padded_carry += padded_total;
    routed_carry += routed_total;
  }
  if (threadIdx.x == 0) offsets[r.local_experts] = padded_carry;
  __syncthreads();
  if (!publish) return;
  const int32_t m_blocks = padded_carry / kBlockM;
  const int32_t minibatches = (m_blocks + o.blocks_per_minibatch - 1) / o.blocks_per_minibatch;
  for (int32_t e = threadIdx.x; e <= r.local_experts; e += blockDim.x) o.expert_offsets[e] = offsets[e];
  for (int32_t i = threadIdx.x; i <= minibatches; i += blockDim.x)
    o.minibatch_starts[i] = i < minibatches ? i * o.blocks_per_minibatch : m_blocks;
  if (threadIdx.x == 0) *o.sizes = {routed_carry, padded_carry, m_blocks, minibatches};
}

// Warp-level: one warp walks the chunk's entries in (token, k) order, 32 at a time. Lanes holding the
// same local expert find each other with match.any; a lane's row is the expert's offset, plus the
// routes of earlier chunks (the chunk base), plus those of earlier steps (running), plus its rank among
// its peers. offsets: expert_offsets' shared copy; running: shared [kMaxLocalExperts], private to this warp.
__device__ inline void place_chunk(const Routing& r, int32_t chunk, const Outputs& o, const int32_t* offsets,
                                   int32_t* running) {
  const int32_t lane = threadIdx.x % 32;
  for (int32_t e = lane; e < r.local_experts; e += 32)
    running[e] = offsets[e] + o.chunk_counts[int64_t(chunk) * r.local_experts + e];
  __syncwarp();

  const int32_t s = chunk / r.chunks_per_rank;
  const int32_t first_token = (chunk % r.chunks_per_rank) * kChunkTokens;
  const int32_t chunk_tokens = min(kChunkTokens, tokens_of(r, s) - first_token);
  const int32_t entries = max(chunk_tokens, 0) * r.topk;
  const uint32_t lower_lanes = (1u << lane) - 1;
  // Formed only for a chunk with entries: a rank without tokens may have no topk_ids at all.
  const int32_t* chunk_ids = entries > 0 ? r.topk_ids[s] + int64_t(first_token) * r.topk : nullptr;
  // A step's ids are loaded one step ahead, and the token's earlier entries come from the neighbouring
  // lanes (this step's, or the previous step's ids): the steps are serialized by the shared running
  // counts, and memory round trips inside each step cost ~6 us of planning on the V3 slice.
  int32_t id = lane < entries ? chunk_ids[lane] : -1;
  int32_t previous_id = -1;  // this lane's id of the previous step: entry i - 32
  for (int32_t step = 0; step < entries; step += 32) {
    const int32_t i = step + lane;
    const int32_t next_id = i + 32 < entries ? chunk_ids[i + 32] : -1;
    const int32_t t = first_token + i / r.topk, j = i % r.topk;
    // Planned iff in range and no earlier entry of the token (entries i - j .. i - 1) has the same id:
    // count_chunk's rule.
    bool planned = i < entries && id >= 0 && id < r.experts;
    for (int32_t d = 1; d < min(r.topk, 32); ++d) {  // warp-uniform: every lane shuffles
      const int32_t this_step = __shfl_up_sync(0xFFFFFFFFu, id, d);
      const int32_t last_step = __shfl_sync(0xFFFFFFFFu, previous_id, (lane - d) & 31);
      if (d <= j && (lane >= d ? this_step : last_step) == id) planned = false;
    }
    for (int32_t d = 32; d <= j && planned; ++d)  // top-k past 32: the entries further back, from memory
      if (chunk_ids[i - d] == id) planned = false;
    const int32_t e =
        planned && id - r.first_local >= 0 && id - r.first_local < r.local_experts ? id - r.first_local : -1;
    const uint32_t peers = __match_any_sync(0xFFFFFFFFu, e);
    if (e >= 0) {
      const int32_t row = running[e] + __popc(peers & lower_lanes);
      o.row_source_rank[row] = s;
      o.row_token[row] = t;
      o.row_k[row] = j;
      if (o.route_row != nullptr) o.route_row[(int64_t(s) * r.max_tokens + t) * r.topk + j] = row;
    }
    __syncwarp();  // every peer has read running[e] before the last of them advances it
    if (e >= 0 && lane == 31 - __clz(peers)) running[e] += __popc(peers);
    __syncwarp();
    previous_id = id;
    id = next_id;
  }
}

}  // namespace pounce::planner::steps

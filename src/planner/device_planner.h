// The routing planner on the GPU: the same schedule as planner::build_schedule (bit for bit), built
// from every rank's topk_ids in device memory with no host round trip, into buffers sized once from the
// config's capacity. The megakernel's first phase; tested against the host planner.
//
// Three launches: count routes per (chunk of 64 tokens, local expert) and per rank, and validate the
// ids; one CTA per local expert scans its counts into per-chunk bases and a total; then each chunk checks
// every rank's routes against the capacity, derives the padded expert offsets (block 0 also writes them
// out) and places its routes, in (source rank, token, k) order within each expert, with warp matching.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/device_buffer.h"
#include "common/device_error.h"
#include "planner/schedule.h"

namespace pounce::planner {

// Tokens per planner chunk: one warp places a chunk's routes in order, so smaller chunks mean more warps
// in parallel (64: 128 warps for 8192 tokens).
inline constexpr int kPlannerChunkTokens = 64;
inline constexpr int kPlannerMaxLocalExperts = kMaxLocalExperts;  // bounds its shared-memory tables

// Sizes of the schedule the last plan() produced, in device memory (read them there, or copy back).
struct DeviceScheduleSizes {
  int32_t routes;
  int32_t padded_rows;
  int32_t m_blocks;
  int32_t minibatches;
};

class DevicePlanner {
 public:
  // Sizes every buffer for the config's capacity (planner::row_capacity). Throws pounce::Error on an invalid config or
  // minibatch_rows <= 0.
  DevicePlanner(const EpConfig& config, int64_t minibatch_rows);

  // Plans `rank`'s schedule. topk_ids: device array of P device pointers, rank s's ids [tokens[s], k]
  // (on one GPU the ranks' own buffers; across GPUs peer pointers). tokens: device [P]. No host sync.
  // Invalid ids (out of range, repeated within a token) are reported through check_device_errors() and
  // left out of the schedule. A routing that sends any rank more routes than the capacity is reported
  // and leaves an empty schedule.
  void plan(int rank, const int32_t* const* topk_ids, const int32_t* tokens, cudaStream_t stream);
  // After the stream has synchronized: throws pounce::Error describing bad routing input.
  void check_device_errors() { errors_.check(); }

  // Outputs, laid out as RankSchedule's (row arrays hold -1 for padding and past the padded rows).
  const int32_t* expert_routes() const { return expert_routes_.data(); }      // [E_local]
  const int32_t* expert_offsets() const { return expert_offsets_.data(); }    // [E_local + 1]
  const int32_t* row_source_rank() const { return row_source_rank_.data(); }  // [capacity rows]
  const int32_t* row_token() const { return row_token_.data(); }
  const int32_t* row_k() const { return row_k_.data(); }
  const int32_t* minibatch_starts() const { return minibatch_starts_.data(); }  // [minibatches + 1]
  // [P, max_tokens, k]: the row of route (s, t, j) when it came to this rank. Other entries are stale
  // rows of earlier plans or 0, always rows inside the capacity: a reader never leaves the row buffer,
  // even for routes a bad id left out.
  const int32_t* route_row() const { return route_row_.data(); }
  const DeviceScheduleSizes* sizes() const { return sizes_.data(); }
  const Capacity& capacity() const { return capacity_; }
  // Bytes of its device buffers (all sized at construction).
  int64_t device_bytes() const;

 private:
  EpConfig config_;
  Capacity capacity_;
  int32_t blocks_per_minibatch_ = 0;
  int32_t chunks_per_rank_ = 0;
  DeviceBuffer<int32_t> chunk_counts_;  // [P * chunks_per_rank, E_local]: counts, then bases
  DeviceBuffer<int32_t> expert_routes_, expert_offsets_, row_source_rank_, row_token_, row_k_, minibatch_starts_,
      route_row_;
  DeviceBuffer<int32_t> rank_routes_;  // [P]: routes to each rank, for a bounded capacity's check
  DeviceBuffer<DeviceScheduleSizes> sizes_;
  DeviceErrorSlot errors_;
};

}  // namespace pounce::planner

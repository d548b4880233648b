// Dispatch-only probe (docs/dispatch_probe.md): how long after a synchronized start the first expert tile of each rank
// could begin, when rows move by PULL (the fused kernel's way) or by PUSH. Not a production path: it
// moves the first R m-blocks of every rank's schedule into that rank's ring with the fused layer's row
// mover (moe/row_mover.cuh: 384-thread CTAs, the bulk-copy engine beside the warps' 16-byte copies) and
// nothing else — no planning, GEMMs or combine.
//
//   pull: rank d's communication CTAs take d's m-blocks b = 0, 1, ... from a ticket, copy their rows from
//         the source ranks' x, then release ready[b] += 1 (GPU scope, as the fused kernel's dispatched[b]).
//   push: rank s's communication CTAs take items (d, b) = the rows of d's m-block b whose source is s,
//         ordered by b then d (every destination's m-block 0 first), write them into d's ring, fence, then
//         add the rows written to d's ready[b] (relaxed red after the fence, as the fused combine signals
//         its arrivals); m-block b is ready when all of its routed rows have arrived.
//
// Timing: all ranks meet at a start barrier (flags in every rank's symmetric memory); each rank's "tile
// gate" CTA reads %globaltimer after it (t0), waits for ready m-block 0 (t_first) and then for the rest
// (t_all). Counters are cleared by memset before every run.
//
// Transports as in the fused layer: virtual ranks (every rank's buffers on this GPU, one launch) or NCCL
// (one rank per GPU, symmetric buffers in a comm::NcclWindow). The schedules come from the host planner
// (moe/dispatch_work.h): every rank's routing is given to every rank's probe (one process drives all ranks).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "comm/nccl_window.h"
#include "common/device_buffer.h"
#include "common/device_error.h"
#include "dispatch_probe/dispatch_work.h"
#include "planner/schedule.h"

namespace pounce::moe {

struct DispatchProbeOptions {
  int comm_ctas = 12;       // row-moving CTAs per rank (plus one tile-gate CTA per rank)
  int engine_rows = -1;     // rows of each item the bulk-copy engine moves, the CTA's warps the rest;
                            // -1: the fused layer's default for the row length (balanced_engine_rows)
  int64_t ring_blocks = 0;  // m-blocks moved per rank (ring size); 0: all m-blocks of the largest schedule
  uint64_t wait_timeout_ns = 5'000'000'000ull;  // per wait
  int stall_rank = -1;                          // fault injection (tests): this rank's communication CTAs move nothing
};

// One rank's result of one run.
struct DispatchRankTimes {
  int rank = 0;
  int64_t blocks = 0;       // m-blocks moved into this rank's ring: min(ring blocks, its schedule's)
  int64_t rows = 0;         // routed rows in them (padding rows are not moved)
  int64_t remote_rows = 0;  // of those, rows whose source is another rank
  int64_t bytes = 0;        // rows * hidden * 2
  double first_us = 0;      // start barrier passed -> m-block 0 ready (0 when blocks == 0)
  double all_us = 0;        // start barrier passed -> every moved m-block ready
};

struct DispatchRun {
  std::vector<DispatchRankTimes> ranks;  // the ranks on this GPU
  double launch_ms = 0;                  // CUDA events around the kernel launch
};

// Every rank's symmetric buffers, indexed by global rank (what the kernel sees of the transport).
struct DispatchPeers {
  static constexpr int kMaxRanks = comm::PeerTable::kMaxRanks;
  __nv_bfloat16* x[kMaxRanks];       // [T_max, H]
  __nv_bfloat16* ring[kMaxRanks];    // [R * 128, H]
  uint32_t* ready[kMaxRanks];        // [R] per m-block: pull +1, push + rows
  uint32_t* start_flags[kMaxRanks];  // [P] the run number each rank has started
};

class DispatchProbe {
 public:
  // topk_ids[r]: rank r's [tokens_r, k] routing (tokens_r <= config.max_tokens_per_rank), for every rank.
  // Virtual ranks: all config.ranks ranks on the current GPU.
  DispatchProbe(const EpConfig& config, std::span<const std::vector<int32_t>> topk_ids,
                const DispatchProbeOptions& options = {});
  // This GPU's rank of `comm`. Collective: every rank builds its probe with the same config, routing and
  // options (not checked: the window sizes follow from them).
  DispatchProbe(const EpConfig& config, std::span<const std::vector<int32_t>> topk_ids, ncclComm_t comm,
                const DispatchProbeOptions& options = {});
  ~DispatchProbe();

  // Rank `rank`'s tokens [tokens_r, H] (this GPU's ranks only): the caller fills them before run(), and
  // leaves them alone while any rank may still be running (pull reads them from other GPUs).
  __nv_bfloat16* x(int rank) const;
  // Rank `rank`'s ring, ring_blocks() * 128 rows of H (this GPU's ranks only).
  __nv_bfloat16* ring(int rank) const;
  const EpConfig& config() const { return config_; }
  int64_t ring_blocks() const { return ring_blocks_; }
  int comm_ctas() const { return options_.comm_ctas; }
  int engine_rows() const { return engine_rows_; }  // resolved: -1 replaced by the default

  // One run of every rank on this GPU: clears the counters, launches, synchronizes `stream`, and throws
  // pounce::Error on a device error (a wait that gave up names rank, role, counter, expected and observed
  // values). After an error the probe refuses further runs: build a new one (on every rank).
  DispatchRun run(DispatchMode mode, cudaStream_t stream);

 private:
  // RankDispatchPlan of one rank on this GPU, on the device.
  struct RankWork {
    DeviceBuffer<DispatchItem> items[2];  // [DispatchMode]
    DeviceBuffer<DispatchRow> rows[2];
    DeviceBuffer<uint32_t> block_rows;  // push's ready targets
    DispatchRankTimes stats;            // rank, blocks, rows, remote_rows, bytes
  };
  void setup(std::span<const std::vector<int32_t>> topk_ids, int launch_ranks, int first_rank);
  int launch_rank(int rank) const;

  EpConfig config_;
  DispatchProbeOptions options_;
  int first_rank_ = 0, device_ = -1, engine_rows_ = 0;
  int64_t ring_blocks_ = 0;
  uint32_t epoch_ = 0;
  bool failed_ = false;
  std::vector<RankWork> work_;  // [launch ranks]
  DeviceErrorSlot errors_;
  DeviceBuffer<uint32_t> tickets_;  // [launch ranks]
  DeviceBuffer<uint64_t> times_;    // [launch ranks][3]: t0, t_first, t_all
  // Virtual ranks keep every rank's symmetric buffers here, a slice per rank; NCCL in the window.
  DeviceBuffer<__nv_bfloat16> x_, ring_;
  DeviceBuffer<uint32_t> words_;  // ready, start flags
  std::unique_ptr<comm::NcclWindow> window_;
  DispatchPeers peers_{};
  bool peers_on_this_gpu_ = true;
  cudaEvent_t launch_events_[2] = {};  // around the launch
};

}  // namespace pounce::moe

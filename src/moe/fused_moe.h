// The fused MoE layer, forward: one persistent kernel per forward runs the routing planner, pull-based
// dispatch into a fixed ring of token rows, GEMM1 + SwiGLU and GEMM2 on the compute SMs gated by
// per-m-block counters, push-based combine into each source rank's [token, k] slots and the weighted
// sum, for an expert-parallel group of P ranks (docs/design.md §3, §4).
//
// Two transports, one kernel:
//   virtual ranks: all P ranks on ONE GPU, one launch whose CTAs are partitioned by rank, each rank with
//                  its own schedule, ring and counters, talking through the same protocol and peer
//                  pointers a multi-GPU group uses. P = 1 is the plain single-GPU layer.
//   NCCL:          one rank per GPU (one process per GPU, or one process driving several), peers
//                  reached through an NCCL 2.28 symmetric window's LSA (NVLink load/store) pointers.
//
// Weights: w13 [E, 2I, H] (gate and up interleaved in groups of 8 rows, reference::w13_row), w2
// [E, H, I], bf16, all experts; rank r uses experts [r E/P, (r+1) E/P).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "comm/nccl_window.h"
#include "common/device_buffer.h"
#include "common/device_error.h"
#include "moe/fused_kernel.h"
#include "planner/schedule.h"

namespace pounce::moe {

struct FusedMoeOptions {
  int ctas_per_rank = 0;         // 0: the GPU's SMs / P
  int comm_ctas = 0;             // communication CTAs per rank; 0: from the shape (in place ~380 / H per
                                 // CTA, else ~190 / I per GEMM CTA)
  int engine_rows = -1;          // rows of each 128-row comm item the bulk-copy engine moves, the CTA's
                                 // warps the rest (moe/row_mover.cuh); -1: balanced for the row length
  int64_t minibatch_rows = 0;    // 0: the wave model's, two waves of GEMM1 tiles over the compute CTAs
  int64_t ring_blocks = 0;       // ring m-blocks per rank; 0: as ring_bytes allows
  int64_t ring_bytes = 0;        // per rank, for the default ring (x, h and out rows); 0: one rank: every
                                 // m-block (then in place, nothing combined), more ranks: 1 GiB. At one
                                 // rank a set budget still runs in place when every m-block fits in it
                                 // plus the combine slots (T * k rows) a bounded ring would need.
  uint64_t wait_timeout_ns = 5'000'000'000ull;  // per wait
  int stall_rank = -1;           // fault injection (tests): this rank's communication CTAs do nothing
};

// Rows of each 128-row comm item that the bulk-copy engine moves beside the CTA's warps
// (moe/row_mover.cuh), balanced for rows of `row_bytes`: the default of FusedMoeOptions::engine_rows.
int balanced_engine_rows(int64_t row_bytes);

// One rank's tensors for a forward, device pointers on this GPU.
struct RankIO {
  const __nv_bfloat16* x = nullptr;    // [tokens, H]
  const int32_t* topk_ids = nullptr;   // [tokens, k], global expert ids
  const float* topk_weights = nullptr; // [tokens, k]
  int64_t tokens = 0;                  // <= max_tokens_per_rank
  __nv_bfloat16* y = nullptr;          // [tokens, H]
};

class FusedMoe {
 public:
  // Virtual ranks: all config.ranks ranks on the current GPU. Throws pounce::Error on an invalid config
  // or options, naming the first problem.
  FusedMoe(const planner::EpConfig& config, const FusedMoeOptions& options = {});
  // This GPU's rank of `comm` (config.ranks ranks, one per GPU). Collective: every rank constructs its
  // layer with the same config and options (checked: a mismatch throws, naming the field and rank).
  FusedMoe(const planner::EpConfig& config, ncclComm_t comm, const FusedMoeOptions& options = {});
  ~FusedMoe();

  void set_weights(const __nv_bfloat16* w13, const __nv_bfloat16* w2);

  // Enqueues one forward of every rank on this GPU (all P virtual ranks, or the one NCCL rank) on
  // `stream`: one launch, no host synchronization (the NCCL layer first copies x and topk_ids into its
  // window). Throws on host-visible bad input (rank count, token counts, null pointers); bad routing ids
  // are found on the device and reported by check_device_errors(), with y left untouched.
  void forward(std::span<const RankIO> ranks, cudaStream_t stream);

  // After the stream has synchronized: throws pounce::Error describing a device-side failure (bad
  // routing, or a wait that gave up: which rank, role, counter, expected and observed values). On one
  // GPU it resets the layer's counters so the next forward starts clean; a layer spanning GPUs refuses
  // further forwards and must be rebuilt on every rank. forward() refuses to run while an error is
  // pending.
  void check_device_errors();

  const planner::EpConfig& config() const { return config_; }
  int ctas_per_rank() const { return params_.ctas_per_rank; }
  int comm_ctas() const { return params_.comm_ctas; }
  int engine_rows() const { return params_.engine_rows; }
  int64_t minibatch_rows() const { return int64_t(params_.blocks_per_minibatch) * planner::kBlockM; }
  int64_t ring_blocks() const { return params_.ring_blocks; }
  // One rank whose ring holds every m-block: GEMM2's rows are summed where they are, no combine step.
  bool in_place() const { return params_.in_place != 0; }
  int64_t max_m_blocks() const { return capacity_.max_m_blocks; }

 private:
  void setup(const planner::EpConfig& config, const FusedMoeOptions& options, int launch_ranks, int first_rank);
  static void check_same_config_on_every_rank(const planner::EpConfig& config, const FusedMoeOptions& options,
                                              ncclComm_t comm);
  void reset_counters();

  planner::EpConfig config_;
  planner::Capacity capacity_;
  FusedParams params_{};
  FusedMaps maps_{};
  bool has_weights_ = false;
  DeviceErrorSlot errors_;
  // This launch's ranks' private buffers, a slice per rank.
  DeviceBuffer<int32_t> chunk_counts_, expert_routes_, expert_offsets_, row_source_rank_, row_token_, row_k_,
      minibatch_starts_;
  DeviceBuffer<planner::DeviceScheduleSizes> sizes_;
  DeviceBuffer<const int32_t*> topk_tables_;
  DeviceBuffer<int32_t> route_row_;  // in place: [T_max, k] ring row of every route
  DeviceBuffer<uint32_t> counters_;  // dispatched, gemm1_done, gemm2_done, combined, control
  DeviceBuffer<__nv_bfloat16> x_ring_, h_ring_, out_ring_;
  // Symmetric buffers: virtual ranks keep them here; the NCCL transport in its window.
  DeviceBuffer<uint32_t> peer_words_;  // per rank: arrivals [T_max], start flags [P]
  DeviceBuffer<int32_t> token_counts_;
  DeviceBuffer<__nv_bfloat16> slots_;
  int64_t slot_elems_ = 0;  // per rank: combine slots [T_max, k, H]; 0 in place (setup)
  std::unique_ptr<comm::NcclWindow> window_;
  __nv_bfloat16* window_x_[2][kMaxRanks] = {};  // [forward parity][rank]
  int32_t* window_ids_[2][kMaxRanks] = {};
  int32_t* window_counts_[2][kMaxRanks] = {};
  int device_ = -1;      // the GPU the layer's buffers live on
  bool failed_ = false;  // NCCL, P > 1: a device error ended this layer
  std::string failed_reason_;
};

}  // namespace pounce::moe

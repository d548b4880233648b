// What the fused MoE kernel receives: plain device pointers and sizes, shared by the host launcher and
// the device roles. One launch hosts `launch_ranks` consecutive ranks [first_rank, first_rank +
// launch_ranks): all P on one GPU (virtual ranks) or one (a rank per GPU over NCCL).
//
// Counters never reset between forwards: forward number `epoch` (1, 2, ...) waits for epoch-multiples
// of each counter's per-forward increment, so no launch has to clear them first. After a device error
// the host clears them and starts again from epoch 1.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "common/device_error.h"
#include "planner/device_planner.h"

namespace pounce::moe {

inline constexpr int kMaxRanks = 8;
inline constexpr int kItemRows = 128;  // rows of one dispatch or combine item: one m-block
// The opening (moe/comm_role.cuh) pulls m-blocks in pieces; dispatched[b] counts pieces, so a whole
// D(b) item counts kPiecesPerBlock.
inline constexpr int kPiecesPerBlock = 8;
inline constexpr int kPieceRows = kItemRows / kPiecesPerBlock;
static_assert(kItemRows % kPiecesPerBlock == 0, "the opening's pieces must tile an m-block");

// Words of RankState::control.
enum ControlWord : int {
  kRankBarrier = 0,  // arrivals at the phase barriers among this rank's CTAs
  kGemmTicket = 1,   // next GEMM tile
  kCommTicket = 2,   // next dispatch / combine item
  kSumTicket = 3,    // next token to sum
  kControlWords = 4,
};

// One rank's buffers that only its own CTAs touch.
struct RankState {
  int32_t rank;    // global rank id
  int32_t tokens;  // this rank's tokens in this forward
  const float* topk_weights;  // [tokens, k]
  __nv_bfloat16* y;           // [tokens, H]
  // Planner outputs and scratch (planner::steps::Outputs).
  int32_t *chunk_counts, *expert_routes, *expert_offsets, *row_source_rank, *row_token, *row_k, *minibatch_starts;
  planner::DeviceScheduleSizes* sizes;
  const int32_t** topk_table;  // [P]: the topk_ids pointers of every rank, for the planner
  // Per-m-block counters [max_m_blocks].
  uint32_t* dispatched;  // +1 per piece of the m-block in the ring (kPiecesPerBlock per forward)
  uint32_t* gemm1_done;  // +1 per GEMM1 tile half (2 * n1_blocks per forward)
  uint32_t* gemm2_done;  // +1 per GEMM2 tile half (2 * n2_blocks per forward)
  uint32_t* combined;    // +1 when the m-block's rows were pushed out: its ring slot is free
  uint32_t* control;     // [kControlWords]
  int32_t* route_row;    // in place only: [max_tokens, k] the row each of this rank's routes went to
};

// What every rank exposes to the others (symmetric memory), indexed by global rank.
struct PeerView {
  const __nv_bfloat16* x[kMaxRanks];  // [T_max, H] tokens to pull
  const int32_t* topk_ids[kMaxRanks]; // [T_max, k]
  __nv_bfloat16* slots[kMaxRanks];    // [T_max, k, H] combine destination: slot [token, k] of each route
  uint32_t* arrivals[kMaxRanks];      // [T_max] combine arrivals per token (k per forward)
  uint32_t* start_flags[kMaxRanks];   // [P] forward number each rank has started
  int32_t* token_counts[kMaxRanks];   // [P] every rank's tokens in this forward, written by that rank
};

struct FusedParams {
  int32_t ranks, first_rank, launch_ranks;
  int32_t experts, local_experts, topk;
  int32_t hidden, intermediate;
  int32_t max_tokens;
  int32_t chunks_per_rank;
  int64_t capacity_rows;       // routed rows one rank can hold (worst case), multiple of 128
  int32_t ctas_per_rank, comm_ctas;  // the first comm_ctas CTAs of a rank move data, the rest run GEMMs
  int32_t engine_rows;         // rows of each comm item the bulk-copy engine moves; warps move the rest
  int32_t blocks_per_minibatch;
  int32_t ring_blocks;         // m-blocks of ring per rank
  uint32_t epoch;
  uint64_t wait_timeout_ns;
  int32_t stall_rank;          // fault injection for tests: this rank moves no rows, neither in the opening
                               // nor in its comm CTAs (-1: none)
  int32_t peers_on_this_gpu;   // 1: every rank lives on this GPU (virtual ranks): flags need only GPU scope
  // 1: one rank whose ring holds every m-block. Nothing needs combining: the sums read GEMM2's rows in
  // the ring, and communication CTAs run GEMM tiles once every row is dispatched.
  int32_t in_place;
  __nv_bfloat16* x_ring;       // [launch_ranks * ring_blocks * 128, H]
  __nv_bfloat16* h_ring;       // [..., I]
  __nv_bfloat16* out_ring;     // [..., H]
  DeviceErrorSink error;
  RankState rank_state[kMaxRanks];  // [launch_ranks]
  PeerView peers;
};

}  // namespace pounce::moe

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
#include "common/tiles.h"
#include "common/timeline.h"
#include "gemm/grouped_gemm.h"
#include "planner/device_planner.h"

namespace pounce::moe {

// The opening (moe/comm_role.cuh) pulls m-blocks in pieces; dispatched[b] counts pieces, so a whole
// D(b) item counts kPiecesPerBlock.
inline constexpr int kPiecesPerBlock = 8;
inline constexpr int kPieceRows = kBlockM / kPiecesPerBlock;
static_assert(kBlockM % kPiecesPerBlock == 0, "the opening's pieces must tile an m-block");

// Rows of each 128-row comm item that the bulk-copy engine moves beside the CTA's warps
// (moe/row_mover.cuh), balanced for rows of `row_bytes`: the default of FusedMoeOptions::engine_rows.
// The engine costs about the same per row whatever its length, the warps move bytes, so long rows give
// the engine more. On the H200 (pounce_copy_bench) the best splits were 16 / 32 / 64 rows for 4 / 8 /
// 14 KB rows, within a few percent of warps alone: the two paths share the SM's memory throughput.
inline int balanced_engine_rows(int64_t row_bytes) {
  return int(row_bytes / 224 < kBlockM ? row_bytes / 224 : kBlockM);
}

// What each counter gains per forward. Counters are never reset: forward number `epoch` waits for
// epoch times these.
struct CounterSteps {
  uint32_t dispatched;            // per m-block: its pieces (kPiecesPerBlock)
  uint32_t gemm1_done;            // per m-block: consumer halves of its GEMM1 tiles
  uint32_t gemm2_done;            // per m-block: consumer halves of its GEMM2 tiles
  uint32_t combined;              // per m-block: its one combine item
  uint32_t arrivals;              // per token: its k combined output rows
  uint32_t elementwise_done = 0;  // per m-block: consumer halves of its elementwise items (backward, E4M3 forward)
};

// The E4M3 forward quantizes each m-block's hidden rows for GEMM2 in Q items (moe/fused_fp8_tiles.cuh) of
// at most kQuantizeBlocksPerItem 128-column blocks each: short enough that the minibatch of GEMM1 tiles
// queued between them and the GEMM2 tiles waiting for them covers their latency (at I = 14336 a whole
// m-block's 112 blocks outlasted it), few enough that their fixed cost (a tile's round trip through the
// pipeline, the barrier of both consumers) stays small.
inline constexpr int kQuantizeBlocksPerItem = 8;
POUNCE_HOST_DEVICE inline int32_t quantize_pieces(int64_t intermediate) {
  const int64_t blocks = intermediate / 128;
  return int32_t(blocks > kQuantizeBlocksPerItem ? (blocks + kQuantizeBlocksPerItem - 1) / kQuantizeBlocksPerItem : 1);
}

// Tile widths: kBlockN columns (BF16), kFp8TileN (E4M3: gemm::pipeline::Fp8Stages::kTileN).
inline constexpr int kFp8TileN = 128;

inline CounterSteps counter_steps(const EpConfig& c, bool fp8) {
  const int64_t tile_n = fp8 ? kFp8TileN : kBlockN;
  const auto tiles = [tile_n](int64_t n) { return uint32_t((n + tile_n - 1) / tile_n); };
  return {kPiecesPerBlock,
          gemm::kConsumerWarpgroups * tiles(2 * c.intermediate),
          gemm::kConsumerWarpgroups * tiles(c.hidden),
          1,
          uint32_t(c.topk),
          fp8 ? uint32_t(gemm::kConsumerWarpgroups * quantize_pieces(c.intermediate)) : 0u};
}

// The fused backward's SwiGLU backward runs as this many items per m-block (32 rows each): spread over
// more CTAs, each item ends sooner, and so does the wait of the tiles behind it.
inline constexpr int kSwigluPieces = 4;

// The backward's: its GEMM1 is the data gradient of the down projection (N = I), its GEMM2 that of
// gate/up (N = H).
inline CounterSteps backward_counter_steps(const EpConfig& c) {
  return {kPiecesPerBlock,
          uint32_t(gemm::kConsumerWarpgroups * n_blocks(c.intermediate)),
          uint32_t(gemm::kConsumerWarpgroups * n_blocks(c.hidden)),
          1,
          uint32_t(c.topk),
          uint32_t(gemm::kConsumerWarpgroups * kSwigluPieces)};
}

// Words of RankState::control.
enum ControlWord : int {
  kRankBarrier = 0,  // arrivals at the phase barriers among this rank's CTAs
  kGemmTicket = 1,   // next GEMM tile
  kCommTicket = 2,   // next dispatch / combine item
  kSumTicket = 3,    // next token to sum
  kItemsDone = 4,    // the backward's S items: +1 per consumer half done (W tiles wait for all of them)
  kXRowsDone = 5,    // the backward's X items: +1 per item done (W tiles wait for all of them)
  kControlWords = 6,
};

// One rank's buffers that only its own CTAs touch.
struct RankState {
  int32_t rank;               // global rank id
  int32_t tokens;             // this rank's tokens in this forward
  const __nv_bfloat16* x;     // [tokens, H]: the E4M3 forward quantizes them into PeerView::x_fp8
  const float* topk_weights;  // [tokens, k]
  __nv_bfloat16* y;           // [tokens, H]
  // Planner outputs and scratch (planner::steps::Outputs).
  int32_t *chunk_counts, *expert_routes, *expert_offsets, *row_source_rank, *row_token, *row_k, *minibatch_starts;
  planner::DeviceScheduleSizes* sizes;
  const int32_t** topk_table;  // [P]: the topk_ids pointers of every rank, for the planner
  int32_t* rank_routes;        // [P]: the planner's count of every rank's routes (a bounded capacity; else null)
  // Per-m-block counters [max_m_blocks].
  uint32_t* dispatched;  // +1 per piece of the m-block in the ring (kPiecesPerBlock per forward)
  uint32_t* gemm1_done;  // +1 per GEMM1 tile half (2 * n1_blocks per forward)
  uint32_t* gemm2_done;  // +1 per GEMM2 tile half (2 * n2_blocks per forward)
  uint32_t* combined;    // +1 when the m-block's rows were pushed out: its ring slot is free
  // +1 per consumer half of the m-block's elementwise items: the backward's SwiGLU backward, the E4M3
  // forward's quantization of the hidden rows (null in the BF16 forward).
  uint32_t* elementwise_done;
  uint32_t* control;   // [kControlWords]
  int32_t* route_row;  // one rank only: [max_tokens, k] the row each of this rank's routes went to
};

// What every rank exposes to the others (symmetric memory), indexed by global rank.
struct PeerView {
  const __nv_bfloat16* x[kMaxRanks];   // [T_max, H] tokens to pull
  uint8_t* x_fp8[kMaxRanks];           // E4M3 forward: [T_max, H] the tokens quantized by their rank
  float* x_scale[kMaxRanks];           // E4M3 forward: [T_max, H / 128] their scales, row-major
  uint32_t* x_ready[kMaxRanks];        // E4M3 forward: +1 per CTA of the rank once its share is quantized
  const int32_t* topk_ids[kMaxRanks];  // [T_max, k]
  __nv_bfloat16* slots[kMaxRanks];     // [T_max, k, H] combine destination: slot [token, k] of each route
  uint32_t* arrivals[kMaxRanks];       // [T_max] combine arrivals per token (k per forward)
  uint32_t* start_flags[kMaxRanks];    // [P] forward number each rank has started
  int32_t* token_counts[kMaxRanks];    // [P] every rank's tokens in this forward, written by that rank
};

// What only a backward launch reads (the kernel's data path with dy in place of x: moe/fused_kernel.cu).
// Its ring holds every m-block, and its rows stay for the weight-gradient GEMMs that follow it.
struct BackwardRows {
  const __nv_bfloat16* gate_up_kept;     // [launch ranks * capacity rows, 2I]: the training forward's
  __nv_bfloat16* dgu;                    // [ring rows, 2I]: d(gate, up), interleaved like gate_up_kept
  __nv_bfloat16* wa;                     // [ring rows, I]: w * silu(gate) * up, for dW2
  const float* topk_weights[kMaxRanks];  // [global rank]: that rank's router weights [T, k]
  float* d_topk_weights[kMaxRanks];      // [global rank]: their gradients [T, k]
  float* segment_dots;                   // [ring rows, segments of a row]: each segment's share of <da, a>
  // [ring rows]: each routed row's router weight, copied by dispatch beside its dy row (across GPUs the
  // weights live in the source ranks' memory, an NVLink round trip away from the elementwise items).
  float* row_weight;
  // The kept forward's x of each global rank [T, H], and [ring rows, H] where the backward's X items copy
  // each routed row's x (schedule order) for the weight gradients. Null in place where the forward kept
  // them in its ring (FusedMoeOptions::keep_x_rows).
  const __nv_bfloat16* x_source[kMaxRanks];
  __nv_bfloat16* x_rows;
  // [ring rows, H]: the x rows the weight gradients read (x_rows where the X items pull them, else the
  // forward's ring in place). Their padding rows hold stale rows, which the GEMMs would sum: the S items
  // zero them.
  __nv_bfloat16* wgrad_x_rows;
  // 1 (bf16 weight gradients, x rows kept or pulled): the kernel runs the weight gradients too, as
  // k-grouped tiles queued after the data path's (FusedMaps::wgrad_*): dW2[e] = dy_rows[e]^T . wa[e] and
  // dW13[e] = dgu[e]^T . x_rows[e], written as weight_grad_epilogue says. 0: they run after the kernel.
  int32_t weight_grads;
  gemm::Epilogue weight_grad_epilogue;
};

// What only an E4M3 forward reads and writes (FusedParams::fp8). Each rank quantizes its own tokens
// (1 x 128 blocks) at the start of the forward, into its PeerView::x_fp8 / x_scale; dispatch moves E4M3
// rows and their scales into the ring; GEMM1 + SwiGLU writes bf16 hidden rows (h_ring), which the Q items
// quantize into hidden_fp8 for GEMM2. Ring scales are K block-major over the ring's rows, as the FP8
// grouped GEMM reads its A operand's.
struct Fp8Rows {
  uint8_t* x_ring;                    // [ring rows, H] E4M3
  float* x_ring_scale;                // [H / 128, ring rows]
  uint8_t* hidden;                    // [ring rows, I] E4M3
  float* hidden_scale;                // [I / 128, ring rows]
  int64_t ring_rows;                  // of the launch: the scale arrays' row stride
  const float* w13_scale[kMaxRanks];  // [launch rank]: [E/P * 2I / 128, H / 128], 128 x 128 blocks
  const float* w2_scale[kMaxRanks];   // [launch rank]: [E/P * H / 128, I / 128]
};

struct FusedParams {
  int32_t ranks, first_rank, launch_ranks;
  int32_t experts, local_experts, topk;
  int32_t hidden, intermediate;
  int32_t max_tokens;
  int32_t chunks_per_rank;
  int64_t capacity_rows;             // routed rows one rank can hold (planner::row_capacity), multiple of 128
  int64_t max_routes;                // routes one rank may receive (the same capacity's)
  int32_t ctas_per_rank, comm_ctas;  // the first comm_ctas CTAs of a rank move data, the rest run GEMMs
  int32_t engine_rows;               // rows of each comm item the bulk-copy engine moves; warps move the rest
  int32_t engine_rows_e4m3;          // the same for E4M3 rows (H bytes: the E4M3 forward's dispatch)
  int32_t blocks_per_minibatch;
  int32_t ring_blocks;  // m-blocks of ring per rank
  // Forward number (1, 2, ...): bumped on the device by the launch's first kernel, so a CUDA graph that
  // replays a forward runs it under a new number each time.
  const uint32_t* epoch_word;
  CounterSteps steps;
  uint64_t wait_timeout_ns;
  int32_t stall_rank;         // fault injection for tests: this rank moves no rows, neither in the opening
                              // nor in its comm CTAs (-1: none)
  int32_t peers_on_this_gpu;  // 1: every rank lives on this GPU (virtual ranks): flags need only GPU scope
  // 1: one rank whose ring holds every m-block. Nothing needs combining: the sums read GEMM2's rows in
  // the ring, and communication CTAs run GEMM tiles once every row is dispatched.
  int32_t in_place;
  // 1: a training forward: GEMM1 also stores its tiles before SwiGLU (FusedMaps::gate_up_kept) for the
  // backward, in schedule order.
  int32_t keep_gate_up;
  // Which forward's rows are kept, on the device (a CUDA graph replays forwards the host does not see):
  // [0] its forward number (0: the latest forward kept nothing), [1] the fingerprint of its inputs.
  // Written with the forward number before each forward; checked by the backward that uses them.
  uint64_t* kept_record;
  uint64_t kept_fingerprint;  // of this forward's inputs and weights (host-computed)
  __nv_bfloat16* x_ring;      // [launch_ranks * ring_blocks * 128, H]
  __nv_bfloat16* h_ring;      // [..., I]
  __nv_bfloat16* out_ring;    // [..., H]
  DeviceErrorSink error;
  TimelineSink timeline;  // spans of every CTA (a build with POUNCE_TIMELINE; else unused)
  // 1: a backward. x_ring holds dy rows, h_ring da = dy W2, out_ring the dx rows; the sums are unweighted.
  int32_t backward;
  BackwardRows bwd;
  int32_t fp8;  // 1: the E4M3 forward (Fp8Rows)
  Fp8Rows fp8_rows;
  RankState rank_state[kMaxRanks];  // [launch_ranks]
  PeerView peers;
};

#ifdef __CUDACC__
// The forward number of this launch. Written before the kernel started (stream order) and constant while
// it runs: a read-only load.
__device__ __forceinline__ uint32_t epoch(const FusedParams& p) { return __ldg(p.epoch_word); }
#endif

}  // namespace pounce::moe

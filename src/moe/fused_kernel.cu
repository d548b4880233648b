// The fused MoE forward: one persistent launch per forward. Every rank of the launch owns
// p.ctas_per_rank CTAs and runs, with barriers among its CTAs between phases:
//   start   publish the token count, wait until every rank has started this forward
//   plan    count / scan / place (planner/plan_steps.cuh): this rank's schedule, bit-identical to the
//           host planner; bad routing, or a routing past a rank's capacity, stops every rank here,
//           before any data moves
//   opening every CTA pulls a share of the first minibatch's rows (moe/comm_role.cuh)
//   run     communication CTAs: dispatch and combine items (moe/comm_role.cuh), then weighted sums;
//           compute CTAs: GEMM1 + SwiGLU and GEMM2 tiles (moe/fused_tiles.cuh), then weighted sums.
//           In place (one rank, ring holding every m-block) communication CTAs only dispatch (the
//           backward: and pull x rows again where they were not kept), then take GEMM tiles too.
// The fused backward is the same kernel with the directions swapped (p.backward, FusedBackwardTiles):
// dispatch pulls dy rows, the compute CTAs run the data-gradient GEMMs with the SwiGLU backward between
// them (moe/fused_backward_tiles.cuh), combine pushes the dx rows back, and the sums add them unweighted;
// the weight gradients' tiles follow the data path's in the same queue (bf16, where the x rows are at hand).
// The E4M3 forward (p.fp8, FusedFp8Tiles) starts with every rank quantizing its own tokens; dispatch
// moves the E4M3 rows and their scales, and the compute CTAs run the FP8 GEMMs with the hidden rows'
// quantization between them (moe/fused_fp8_tiles.cuh).
#include <algorithm>
#include <type_traits>

#include "common/cooperative_launch.h"
#include "common/cuda_check.h"
#include "common/require.h"
#include "formats/quantize_device.cuh"
#include "gemm/gemm_pipeline.cuh"
#include "moe/comm_role.cuh"
#include "moe/copy_engine.cuh"
#include "moe/fused_backward_tiles.cuh"
#include "moe/fused_fp8_tiles.cuh"
#include "moe/fused_kernel.h"
#include "moe/fused_tiles.cuh"
#include "moe/rank_sync.cuh"
#include "moe/sum_role.cuh"
#include "planner/plan_steps.cuh"

namespace pounce::moe {
namespace {

namespace steps = planner::steps;
constexpr int kThreads = gemm::pipeline::kThreads;
constexpr int kWarps = kThreads / 32;
// The parameters pass by value (__grid_constant__): above the classic 4 KB, within the 32764 bytes
// CUDA 12.1+ allows every architecture.
static_assert(sizeof(FusedParams) + sizeof(FusedMaps) <= 32764, "kernel parameters exceed the launch limit");

// The planner's shared tables, carved out of the dynamic shared memory before any role uses it.
struct PlannerShared {
  int32_t counts[steps::kMaxLocalExperts];
  int32_t rank_counts[steps::kMaxRanks];
  int32_t offsets[steps::kMaxLocalExperts + 1];
  int32_t warp_sums[32];
  int32_t running[kWarps][steps::kMaxLocalExperts];
};

// Dynamic shared memory of a launch whose compute CTAs take Tiles: the GEMM pipeline's, or more where a
// communication CTA's or the planner's state needs it.
template <class Tiles>
constexpr size_t kKernelSharedBytes = std::max({gemm::pipeline::kSharedBytesOf<Tiles::kKind>, sizeof(CommShared) + 1024,
                                                sizeof(PlannerShared) + 1024});
static_assert(kKernelSharedBytes<FusedTiles> <= 232448 && kKernelSharedBytes<FusedFp8Tiles> <= 232448 &&
                  kKernelSharedBytes<FusedBackwardTiles> <= 232448,
              "shared memory exceeds the sm_90 per-block limit");

// True while no CTA has reported an error. All threads of the CTA call it.
__device__ bool nobody_reported(const FusedParams& p, int32_t* ok_flag) {
  __syncthreads();  // every thread has read the previous verdict before it is overwritten
  if (threadIdx.x == 0) *ok_flag = !device_error_reported(p.error);
  __syncthreads();
  return *ok_flag != 0;
}

// Counters of m-blocks and tokens this forward leaves unused get their per-forward increment too, so
// every word stays at (forward number) x (increment) and a later forward with more m-blocks or tokens
// waits for the right values. Nobody else touches these words during this forward: no item, tile or
// push refers to an m-block past this rank's M or to a token past its token count.
__device__ void top_up_unused_counters(const FusedParams& p, const RankState& rs, int cta) {
  const int64_t worker = int64_t(cta) * kThreads + threadIdx.x, workers = int64_t(p.ctas_per_rank) * kThreads;
  const int64_t max_m_blocks = p.capacity_rows / kBlockM;
  for (int64_t b = rs.sizes->m_blocks + worker; b < max_m_blocks; b += workers) {
    rs.dispatched[b] += p.steps.dispatched;
    rs.gemm1_done[b] += p.steps.gemm1_done;
    rs.gemm2_done[b] += p.steps.gemm2_done;
    rs.combined[b] += p.steps.combined;
    if (rs.elementwise_done != nullptr) rs.elementwise_done[b] += p.steps.elementwise_done;
  }
  uint32_t* arrivals = p.peers.arrivals[rs.rank];
  for (int64_t t = rs.tokens + worker; t < p.max_tokens; t += workers) arrivals[t] += p.steps.arrivals;
}

// The E4M3 forward, all threads of every CTA of the rank, first thing: this rank's tokens quantized 1 x 128
// (bit for bit the stand-alone quantizer) into its x_fp8 and row-major x_scale, a share per CTA, each CTA
// then counted in the rank's x_ready, which every rank's pulls wait for (wait_for_quantized_tokens).
// Nobody reads the previous forward's rows any more: that forward ended here only after every route of
// this rank's tokens came back, each pulled before it was computed.
__device__ void quantize_tokens(const FusedParams& p, const RankState& rs, int cta) {
  constexpr int kUnroll = 4;                                 // 16-byte loads in flight per lane
  const int64_t chunks = int64_t(rs.tokens) * p.hidden / 8;  // whole 16-chunk blocks: H % 128 == 0
  const int64_t warp = int64_t(cta) * kWarps + threadIdx.x / 32, warps = int64_t(p.ctas_per_rank) * kWarps;
  const int lane = threadIdx.x % 32;
  const uint4* x = reinterpret_cast<const uint4*>(rs.x);
  for (int64_t base = warp * 32 * kUnroll; base < chunks; base += warps * 32 * kUnroll) {
    uint4 raw[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t c = base + u * 32 + lane;
      raw[u] = c < chunks ? __ldg(x + c) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t c = base + u * 32 + lane;  // a block's 16 chunks are all in range or all past it
      formats::quantize_device::quantize_chunk<false>(raw[u], c, c < chunks, p.peers.x_fp8[rs.rank],
                                                      p.peers.x_scale[rs.rank]);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    ptx::fence_acq_rel_sys();  // the CTA's rows and scales (cumulative over the barrier) before the count
    ptx::red_relaxed_sys_add(p.peers.x_ready[rs.rank], 1);
  }
}

// Returns false when the forward must stop (a wait gave up, or the routing is invalid).
template <bool kFp8>
__device__ bool plan(const FusedParams& p, const RankState& rs, int cta, uint8_t* smem, int32_t* ok_flag) {
  PlannerShared& ps = *reinterpret_cast<PlannerShared*>(smem);
  const steps::Routing r{rs.topk_table, p.peers.token_counts[rs.rank], p.ranks,         p.experts,
                         p.topk,        p.local_experts * rs.rank,     p.local_experts, p.chunks_per_rank,
                         p.max_tokens};
  const steps::Outputs o{
      rs.chunk_counts, rs.expert_routes,    rs.expert_offsets, rs.row_source_rank, rs.row_token,
      rs.row_k,        rs.minibatch_starts, rs.sizes,          p.capacity_rows,    p.blocks_per_minibatch,
      rs.route_row,    rs.rank_routes,      p.max_routes};

  if constexpr (kFp8) quantize_tokens(p, rs, cta);
  if (cta == 0 && threadIdx.x == 0) {
    for (int w = kGemmTicket; w < kControlWords; ++w) rs.control[w] = 0;
    for (int s = 0; s < p.ranks; ++s) rs.topk_table[s] = p.peers.topk_ids[s];
    if (rs.rank_routes != nullptr)
      for (int s = 0; s < p.ranks; ++s) rs.rank_routes[s] = 0;
    start_all_ranks(p, rs);  // a failed start is reported; every CTA sees it after the barrier
  }
  steps::clear_rows(o, int64_t(cta) * kThreads + threadIdx.x, int64_t(p.ctas_per_rank) * kThreads);
  if (!rank_barrier(p, rs, 1, ok_flag) || !nobody_reported(p, ok_flag)) return false;

  for (int32_t chunk = cta; chunk < r.chunks(); chunk += p.ctas_per_rank)
    steps::count_chunk(r, chunk, o, ps.counts, ps.rank_counts, p.error);
  if (!rank_barrier(p, rs, 2, ok_flag)) return false;
  // A routing past some rank's capacity: every rank stops here (they all counted every rank's routes),
  // leaving an empty schedule for a backward enqueued behind this forward.
  if (!steps::routes_fit(r, o, p.error, /*report=*/cta == 0 && threadIdx.x == 0)) {
    if (cta == 0 && threadIdx.x == 0) steps::publish_empty_schedule(r, o);
    return false;
  }

  for (int32_t e = cta; e < r.local_experts; e += p.ctas_per_rank) steps::scan_expert(r, o, e, ps.warp_sums);
  if (!rank_barrier(p, rs, 3, ok_flag)) return false;

  const int warp = threadIdx.x / 32;
  if (cta < r.chunks() || cta == 0) steps::expert_offsets(r, o, ps.offsets, ps.warp_sums, /*publish=*/cta == 0);
  // Chunks go round the CTAs first: their scattered stores would bind a few SMs' store throughput.
  for (int32_t chunk = cta + warp * p.ctas_per_rank; chunk < r.chunks(); chunk += p.ctas_per_rank * kWarps)
    steps::place_chunk(r, chunk, o, ps.offsets, ps.running[warp]);
  // Bad routing: every rank saw it in its own count step, before the barrier.
  if (!rank_barrier(p, rs, 4, ok_flag) || !nobody_reported(p, ok_flag)) return false;
  top_up_unused_counters(p, rs, cta);
  return true;  // the opening's proxy fence covers the planner's shared tables too
}

// The forward's number and what it keeps, one kernel ahead of it in stream order (a graph replays both).
__global__ void begin_forward(uint32_t* epoch_word, uint64_t* kept_record, int32_t keep, uint64_t fingerprint) {
  const uint32_t epoch = ++*epoch_word;
  kept_record[0] = keep ? epoch : 0;
  kept_record[1] = fingerprint;
}

// The backward about to start from the kept rows checks that they are still those of its forward: the
// latest forward kept them, on the same inputs.
__global__ void check_kept_forward(const uint32_t* epoch_word, const uint64_t* kept_record, uint64_t fingerprint,
                                   DeviceErrorSink error) {
  const uint64_t latest = *epoch_word, kept = kept_record[0];
  const bool same_inputs = kept_record[1] == fingerprint;
  if (kept != latest || !same_inputs)
    report_device_error(error, DeviceErrorCode::kBadSchedule, DeviceRole::kBackward, WaitTarget::kKeptForward,
                        same_inputs, latest, kept, 0);
}

// The backward's number, one kernel ahead of it in stream order.
__global__ void begin_backward(uint32_t* epoch_word) { ++*epoch_word; }

template <class Tiles>
__global__ void __launch_bounds__(kThreads, 1)
    fused_moe_kernel(const __grid_constant__ FusedParams p, const __grid_constant__ FusedMaps maps) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  __shared__ int32_t ok_flag;
  const int lr = blockIdx.x / p.ctas_per_rank, cta = blockIdx.x % p.ctas_per_rank;
  const RankState& rs = p.rank_state[lr];

  constexpr bool kFp8 = std::is_same_v<Tiles, FusedFp8Tiles>;
  const timeline::Stamp started = timeline::now();
  if (!plan<kFp8>(p, rs, cta, smem, &ok_flag)) return;
  const timeline::Stamp planned = timeline::now();
  if (threadIdx.x == 0) timeline::record(p.timeline, TimelineSpan::kPlan, started);
  if (!pull_opening<kThreads, kFp8>(p, rs, lr, cta, *reinterpret_cast<CommShared*>(smem))) return;
  if (threadIdx.x == 0) timeline::record(p.timeline, TimelineSpan::kOpening, planned);
  // Each warpgroup's first thread records when its own warp ran out of tokens to sum.
  const auto sums = [&] {
    const timeline::Stamp begin = timeline::now();
    run_weighted_sums(p, rs);
    if (threadIdx.x % 128 == 0) timeline::record(p.timeline, TimelineSpan::kSums, begin);
  };

  if (cta < p.comm_ctas) {
    run_comm_items<kThreads, kFp8>(p, rs, lr, *reinterpret_cast<CommShared*>(smem));
    if (!p.in_place) return sums();
    // In place the queue held only dispatch (and X) items: every row is in, so this CTA joins the GEMM tiles.
    // The row tables were written through the generic proxy; TMA writes this shared memory next.
    ptx::fence_proxy_async_shared();
    __syncthreads();
  }
  constexpr int kOperands = std::is_same_v<Tiles, FusedBackwardTiles> ? FusedBackwardTiles::kOperands : 2;
  __shared__ gemm::pipeline::GemmOperands tile_operands[kOperands];
  Tiles tiles(p, rs, lr, maps, tile_operands);
  const WaitSite pipe_site{p.error, DeviceRole::kGemmProducer, gemm::pipeline::pipeline_timeout_ns(p.wait_timeout_ns),
                           rs.rank};
  gemm::pipeline::run_gemm_cta(smem_raw, tiles, pipe_site, sums);
}

}  // namespace

void launch_fused_moe(const FusedParams& p, const FusedMaps& maps, cudaStream_t stream) {
  begin_forward<<<1, 1, 0, stream>>>(const_cast<uint32_t*>(p.epoch_word), p.kept_record, p.keep_gate_up,
                                     p.kept_fingerprint);
  CUDA_CHECK_LAUNCH();
  const int ctas = p.launch_ranks * p.ctas_per_rank;
  if (p.fp8)
    launch_cooperative(fused_moe_kernel<FusedFp8Tiles>, ctas, kThreads, kKernelSharedBytes<FusedFp8Tiles>, stream, p,
                       maps);
  else
    launch_cooperative(fused_moe_kernel<FusedTiles>, ctas, kThreads, kKernelSharedBytes<FusedTiles>, stream, p, maps);
}

void launch_fused_moe_backward(const FusedParams& p, const FusedMaps& maps, cudaStream_t stream) {
  POUNCE_REQUIRE(p.backward, "launch_fused_moe_backward: the parameters are a forward's");
  begin_backward<<<1, 1, 0, stream>>>(const_cast<uint32_t*>(p.epoch_word));
  CUDA_CHECK_LAUNCH();
  launch_cooperative(fused_moe_kernel<FusedBackwardTiles>, p.launch_ranks * p.ctas_per_rank, kThreads,
                     kKernelSharedBytes<FusedBackwardTiles>, stream, p, maps);
}

void launch_check_kept_forward(const FusedParams& p, uint64_t fingerprint, cudaStream_t stream) {
  check_kept_forward<<<1, 1, 0, stream>>>(p.epoch_word, p.kept_record, fingerprint, p.error);
  CUDA_CHECK_LAUNCH();
}

}  // namespace pounce::moe

// Communication CTAs of one rank: dispatch (pull) and combine (push), one m-block per item, from one
// queue whose order keeps every wait pointing at earlier work:
//   D(0) ... D(R-1), then C(0), D(R), C(1), D(R+1), ..., C(M-1)       (R ring blocks, M m-blocks)
//   D(b): wait until the ring slot's previous m-block b - R is combined; pull the m-block's rows from
//         their source ranks into ring slot b % R; release dispatched[b].
//   C(b): wait until GEMM2 finished m-block b; push each row to slot [token, k] of its source rank, then
//         count it in that rank's arrivals[token] (system scope); release combined[b] (frees the slot).
// In place (one rank, the ring holds every m-block) the queue is D(0) ... D(M-1): nothing is combined.
// The backward adds X(b) (backward_comm_item) across ranks, or in place where the forward did not keep
// its x rows (keep_x_rows): pull m-block b's x rows from the kept forward's source ranks for the weight
// gradients: counted in kXRowsDone for the kernel's own W tiles, published by the kernel's end to those
// that run after it. In place the queue is then D(0) ... D(M-1), X(0) ... X(M-1).
// The opening D(0) ... D(m0-1) (the first minibatch) is pulled before the queue starts, in pieces of
// kPieceRows rows by every CTA of the rank (pull_opening), so the queue's first ticket is D(m0).
// Padding rows are never copied: the ring slot keeps stale rows there, whose outputs nobody reads.
#pragma once

#include "common/bounded_wait.cuh"
#include "common/timeline.cuh"
#include "gemm/grouped_gemm.h"
#include "moe/copy_engine.cuh"
#include "moe/fused_params.h"
#include "moe/row_mover.cuh"
#include "moe/work_queues.h"
#include "ptx/ptx.cuh"

namespace pounce::moe {

// Ring row of row r of m-block b (rows of launch-local rank lr).
__device__ inline int64_t ring_row(const FusedParams& p, int lr, int32_t m_block, int r) {
  return (int64_t(lr) * p.ring_blocks + m_block % p.ring_blocks) * kBlockM + r;
}

// Backward: the router weight of row r of m-block b, from its source rank, beside its dy row (the
// release of dispatched[b] that follows publishes both).
__device__ inline void pull_row_weight(const FusedParams& p, const RankState& rs, int lr, int32_t b, int r) {
  const int64_t row = int64_t(b) * kBlockM + r;
  const int64_t route = int64_t(rs.row_token[row]) * p.topk + rs.row_k[row];
  p.bwd.row_weight[ring_row(p, lr, b, r)] = p.bwd.topk_weights[rs.row_source_rank[row]][route];
}

// Where dispatch copies row r of m-block b from, and to: the source rank's token row, bf16 or (kFp8, the
// E4M3 forward's kernel: p.fp8) its quantized bytes.
template <bool kFp8>
__device__ inline const void* dispatch_source(const FusedParams& p, const RankState& rs, int32_t b, int r) {
  const int64_t row = int64_t(b) * kBlockM + r;
  const int32_t rank = rs.row_source_rank[row];
  if (rank < 0) return nullptr;  // padding
  const int64_t at = int64_t(rs.row_token[row]) * p.hidden;
  if constexpr (kFp8)
    return p.peers.x_fp8[rank] + at;
  else
    return p.peers.x[rank] + at;
}
template <bool kFp8>
__device__ inline void* dispatch_destination(const FusedParams& p, int lr, int32_t b, int r) {
  const int64_t at = ring_row(p, lr, b, r) * p.hidden;
  if constexpr (kFp8)
    return p.fp8_rows.x_ring + at;
  else
    return p.x_ring + at;
}

// E4M3 forward: where row r of m-block b's scales start at its source rank (row-major, H / 128 a row).
__device__ inline const float* dispatch_scale_source(const FusedParams& p, const RankState& rs, int32_t b, int r) {
  const int64_t row = int64_t(b) * kBlockM + r;
  const int32_t rank = rs.row_source_rank[row];
  if (rank < 0) return nullptr;  // padding
  return p.peers.x_scale[rank] + int64_t(rs.row_token[row]) * (p.hidden / 128);
}

// E4M3 forward, all threads of the CTA: the scales of rows [first, first + rows) of m-block b, from the
// sources in scale_src[0, rows) (null: padding), into the ring's K block-major scales. Consecutive
// threads read one row's scales (contiguous over NVLink) and scatter them locally, kBatch loads in
// flight per thread before their stores. Ordered for the item's release like its rows (the CTA barrier
// that follows).
template <int kThreads>
__device__ inline void pull_row_scales(const FusedParams& p, int lr, int32_t b, int first, int rows,
                                       const float* const* scale_src) {
  constexpr int kBatch = 8;
  const int blocks = p.hidden / 128, n = rows * blocks;
  for (int base = threadIdx.x; base < n; base += kBatch * kThreads) {
    float value[kBatch];
    float* to[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int i = base + u * kThreads, r = i / blocks, block = i - r * blocks;
      to[u] = nullptr;
      if (i < n && scale_src[r] != nullptr) {
        value[u] = scale_src[r][block];
        to[u] = p.fp8_rows.x_ring_scale + block * p.fp8_rows.ring_rows + ring_row(p, lr, b, first + r);
      }
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u)
      if (to[u] != nullptr) *to[u] = value[u];
  }
}

// Shared memory of a communication CTA.
struct CommShared {
  CopyEngine::Shared engine;
  const void* src[kBlockM];  // the item's row copies (null: padding row)
  void* dst[kBlockM];
  const float* scale_src[kBlockM];  // E4M3 dispatch: each row's scales at its source rank (null: padding)
  CommItem item;
  int32_t go;  // 0: the queue is empty or a wait gave up
};

// Runs on every thread of a communication CTA until the queue is empty or a wait gave up (then the
// copy engine is retired: its shared memory is free after a CTA barrier). Thread 0
// takes items and waits; all threads resolve the item's 128 row addresses into shared memory, then
// move the rows together (moe/row_mover.cuh), and thread 0 releases the item.
template <int kThreads, bool kFp8>
__device__ inline void run_comm_items(const FusedParams& p, const RankState& rs, int lr, CommShared& cs) {
  const planner::DeviceScheduleSizes sizes = *rs.sizes;
  const bool pull_x = p.backward && p.bwd.x_rows != nullptr;
  // In place: D(b) (and X(b)) only; backward_comm_item puts every C(b) after them.
  const int64_t items = ((p.in_place ? 1 : 2) + (pull_x ? 1 : 0)) * int64_t(sizes.m_blocks);
  const int64_t opening = opening_blocks(sizes.m_blocks, p.blocks_per_minibatch);
  const bool stalled = p.stall_rank == rs.rank;  // fault injection: never take an item
  CopyEngine engine(cs.engine, WaitSite{p.error, DeviceRole::kDispatch, p.wait_timeout_ns, rs.rank});
  timeline::Stamp taken{};  // thread 0: when it took the item (its waits count as the item's time)
  for (;;) {
    if (threadIdx.x == 0) {
      taken = timeline::now();
      const int64_t i = stalled ? items : opening + atomicAdd(&rs.control[kCommTicket], 1u);
      bool go = i < items;
      if (go) {
        const CommItem item =
            pull_x ? backward_comm_item(i, sizes.m_blocks) : comm_item(i, sizes.m_blocks, p.ring_blocks);
        const int32_t b = item.m_block;
        if (item.x_rows) {
          ptx::fence_proxy_async_global();  // like D(b): the rows are read by bulk loads (async proxy)
        } else if (!item.combine) {
          const WaitSite site{p.error, DeviceRole::kDispatch, p.wait_timeout_ns, rs.rank};
          go = b < p.ring_blocks || counter_wait_bounded(&rs.combined[b - p.ring_blocks], epoch(p) * p.steps.combined,
                                                         site, WaitTarget::kRingSlotFree, b);
          // The slot's last readers (GEMM1's TMA loads, the combine's bulk loads) and this item's bulk
          // writes are all async proxy, but they are ordered through generic-proxy counters.
          ptx::fence_proxy_async_global();
        } else {
          const WaitSite site{p.error, DeviceRole::kCombine, p.wait_timeout_ns, rs.rank};
          go = counter_wait_bounded(&rs.gemm2_done[b], epoch(p) * p.steps.gemm2_done, site, WaitTarget::kGemm2Done, b);
          ptx::fence_proxy_async_global();  // GEMM2's TMA stores, acquired above, before our bulk loads
        }
        cs.item = item;
      }
      cs.go = go;
    }
    __syncthreads();
    if (!cs.go) {
      if (threadIdx.x == 0) engine.retire();  // every copy has landed: flushed after each item
      return;
    }
    const CommItem item = cs.item;
    const int32_t b = item.m_block;
    if (threadIdx.x < kBlockM) {
      const int r = threadIdx.x;
      const int64_t row = int64_t(b) * kBlockM + r;
      const int32_t rank = rs.row_source_rank[row];
      const void* src = nullptr;
      void* dst = nullptr;
      if (rank >= 0 && item.x_rows) {
        src = p.bwd.x_source[rank] + int64_t(rs.row_token[row]) * p.hidden;
        dst = p.bwd.x_rows + ring_row(p, lr, b, r) * p.hidden;
      } else if (rank >= 0 && !item.combine) {
        src = dispatch_source<kFp8>(p, rs, b, r);
        dst = dispatch_destination<kFp8>(p, lr, b, r);
        if (p.backward) pull_row_weight(p, rs, lr, b, r);
      } else if (rank >= 0) {
        src = p.out_ring + ring_row(p, lr, b, r) * p.hidden;
        dst = p.peers.slots[rank] + (int64_t(rs.row_token[row]) * p.topk + rs.row_k[row]) * p.hidden;
      }
      cs.src[r] = src;
      cs.dst[r] = dst;
      if constexpr (kFp8) cs.scale_src[r] = item.combine ? nullptr : dispatch_scale_source(p, rs, b, r);
    }
    __syncthreads();
    // E4M3 rows are H bytes (dispatch of the E4M3 forward), bf16 ones 2H.
    const bool fp8_rows = kFp8 && !item.combine;
    move_rows<kThreads>(engine, cs.src, cs.dst, uint32_t(p.hidden) * (fp8_rows ? 1 : 2),
                        fp8_rows ? p.engine_rows_e4m3 : p.engine_rows);
    if (fp8_rows) {
      pull_row_scales<kThreads>(p, lr, b, 0, kBlockM, cs.scale_src);
      __syncthreads();  // every thread's scales before thread 0's release
    }
    if (threadIdx.x == 0) {
      if (item.x_rows) {
        // Its rows landed before move_rows' barrier: the release covers them (cumulative).
        if (p.bwd.weight_grads) ptx::red_release_gpu_add(&rs.control[kXRowsDone], 1);
      } else if (!item.combine) {
        ptx::red_release_gpu_add(&rs.dispatched[b], p.steps.dispatched);
      } else {
        // NOTES: release pattern for the arrivals: one system-scope fence orders every pushed row (landed
        // before move_rows' barrier, so cumulative) before the relaxed increments; the source rank
        // acquires its arrivals counter.
        ptx::fence_acq_rel_sys();
        for (int r = 0; r < kBlockM; ++r) {
          const int64_t row = int64_t(b) * kBlockM + r;
          const int32_t rank = rs.row_source_rank[row];
          if (rank >= 0) ptx::red_relaxed_sys_add(&p.peers.arrivals[rank][rs.row_token[row]], 1);
        }
        ptx::red_release_gpu_add(&rs.combined[b], p.steps.combined);
      }
      timeline::record(p.timeline, item.combine ? TimelineSpan::kCombine : TimelineSpan::kDispatch, taken, b,
                       item.x_rows ? 1 : 0);
    }
  }
}

// E4M3 forward, thread 0: waits until every rank has quantized its tokens for this forward (each CTA of a
// rank counts itself in that rank's x_ready once its share is written). Everything this rank pulls later
// is ordered after it (the CTA barrier behind it, then the dispatched counters).
__device__ inline bool wait_for_quantized_tokens(const FusedParams& p, const RankState& rs) {
  const WaitSite site{p.error, DeviceRole::kDispatch, p.wait_timeout_ns, rs.rank};
  for (int r = 0; r < p.ranks; ++r)
    if (!counter_wait_bounded<Scope::kSystem>(p.peers.x_ready[r], epoch(p) * uint32_t(p.ctas_per_rank), site,
                                              WaitTarget::kTokensQuantized, r))
      return false;
  return true;
}

// The opening: right after planning every CTA of the rank, communication and GEMM alike, pulls pieces
// of the first minibatch's m-blocks (kPieceRows rows each, a row per warp: copy_rows_by_warps).
// The first GEMM wave needs every m-block of that minibatch; moved whole by the few communication CTAs
// (~40 us an m-block at H 7168) they landed 50-140 us after planning. Nothing here waits but the E4M3
// forward's readiness of the quantized tokens: the first minibatch's ring slots have no earlier tenant
// in this forward, and the start handshake has made every rank's x readable. Ends with a CTA barrier
// after a proxy fence: the roles that follow write this shared memory through the async proxy (TMA,
// bulk copies). False when a wait gave up (the CTA leaves the kernel).
template <int kThreads, bool kFp8>
__device__ inline bool pull_opening(const FusedParams& p, const RankState& rs, int lr, int cta, CommShared& cs) {
  static_assert(kPieceRows <= kThreads, "one thread resolves each row of a piece");
  if constexpr (kFp8) {
    if (threadIdx.x == 0) cs.go = wait_for_quantized_tokens(p, rs);
    __syncthreads();
    if (!cs.go) return false;
  }
  const int32_t pieces = opening_blocks(rs.sizes->m_blocks, p.blocks_per_minibatch) * kPiecesPerBlock;
  const uint32_t row_bytes = uint32_t(p.hidden) * (kFp8 ? 1 : 2);
  const bool stalled = p.stall_rank == rs.rank;  // fault injection: this rank moves no rows
  for (int32_t q = stalled ? pieces : cta; q < pieces; q += p.ctas_per_rank) {
    const int32_t b = q / kPiecesPerBlock;
    const int first = (q % kPiecesPerBlock) * kPieceRows;
    if (threadIdx.x < kPieceRows) {
      const int r = first + threadIdx.x;
      cs.src[threadIdx.x] = dispatch_source<kFp8>(p, rs, b, r);
      cs.dst[threadIdx.x] = dispatch_destination<kFp8>(p, lr, b, r);
      if (p.backward && cs.src[threadIdx.x] != nullptr) pull_row_weight(p, rs, lr, b, r);
      if constexpr (kFp8) cs.scale_src[threadIdx.x] = dispatch_scale_source(p, rs, b, r);
    }
    __syncthreads();
    copy_rows_by_warps<kThreads>(cs.src, cs.dst, kPieceRows, row_bytes, /*first_warp=*/0);
    if constexpr (kFp8) pull_row_scales<kThreads>(p, lr, b, first, kPieceRows, cs.scale_src);
    __syncthreads();  // every thread's stores (and its table reads) done
    if (threadIdx.x == 0) ptx::red_release_gpu_add(&rs.dispatched[b], 1);  // cumulative over the barrier
  }
  ptx::fence_proxy_async_shared();
  __syncthreads();
  return true;
}

}  // namespace pounce::moe

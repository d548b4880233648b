// The GEMM tile source of the fused backward's compute CTAs: like the forward's (moe/fused_tiles.cuh),
// with the backward's two data-gradient GEMMs and elementwise items between them:
//   D1(b): da = dy_rows . W2[e] (W2 read N-major); waits until dispatch pulled m-block b's dy rows.
//   S(b):  the SwiGLU backward of b's rows (moe/backward/swiglu_backward.cuh) from da and the kept
//          gate/up rows: dgu, w.a and each route's router-weight gradient, written to its source rank;
//          waits for every D1 tile of b. kSwigluPieces items of 32 rows; each consumer warpgroup of the
//          CTA that takes one does 16 of them.
//   D2(b): dx_rows = dgu . W13[e] (W13 read N-major); waits for every piece of S(b).
// Step j of the queue holds D1(j), S(j-1), D2(j-2) (moe/work_queues.h). Every wait points at an earlier
// queue entry or at dispatch, which waits for nothing (the backward's ring holds every m-block), so the
// queue cannot deadlock.
#pragma once

#include "common/bounded_wait.cuh"
#include "gemm/gemm_pipeline.cuh"
#include "moe/backward/swiglu_backward.cuh"
#include "moe/comm_role.cuh"
#include "moe/fused_kernel.h"
#include "moe/fused_params.h"
#include "moe/work_queues.h"

namespace pounce::moe {

static_assert(kElementwiseItem == gemm::pipeline::kElementwiseTile, "queue and pipeline name S items alike");

class FusedBackwardTiles {
 public:
  static constexpr gemm::pipeline::TileKind kKind = gemm::pipeline::TileKind::kDataGrad;

  // ops: shared [2], as in FusedTiles.
  __device__ FusedBackwardTiles(const FusedParams& p, const RankState& rs, int lr, const FusedMaps& maps,
                                gemm::pipeline::GemmOperands* ops)
      : p_(p), rs_(rs), lr_(lr), sizes_(*rs.sizes), ops_(ops) {
    n_blocks_[0] = n_blocks(p.intermediate);
    n_blocks_[1] = n_blocks(p.hidden);
    if (threadIdx.x == 0) {
      ops[0] = {&maps.x_ring,  &maps.w2[lr], &maps.h_ring_store, gemm::Epilogue::kStore, nullptr,
                rs.gemm1_done, nullptr};
      ops[1] = {&maps.h_ring_load, &maps.w13[lr], &maps.out_ring_store, gemm::Epilogue::kStore, nullptr,
                rs.gemm2_done,     nullptr};
    }
  }

  __device__ bool next(gemm::pipeline::TileInfo& info) {
    const int64_t ticket = atomicAdd(&rs_.control[kGemmTicket], 1u);
    const BackwardTileQueue queue{
        sizes_.m_blocks, sizes_.minibatches, p_.blocks_per_minibatch, {n_blocks_[0], n_blocks_[1]}, kSwigluPieces};
    GemmTile tile;
    if (!queue.tile(ticket, tile)) return false;
    const int32_t m_block = tile.m_block;
    const WaitSite site{p_.error, DeviceRole::kGemmProducer, p_.wait_timeout_ns, rs_.rank};
    const uint32_t e = epoch(p_);
    const bool ready = tile.gemm == 0 ? counter_wait_bounded(&rs_.dispatched[m_block], e * p_.steps.dispatched, site,
                                                             WaitTarget::kMBlockReady, m_block)
                       : tile.gemm == kElementwiseItem
                           ? counter_wait_bounded(&rs_.gemm1_done[m_block], e * p_.steps.gemm1_done, site,
                                                  WaitTarget::kGemm1Done, m_block)
                           : counter_wait_bounded(&rs_.swiglu_done[m_block], e * p_.steps.swiglu_done, site,
                                                  WaitTarget::kSwigluDone, m_block);
    if (!ready) return false;
    // NOTES: A rows written by other CTAs (bulk copies, the S items' stores), acquired above through the
    // generic proxy, are read by TMA through the async proxy.
    ptx::fence_proxy_async_global();
    const int32_t expert = expert_of_row(rs_.expert_offsets, p_.local_experts, int64_t(m_block) * kBlockM);
    const int32_t row = int32_t(ring_row(p_, lr_, m_block, 0));
    const int32_t rows =
        min(kBlockM, max(0, rs_.expert_offsets[expert] + rs_.expert_routes[expert] - m_block * kBlockM));
    if (tile.gemm == kElementwiseItem) {
      const int32_t keep_row = int32_t(lr_ * p_.capacity_rows + int64_t(m_block) * kBlockM);
      info = {kElementwiseItem, {row, 0}, {0, 0}, row, 0, tile.n_block, m_block, 0, 1, keep_row, rows};
      return true;
    }
    // B is N-major [experts * K, N]: the expert's first K row, the n-block's column.
    const int32_t k = tile.gemm == 0 ? p_.hidden : 2 * p_.intermediate;
    info = {tile.gemm, {row, 0}, {expert * k, tile.n_block * kBlockN}, row, 0, tile.n_block, m_block, k / kBlockK, 1,
            0,         rows};
    return true;
  }

  // One piece of S(b) (tile.n_block), this consumer warpgroup's 16 of its 32 rows: a warp per row.
  // Padding rows get zero dgu and w.a, and zero dy rows too: the weight gradients sum whole m-blocks, and
  // dispatch leaves padding rows stale.
  __device__ void run_elementwise(const gemm::pipeline::TileInfo& tile, int consumer, int thread) const {
    constexpr int kPieceRows = kBlockM / kSwigluPieces, kRows = kPieceRows / gemm::kConsumerWarpgroups;
    const timeline::Stamp started = timeline::now();
    const int lane = thread % 32, warp = thread / 32;
    const int64_t groups = p_.intermediate / 8, h_vecs = p_.hidden / 8;
    const BackwardRows& b = p_.bwd;
    const int first = tile.n_block * kPieceRows + consumer * kRows;
    for (int r = first + warp; r < first + kRows; r += 4) {
      const int64_t row = int64_t(tile.m_block) * kBlockM + r, ring = int64_t(tile.c_row) + r;
      uint4* dgu = reinterpret_cast<uint4*>(b.dgu) + ring * groups * 2;
      uint4* wa = reinterpret_cast<uint4*>(b.wa) + ring * groups;
      const int32_t token = rs_.row_token[row];
      if (token < 0) {
        backward::swiglu_backward_padding_row(groups, dgu, wa, lane);
        uint4* dy = reinterpret_cast<uint4*>(p_.x_ring) + ring * h_vecs;
        for (int64_t v = lane; v < h_vecs; v += 32) dy[v] = make_uint4(0, 0, 0, 0);
        continue;
      }
      const int32_t source = rs_.row_source_rank[row];
      const int64_t route = int64_t(token) * p_.topk + rs_.row_k[row];
      const uint4* gate_up = reinterpret_cast<const uint4*>(b.gate_up_kept) + (int64_t(tile.keep_row) + r) * groups * 2;
      const uint4* da = reinterpret_cast<const uint4*>(p_.h_ring) + ring * groups;
      const float dot =
          backward::swiglu_backward_row(gate_up, da, b.topk_weights[source][route], groups, dgu, wa, lane);
      if (lane == 0) b.d_topk_weights[source][route] = dot;
    }
    // Every warp's stores before the release that lets D2 tiles (and the weight gradients) read them.
    ptx::named_barrier_sync(gemm::pipeline::kEpilogueBarrierBase + consumer, 128);
    if (thread == 0) {
      __threadfence();
      ptx::red_release_gpu_add(&rs_.swiglu_done[tile.m_block], 1);
      timeline::record(p_.timeline, TimelineSpan::kElementwise, started, kElementwiseItem, tile.m_block, tile.n_block);
    }
  }

  __device__ const gemm::pipeline::GemmOperands& operands(int gemm) const { return ops_[gemm]; }
  __device__ const TimelineSink& timeline() const { return p_.timeline; }

 private:
  const FusedParams& p_;
  const RankState& rs_;
  int lr_;
  planner::DeviceScheduleSizes sizes_;
  int32_t n_blocks_[2];
  const gemm::pipeline::GemmOperands* ops_;
};

}  // namespace pounce::moe

// The GEMM tile source of the fused kernel's compute CTAs (gemm/gemm_pipeline.cuh contract): one queue
// per rank holding both GEMMs, minibatch by minibatch, GEMM2 of a minibatch one minibatch behind its GEMM1:
//   G1(0), G1(1), G2(0), G1(2), G2(1), ..., G1(n-1), G2(n-2), G2(n-1)
// so GEMM1 tiles of the next minibatch cover the wait for the last GEMM1 tiles of this one. A GEMM1 tile
// waits until dispatch has filled its m-block; a GEMM2 tile until every GEMM1 tile of its m-block is
// stored. Inside a minibatch tiles run m-fastest (the ~130 tiles in flight share a few weight n-blocks).
// Every wait points at earlier queue entries or at dispatch items that only wait on earlier GEMM2
// tiles (the ring holds at least two minibatches), so the queue cannot deadlock.
#pragma once

#include "common/bounded_wait.cuh"
#include "moe/rank_tiles.cuh"

namespace pounce::moe {

class FusedTiles : public RankTiles {
 public:
  static constexpr gemm::pipeline::TileKind kKind = gemm::pipeline::TileKind::kForward;

  // ops: shared [2], filled here by thread 0 and published by run_gemm_cta's first __syncthreads. Indexed by
  // the tile's GEMM, an array in the object would live in local memory, and with ~230 KB of shared
  // memory the SM's L1 is too small to keep the consumers' local reads in it: every epilogue then waited
  // on L2 for the operands (measured ~0.8 us a tile against the stand-alone engine).
  __device__ FusedTiles(const FusedParams& p, const RankState& rs, int lr, const FusedMaps& maps,
                        gemm::pipeline::GemmOperands* ops)
      : RankTiles(p, rs, lr, 2 * p.intermediate, p.hidden, ops) {
    if (threadIdx.x == 0) {
      ops[0] = {&maps.x_ring,
                &maps.w13[lr],
                &maps.h_ring_store,
                gemm::Epilogue::kSwiGLU,
                nullptr,
                rs.gemm1_done,
                p.keep_gate_up ? &maps.gate_up_kept : nullptr};
      ops[1] = {&maps.h_ring_load, &maps.w2[lr], &maps.out_ring_store, gemm::Epilogue::kStore, nullptr,
                rs.gemm2_done,     nullptr};
    }
  }

  __device__ bool next(gemm::pipeline::TileInfo& info) {
    const int64_t ticket = take_ticket();
    int32_t gemm = 0, m_block = 0, n_block = 0;
    if (!decode(ticket, gemm, m_block, n_block)) return false;
    const WaitSite site{p_.error, DeviceRole::kGemmProducer, p_.wait_timeout_ns, rs_.rank};
    const bool ready = gemm == 0 ? counter_wait_bounded(&rs_.dispatched[m_block], epoch(p_) * p_.steps.dispatched, site,
                                                        WaitTarget::kMBlockReady, m_block)
                                 : counter_wait_bounded(&rs_.gemm1_done[m_block], epoch(p_) * p_.steps.gemm1_done, site,
                                                        WaitTarget::kGemm1Done, m_block);
    if (!ready) return false;
    // NOTES: the A rows were written by other CTAs (bulk copies, TMA stores) and acquired above through
    // the generic proxy; our TMA loads read through the async proxy.
    ptx::fence_proxy_async_global();
    // Weight rows of this rank's own experts: its weights hold the local experts only.
    const MBlockRows m = rows_of(m_block);
    const int32_t n = gemm == 0 ? 2 * p_.intermediate : p_.hidden;
    const int32_t k_blocks = (gemm == 0 ? p_.hidden : p_.intermediate) / kBlockK;
    info = {gemm,
            {m.ring_row, 0},
            {m.expert * n + n_block * kBlockN, 0},
            m.ring_row,
            0,
            n_block,
            m_block,
            k_blocks,
            1,
            keep_row(m_block),
            m.rows};
    return true;
  }

 private:
  // The tile order lives in moe/work_queues.h, where the host tests check it.
  __device__ bool decode(int64_t t, int32_t& gemm, int32_t& m_block, int32_t& n_block) const {
    const TileQueue queue{sizes_.m_blocks, sizes_.minibatches, p_.blocks_per_minibatch, {n_blocks_[0], n_blocks_[1]}};
    GemmTile tile;
    if (!queue.tile(t, tile)) return false;
    gemm = tile.gemm, m_block = tile.m_block, n_block = tile.n_block;
    return true;
  }
};

}  // namespace pounce::moe

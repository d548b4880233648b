// What the fused kernel's two tile sources (moe/fused_tiles.cuh forward, moe/fused_backward_tiles.cuh
// backward) share: one rank's parameters and schedule, the operand table the engine reads (shared memory,
// filled by the derived constructor's thread 0), and where an m-block's rows lie.
#pragma once

#include "common/bounded_wait.cuh"
#include "gemm/gemm_pipeline.cuh"
#include "moe/comm_role.cuh"
#include "moe/fused_params.h"
#include "moe/work_queues.h"

namespace pounce::moe {

class RankTiles {
 public:
  // Claimed late (gemm::pipeline::claims_late): the fused kernel's tiles wait for one another, and
  // claiming a whole tile ahead made its forward 2-12 % slower on one H200
  // (results/archive/h200/2026-12-02-tile-fetcher-ab.txt). Four BF16 slices (~3 us in the fused kernel)
  // cover the claim's round trips and the input wait; the E4M3 source claims eight of its shorter slices
  // ahead (results/archive/h200/2026-12-03-claim-late-ab.txt).
  static constexpr int kClaimLeadSlices = 4;

  __device__ const gemm::pipeline::GemmOperands& operands(int gemm) const { return ops_[gemm]; }
  __device__ const TimelineSink& timeline() const { return p_.timeline; }

 protected:
  // n1, n2: the two GEMMs' output widths, in tiles of tile_n columns. ops: shared, one entry per GEMM of
  // the derived source (see FusedTiles, FusedBackwardTiles::kOperands).
  __device__ RankTiles(const FusedParams& p, const RankState& rs, int lr, int64_t n1, int64_t n2,
                       gemm::pipeline::GemmOperands* ops, int64_t tile_n = kBlockN)
      : p_(p), rs_(rs), lr_(lr), sizes_(*rs.sizes), ops_(ops) {
    n_blocks_[0] = int32_t((n1 + tile_n - 1) / tile_n);
    n_blocks_[1] = int32_t((n2 + tile_n - 1) / tile_n);
  }

  // An m-block's expert, first ring row, and rows that hold routes (the rest is padding, skipped by the
  // consumers it fills).
  struct MBlockRows {
    int32_t expert, ring_row, rows;
  };
  __device__ MBlockRows rows_of(int32_t m_block) const {
    const int32_t expert = expert_of_row(rs_.expert_offsets, p_.local_experts, int64_t(m_block) * kBlockM);
    const int32_t rows =
        min(kBlockM, max(0, rs_.expert_offsets[expert] + rs_.expert_routes[expert] - m_block * kBlockM));
    return {expert, int32_t(ring_row(p_, lr_, m_block, 0)), rows};
  }
  // The rank's next GEMM ticket.
  __device__ int64_t take_ticket() { return atomicAdd(&rs_.control[kGemmTicket], 1u); }

  // The rank's ElementwiseTileQueue with `pieces` items per m-block.
  __device__ ElementwiseTileQueue elementwise_queue(int32_t pieces) const {
    return {sizes_.m_blocks, sizes_.minibatches, p_.blocks_per_minibatch, {n_blocks_[0], n_blocks_[1]}, pieces};
  }

  // Entry `ticket` of the rank's ElementwiseTileQueue (`pieces` items per m-block) once its inputs are
  // ready: a GEMM1 tile waits for dispatch, an item for every GEMM1 tile of its m-block, a GEMM2 tile for
  // every item of its m-block (`items_done` names that wait in errors). False past the end of the queue
  // or when a wait gave up.
  __device__ bool take_with_items(int64_t ticket, int32_t pieces, WaitTarget items_done, GemmTile& tile) {
    if (!elementwise_queue(pieces).tile(ticket, tile)) return false;
    const int32_t m_block = tile.m_block;
    const WaitSite site{p_.error, DeviceRole::kGemmProducer, p_.wait_timeout_ns, rs_.rank};
    const uint32_t e = epoch(p_);
    const bool ready = tile.gemm == 0 ? counter_wait_bounded(&rs_.dispatched[m_block], e * p_.steps.dispatched, site,
                                                             WaitTarget::kMBlockReady, m_block)
                       : tile.gemm == kElementwiseItem
                           ? counter_wait_bounded(&rs_.gemm1_done[m_block], e * p_.steps.gemm1_done, site,
                                                  WaitTarget::kGemm1Done, m_block)
                           : counter_wait_bounded(&rs_.elementwise_done[m_block], e * p_.steps.elementwise_done, site,
                                                  items_done, m_block);
    if (!ready) return false;
    // NOTES: A rows written by other CTAs (bulk copies, TMA stores, the items' stores), acquired above
    // through the generic proxy, are read by TMA through the async proxy.
    ptx::fence_proxy_async_global();
    return true;
  }

  // Kept gate/up rows sit in schedule order (the ring's rows are reused), one capacity of rows per rank.
  __device__ int32_t keep_row(int32_t m_block) const {
    return int32_t(lr_ * p_.capacity_rows + int64_t(m_block) * kBlockM);
  }

  const FusedParams& p_;
  const RankState& rs_;
  int lr_;
  planner::DeviceScheduleSizes sizes_;
  int32_t n_blocks_[2];
  const gemm::pipeline::GemmOperands* ops_;
};

}  // namespace pounce::moe

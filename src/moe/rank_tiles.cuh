// What the fused kernel's two tile sources (moe/fused_tiles.cuh forward, moe/fused_backward_tiles.cuh
// backward) share: one rank's parameters and schedule, the operand table the engine reads (shared memory,
// filled by the derived constructor's thread 0), and where an m-block's rows lie.
#pragma once

#include "gemm/gemm_pipeline.cuh"
#include "moe/comm_role.cuh"
#include "moe/fused_params.h"
#include "moe/work_queues.h"

namespace pounce::moe {

class RankTiles {
 public:
  __device__ const gemm::pipeline::GemmOperands& operands(int gemm) const { return ops_[gemm]; }
  __device__ const TimelineSink& timeline() const { return p_.timeline; }

 protected:
  // n1, n2: the two GEMMs' output widths, in tiles of tile_n columns. ops: shared [2] (see FusedTiles).
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

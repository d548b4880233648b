// Barriers of the fused kernel's phases. Every wait is bounded; a failed wait returns false after the
// error is recorded and the caller's CTA leaves the kernel.
#pragma once

#include "common/bounded_wait.cuh"
#include "moe/fused_params.h"
#include "ptx/ptx.cuh"

namespace pounce::moe {

// Barriers among one rank's CTAs per forward (the planner's count, scan, place steps are separated by
// them, and start protects the schedule buffers of the previous forward).
inline constexpr uint32_t kRankBarriersPerForward = 4;

// All CTAs of one rank (ctas of them) meet. Barrier `index` (1-based) of forward `epoch`: the counter is
// monotonic, so its target is the arrivals of every earlier barrier plus this one.
__device__ inline bool rank_barrier(const FusedParams& p, const RankState& rs, uint32_t index, int32_t* ok_flag) {
  __syncthreads();
  if (threadIdx.x == 0) {
    const uint32_t target = ((epoch(p) - 1) * kRankBarriersPerForward + index) * uint32_t(p.ctas_per_rank);
    __threadfence();  // this CTA's writes (schedule rows, counts) before its arrival
    ptx::red_release_gpu_add(&rs.control[kRankBarrier], 1);
    const WaitSite site{p.error, DeviceRole::kRankSync, p.wait_timeout_ns, rs.rank};
    *ok_flag = counter_wait_bounded(&rs.control[kRankBarrier], target, site, WaitTarget::kRankBarrier, index,
                                    /*max_backoff_ns=*/256);
  }
  __syncthreads();
  return *ok_flag != 0;
}

// One thread per rank, at the start of a forward: publishes this rank's token count to every rank, then
// waits until every rank has started this forward. A rank that has started has finished the previous
// forward, so nobody still reads the x, topk_ids or combine slots this forward overwrites.
__device__ inline bool start_all_ranks(const FusedParams& p, const RankState& rs) {
  for (int r = 0; r < p.ranks; ++r) p.peers.token_counts[r][rs.rank] = rs.tokens;
  ptx::fence_acq_rel_sys();  // the counts before the flags that announce them
  for (int r = 0; r < p.ranks; ++r) ptx::st_release_sys(&p.peers.start_flags[r][rs.rank], epoch(p));
  const WaitSite site{p.error, DeviceRole::kRankSync, p.wait_timeout_ns, rs.rank};
  uint32_t* const flags = p.peers.start_flags[rs.rank];
  for (int r = 0; r < p.ranks; ++r)
    if (!counter_wait_bounded<Scope::kSystem>(&flags[r], epoch(p), site, WaitTarget::kStartFlag, r)) return false;
  return true;
}

}  // namespace pounce::moe

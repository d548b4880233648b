// Weighted sum on the source rank: y[t] = sum_k w[t, k] * slot[t, k], k in order, fp32 accumulation,
// once all k output rows of token t have arrived. Warp-level: a warp takes the next token from the
// rank's ticket, waits (bounded) for its arrivals and sums it. CTAs join once their own queue is empty
// (they then only wait on combine work that other CTAs do), so waiting here never blocks that work.
// In place (p.in_place), the k rows are GEMM2's own output rows in the out ring, found through
// route_row, each ready once its m-block's GEMM2 tiles are stored.
#pragma once

#include <cuda_bf16.h>

#include "common/bounded_wait.cuh"
#include "gemm/gemm_pipeline.cuh"
#include "moe/comm_role.cuh"
#include "moe/fused_params.h"

namespace pounce::moe {

// Lane k < topk of the warp: waits (bounded) until output row k of token t is ready and returns
// where it is (16-byte vectors); false if the wait gave up.
__device__ inline bool find_output_row(const FusedParams& p, const RankState& rs, int lr, int32_t t, int k,
                                       const uint4*& row) {
  const WaitSite site{p.error, DeviceRole::kWeightedSum, p.wait_timeout_ns, rs.rank};
  if (p.in_place) {
    const int32_t r = rs.route_row[int64_t(t) * p.topk + k], m_block = r / gemm::kBlockM;
    const uint32_t n2_blocks = (p.hidden + gemm::kBlockN - 1) / gemm::kBlockN;
    row = reinterpret_cast<const uint4*>(p.out_ring + ring_row(p, lr, m_block, r % gemm::kBlockM) * p.hidden);
    return counter_wait_bounded(&rs.gemm2_done[m_block], p.epoch * 2 * n2_blocks, site, WaitTarget::kGemm2Done,
                                m_block);
  }
  row = reinterpret_cast<const uint4*>(p.peers.slots[rs.rank] + (int64_t(t) * p.topk + k) * p.hidden);
  if (k != 0) return true;  // one wait covers the token: its arrivals count all k rows
  uint32_t* arrivals = p.peers.arrivals[rs.rank];
  const uint32_t target = p.epoch * uint32_t(p.topk);
  return p.peers_on_this_gpu
             ? counter_wait_bounded<Scope::kGpu>(&arrivals[t], target, site, WaitTarget::kTokenArrivals, t)
             : counter_wait_bounded<Scope::kSystem>(&arrivals[t], target, site, WaitTarget::kTokenArrivals, t);
}

__device__ inline void run_weighted_sums(const FusedParams& p, const RankState& rs, int lr) {
  const int lane = threadIdx.x % 32;
  const int64_t vecs = p.hidden / 8;  // 16-byte vectors of 8 bf16 per row
  for (;;) {
    int32_t t = 0;
    if (lane == 0) t = int32_t(atomicAdd(&rs.control[kSumTicket], 1u));
    t = __shfl_sync(0xFFFFFFFFu, t, 0);
    if (t >= rs.tokens) return;
    const uint4* row = nullptr;  // lane k: output row k of token t
    const bool ok = lane >= p.topk || find_output_row(p, rs, lr, t, lane, row);
    __syncwarp();  // orders the lanes' acquires before every lane's reads of the rows
    if (!__all_sync(0xFFFFFFFFu, ok)) return;

    const float* w = rs.topk_weights + int64_t(t) * p.topk;
    // Warp-uniform trip count: every lane takes part in every shuffle (rows need not be a multiple of
    // 32 vectors long).
    for (int64_t first = 0; first < vecs; first += 32) {
      const int64_t v = first + lane;
      float acc[8] = {};
      for (int k = 0; k < p.topk; ++k) {
        const uint4* source = reinterpret_cast<const uint4*>(__shfl_sync(0xFFFFFFFFu, uintptr_t(row), k));
        if (v >= vecs) continue;
        const float wk = w[k];
        const uint4 bits = source[v];
        const __nv_bfloat162* o = reinterpret_cast<const __nv_bfloat162*>(&bits);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const float2 f = __bfloat1622float2(o[q]);
          acc[2 * q] = fmaf(wk, f.x, acc[2 * q]);
          acc[2 * q + 1] = fmaf(wk, f.y, acc[2 * q + 1]);
        }
      }
      if (v >= vecs) continue;
      uint4 result;
      __nv_bfloat162* r = reinterpret_cast<__nv_bfloat162*>(&result);
#pragma unroll
      for (int q = 0; q < 4; ++q) r[q] = __floats2bfloat162_rn(acc[2 * q], acc[2 * q + 1]);
      reinterpret_cast<uint4*>(rs.y)[int64_t(t) * vecs + v] = result;
    }
  }
}

}  // namespace pounce::moe

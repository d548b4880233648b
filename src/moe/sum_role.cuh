// Weighted sum on the source rank: y[t] = sum_k w[t, k] * slot[t, k], k in order, fp32 accumulation,
// once all k output rows of token t have arrived. Warp-level: a warp takes the next token from the
// rank's ticket, waits (bounded) for its arrivals and sums it. CTAs join once their own queue is empty
// (they then only wait on combine work that other CTAs do), so waiting here never blocks that work.
// In place (one rank, nothing combined) the k rows are read where GEMM2 stored them in the ring, once
// their m-blocks' GEMM2 tiles are done: the same values in the same order, so the same bits.
#pragma once

#include <cuda_bf16.h>

#include "common/bounded_wait.cuh"
#include "gemm/grouped_gemm.h"
#include "moe/fused_params.h"

namespace pounce::moe {

__device__ inline void run_weighted_sums(const FusedParams& p, const RankState& rs) {
  const int lane = threadIdx.x % 32;
  const WaitSite site{p.error, DeviceRole::kWeightedSum, p.wait_timeout_ns, rs.rank};
  const uint32_t* arrivals = p.peers.arrivals[rs.rank];
  const uint4* slots = reinterpret_cast<const uint4*>(p.peers.slots[rs.rank]);
  const uint4* ring = reinterpret_cast<const uint4*>(p.out_ring);
  const int64_t vecs = p.hidden / 8;  // 16-byte vectors of 8 bf16 per row
  const uint32_t gemm2_tiles = 2 * uint32_t((p.hidden + gemm::kBlockN - 1) / gemm::kBlockN);
  // Output row k of token t: in place where GEMM2 stored it in the ring, else its combine slot.
  const auto out_row = [&](int32_t t, int k) {
    const int64_t route = int64_t(t) * p.topk + k;
    return p.in_place ? ring + int64_t(rs.route_row[route]) * vecs : slots + route * vecs;
  };
  for (;;) {
    int32_t t = 0;
    if (lane == 0) t = int32_t(atomicAdd(&rs.control[kSumTicket], 1u));
    t = __shfl_sync(0xFFFFFFFFu, t, 0);
    if (t >= rs.tokens) return;
    bool ok = true;
    if (lane == 0 && p.in_place) {
      for (int k = 0; k < p.topk && ok; ++k) {
        const int32_t m_block = rs.route_row[int64_t(t) * p.topk + k] / 128;
        ok = counter_wait_bounded(&rs.gemm2_done[m_block], p.epoch * gemm2_tiles, site, WaitTarget::kGemm2Done, m_block);
      }
    } else if (lane == 0) {
      const uint32_t target = p.epoch * uint32_t(p.topk);
      ok = p.peers_on_this_gpu
               ? counter_wait_bounded<Scope::kGpu>(&arrivals[t], target, site, WaitTarget::kTokenArrivals, t)
               : counter_wait_bounded<Scope::kSystem>(&arrivals[t], target, site, WaitTarget::kTokenArrivals, t);
    }
    ok = __shfl_sync(0xFFFFFFFFu, ok, 0);
    __syncwarp();  // orders lane 0's acquire before every lane's reads of the slots
    if (!ok) return;

    const float* w = rs.topk_weights + int64_t(t) * p.topk;
    for (int64_t v = lane; v < vecs; v += 32) {
      float acc[8] = {};
      for (int k = 0; k < p.topk; ++k) {
        const float wk = w[k];
        const uint4 bits = out_row(t, k)[v];
        const __nv_bfloat162* o = reinterpret_cast<const __nv_bfloat162*>(&bits);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const float2 f = __bfloat1622float2(o[q]);
          acc[2 * q] = fmaf(wk, f.x, acc[2 * q]);
          acc[2 * q + 1] = fmaf(wk, f.y, acc[2 * q + 1]);
        }
      }
      uint4 result;
      __nv_bfloat162* r = reinterpret_cast<__nv_bfloat162*>(&result);
#pragma unroll
      for (int q = 0; q < 4; ++q) r[q] = __floats2bfloat162_rn(acc[2 * q], acc[2 * q + 1]);
      reinterpret_cast<uint4*>(rs.y)[int64_t(t) * vecs + v] = result;
    }
  }
}

}  // namespace pounce::moe

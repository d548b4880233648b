// Weighted sum on the source rank: y[t] = sum_k w[t, k] * slot[t, k], k in order, fp32 accumulation,
// (the backward's dx[t] = sum_k slot[t, k], with w = 1: each fmaf then adds exactly),
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
  // The sums are bound by memory latency: each lane loads kVecsPerLane vectors of kBatch output rows
  // before it adds any, so kBatch * kVecsPerLane loads are in flight per lane instead of one (in GEMM
  // CTAs only the consumer warps sum: the producer warps gave their registers away).
  constexpr int kBatch = 8, kVecsPerLane = 2;
  constexpr uint32_t kAll = 0xFFFFFFFFu;
  const int lane = threadIdx.x % 32;
  const WaitSite site{p.error, DeviceRole::kWeightedSum, p.wait_timeout_ns, rs.rank};
  const uint32_t* arrivals = p.peers.arrivals[rs.rank];
  // In place the k rows are where GEMM2 stored them in the ring, else in the token's combine slots.
  const uint4* rows = reinterpret_cast<const uint4*>(p.in_place ? p.out_ring : p.peers.slots[rs.rank]);
  const int64_t vecs = p.hidden / 8;  // 16-byte vectors of 8 bf16 per row
  for (;;) {
    int32_t t = 0;
    if (lane == 0) t = int32_t(atomicAdd(&rs.control[kSumTicket], 1u));
    t = __shfl_sync(kAll, t, 0);
    if (t >= rs.tokens) return;

    // Row of output k of token t, and its weight; lane j holds those of k = j (the first 32).
    const float* w = p.backward ? nullptr : rs.topk_weights + int64_t(t) * p.topk;
    const auto row_of = [&](int k) {
      const int64_t route = int64_t(t) * p.topk + k;
      return p.in_place ? int64_t(rs.route_row[route]) : route;
    };
    const int64_t lane_row = lane < p.topk ? row_of(lane) : 0;
    const float lane_weight = lane >= p.topk ? 0.0f : w != nullptr ? w[lane] : 1.0f;

    bool ok = true;
    if (p.in_place) {
      for (int k = lane; k < p.topk && ok; k += 32) {
        const int64_t m_block = (k == lane ? lane_row : row_of(k)) / kBlockM;
        ok = counter_wait_bounded(&rs.gemm2_done[m_block], epoch(p) * p.steps.gemm2_done, site, WaitTarget::kGemm2Done,
                                  m_block);
      }
    } else if (lane == 0) {
      const uint32_t target = epoch(p) * p.steps.arrivals;
      ok = p.peers_on_this_gpu
               ? counter_wait_bounded<Scope::kGpu>(&arrivals[t], target, site, WaitTarget::kTokenArrivals, t)
               : counter_wait_bounded<Scope::kSystem>(&arrivals[t], target, site, WaitTarget::kTokenArrivals, t);
    }
    ok = __all_sync(kAll, ok);
    __syncwarp();  // orders the waiting lanes' acquires before every lane's reads of the rows
    if (!ok) return;

    // Every lane runs every iteration (lanes past the row's end load nothing): the shuffles need the
    // whole warp.
    for (int64_t v0 = 0; v0 < vecs; v0 += 32 * kVecsPerLane) {
      float acc[kVecsPerLane][8] = {};
      for (int k0 = 0; k0 < p.topk; k0 += kBatch) {
        // Conditionally loaded: initialized so no value is carried across iterations.
        uint4 bits[kBatch][kVecsPerLane] = {};
#pragma unroll
        for (int j = 0; j < kBatch; ++j) {
          const int k = k0 + j;  // warp-uniform
          if (k >= p.topk) continue;
          const int64_t row = k < 32 ? __shfl_sync(kAll, lane_row, k) : row_of(k);
#pragma unroll
          for (int u = 0; u < kVecsPerLane; ++u) {
            const int64_t v = v0 + u * 32 + lane;
            if (v < vecs) bits[j][u] = rows[row * vecs + v];
          }
        }
#pragma unroll
        for (int j = 0; j < kBatch; ++j) {
          const int k = k0 + j;
          if (k >= p.topk) continue;  // not break: the loop must unroll for bits[] to stay in registers
          const float wk = k < 32 ? __shfl_sync(kAll, lane_weight, k) : w != nullptr ? w[k] : 1.0f;
#pragma unroll
          for (int u = 0; u < kVecsPerLane; ++u) {
            const __nv_bfloat162* o = reinterpret_cast<const __nv_bfloat162*>(&bits[j][u]);
#pragma unroll
            for (int q = 0; q < 4; ++q) {
              const float2 f = __bfloat1622float2(o[q]);
              acc[u][2 * q] = fmaf(wk, f.x, acc[u][2 * q]);
              acc[u][2 * q + 1] = fmaf(wk, f.y, acc[u][2 * q + 1]);
            }
          }
        }
      }
#pragma unroll
      for (int u = 0; u < kVecsPerLane; ++u) {
        const int64_t v = v0 + u * 32 + lane;
        if (v >= vecs) continue;
        uint4 result;
        __nv_bfloat162* r = reinterpret_cast<__nv_bfloat162*>(&result);
#pragma unroll
        for (int q = 0; q < 4; ++q) r[q] = __floats2bfloat162_rn(acc[u][2 * q], acc[u][2 * q + 1]);
        reinterpret_cast<uint4*>(rs.y)[int64_t(t) * vecs + v] = result;
      }
    }
  }
}

}  // namespace pounce::moe

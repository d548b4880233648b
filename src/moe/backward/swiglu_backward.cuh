// The SwiGLU backward of routed rows, by warps: shared by the backward chain's kernel
// (moe/backward/backward_kernels.cu) and the fused backward's elementwise items
// (moe/fused_backward_tiles.cuh), so both give the same bits. Rows are 16-byte groups of 8 columns:
// gate/up rows h13 [2I] interleave 8 gate and 8 up columns, da and wa are [I], dgu is laid out like h13.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "moe/backward/backward_kernels.h"
#include "ptx/ptx.cuh"

namespace pounce::moe::backward {

// The forward's sigmoid (gemm/gemm_pipeline.cuh: silu): a = silu(g) u below is, before rounding, the
// activation the forward fed to the down projection. Three instructions where exp and an IEEE divide
// took about fifteen: in the fused backward the elementwise items run on one SM's 8 consumer warps,
// which the divide's latency left waiting.
__device__ __forceinline__ float sigmoid(float g) { return fmaf(0.5f, ptx::tanh_approx(0.5f * g), 0.5f); }

// A row's router-weight gradient <da, a> is summed in segments of kSegmentGroups groups: each lane over
// its groups of the segment, a butterfly over the warp, then the segments' sums added in order from 0.
// The fused backward hands a row's segments to different warps (moe/fused_backward_tiles.cuh); summing
// both paths this way gives them the same bits.

// One segment of `groups` (at most kSegmentGroups) groups, by one warp.
// a = silu(g) u;  dgu = [w da u silu'(g), w da silu(g)];  wa = w a. Returns the segment's share of
// <da, a> (exact when w = 0); every lane returns the same value.
__device__ __forceinline__ float swiglu_backward_segment(const uint4* __restrict__ h13, const uint4* __restrict__ da,
                                                         float w, int groups, uint4* __restrict__ dgu,
                                                         uint4* __restrict__ wa, int lane) {
  float dot = 0.0f;
#pragma unroll 4
  for (int j = lane; j < groups; j += 32) {
    const uint4 g_bits = h13[2 * j], u_bits = h13[2 * j + 1], d_bits = da[j];
    const __nv_bfloat162* g2 = reinterpret_cast<const __nv_bfloat162*>(&g_bits);
    const __nv_bfloat162* u2 = reinterpret_cast<const __nv_bfloat162*>(&u_bits);
    const __nv_bfloat162* d2 = reinterpret_cast<const __nv_bfloat162*>(&d_bits);
    uint4 dg_bits, du_bits, wa_bits;
    __nv_bfloat162* dg2 = reinterpret_cast<__nv_bfloat162*>(&dg_bits);
    __nv_bfloat162* du2 = reinterpret_cast<__nv_bfloat162*>(&du_bits);
    __nv_bfloat162* wa2 = reinterpret_cast<__nv_bfloat162*>(&wa_bits);
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const float2 g = __bfloat1622float2(g2[p]), u = __bfloat1622float2(u2[p]), d = __bfloat1622float2(d2[p]);
      const float sx = sigmoid(g.x), sy = sigmoid(g.y);
      const float ax = g.x * sx * u.x, ay = g.y * sy * u.y;  // a = silu(g) u
      dot = fmaf(d.x, ax, dot);
      dot = fmaf(d.y, ay, dot);
      const float dx = w * d.x, dy = w * d.y;  // the route's share of dy, through W2
      // silu'(g) = s (1 + g (1 - s))
      dg2[p] =
          __floats2bfloat162_rn(dx * u.x * sx * (1.0f + g.x * (1.0f - sx)), dy * u.y * sy * (1.0f + g.y * (1.0f - sy)));
      du2[p] = __floats2bfloat162_rn(dx * g.x * sx, dy * g.y * sy);
      wa2[p] = __floats2bfloat162_rn(w * ax, w * ay);
    }
    dgu[2 * j] = dg_bits;
    dgu[2 * j + 1] = du_bits;
    wa[j] = wa_bits;
  }
  for (int offset = 16; offset > 0; offset /= 2) dot += __shfl_xor_sync(0xFFFFFFFFu, dot, offset);
  return dot;
}

// A whole row of `groups` groups, by one warp: returns <da, a>.
__device__ __forceinline__ float swiglu_backward_row(const uint4* __restrict__ h13, const uint4* __restrict__ da,
                                                     float w, int64_t groups, uint4* __restrict__ dgu,
                                                     uint4* __restrict__ wa, int lane) {
  float dot = 0.0f;
  for (int64_t s = 0; s < groups; s += kSegmentGroups) {
    const int n = int(groups - s < kSegmentGroups ? groups - s : kSegmentGroups);
    dot += swiglu_backward_segment(h13 + 2 * s, da + s, w, n, dgu + 2 * s, wa + s, lane);
  }
  return dot;
}

// A padding row: zero dgu and wa (the weight-gradient GEMMs sum every row of an expert's m-blocks).
__device__ __forceinline__ void swiglu_backward_padding_row(int64_t groups, uint4* dgu, uint4* wa, int lane) {
  const uint4 zero = make_uint4(0, 0, 0, 0);
  for (int64_t j = lane; j < groups; j += 32) {
    dgu[2 * j] = dgu[2 * j + 1] = zero;
    wa[j] = zero;
  }
}

}  // namespace pounce::moe::backward

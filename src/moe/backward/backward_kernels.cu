#include <algorithm>

#include "common/cuda_check.h"
#include "common/require.h"
#include "formats/quantize_device.cuh"
#include "moe/backward/backward_kernels.h"
#include "moe/backward/swiglu_backward.cuh"

namespace pounce::moe::backward {
namespace {

constexpr int kThreads = 256;
constexpr int kVec = 8;  // bf16 per 16-byte access

// Enough CTAs to fill an H200 several times over; kernels stride over the rest.
int grid_for(int64_t items) { return int(std::clamp<int64_t>(items, 1, 132 * 16)); }

__global__ void set_plan_inputs_kernel(const int32_t** ids_table, int32_t* token_counts, const RouteSources sources,
                                       int ranks) {
  for (int s = 0; s < ranks; ++s) {
    ids_table[s] = sources.topk_ids[s];
    token_counts[s] = sources.tokens[s];
  }
}

using formats::quantize_device::quantize_chunk;  // bit for bit quantize_1x128_device's, chunk by chunk
using formats::quantize_device::ScaleSlots;

// Fp8Rows' scales for rows of `vecs` chunks: K block-major over `rows`.
__device__ __forceinline__ ScaleSlots fp8_row_slots(int64_t rows, int64_t vecs) {
  return {vecs * kVec / formats::kActivationBlock, rows};
}

// The vector loop runs the same trip count on every thread (chunks past the row only skip their
// stores), so that the FP8 quantizer's shuffles see whole warps: vecs is a multiple of 16 then.
__global__ void gather_kernel(const RouteSources sources, const int32_t* row_source_rank, const int32_t* row_token,
                              const int32_t* row_k, int64_t rows, int64_t vecs, int64_t topk, uint4* x_rows,
                              bool gather_x, uint4* dy_rows, float* row_weight, Fp8Rows dy_fp8) {
  const uint4 zero = make_uint4(0, 0, 0, 0);
  const ScaleSlots dy_slots = fp8_row_slots(rows, vecs);
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int32_t t = row_token[r], s = t >= 0 ? row_source_rank[r] : 0;
    const uint4* x = reinterpret_cast<const uint4*>(sources.x[s]);
    const uint4* dy = reinterpret_cast<const uint4*>(sources.dy[s]);
    if (row_weight != nullptr && threadIdx.x == 0)
      row_weight[r] = t >= 0 ? sources.topk_weights[s][t * topk + row_k[r]] : 0.0f;
    for (int64_t base = 0; base < vecs; base += blockDim.x) {
      const int64_t v = base + threadIdx.x;
      const bool active = v < vecs;
      uint4 dy_value = zero;
      if (active) {
        if (gather_x || t < 0) x_rows[r * vecs + v] = t >= 0 ? x[t * vecs + v] : zero;
        if (dy_rows != nullptr) {
          if (t >= 0) dy_value = dy[t * vecs + v];
          dy_rows[r * vecs + v] = dy_value;
        }
      }
      if (dy_fp8.data != nullptr)
        quantize_chunk<false>(dy_value, r * vecs + v, active, dy_fp8.data, dy_fp8.scales, dy_slots);
    }
  }
}

__global__ void scatter_kernel(const uint4* dx_rows, const float* route_dot, const int32_t* row_source_rank,
                               const int32_t* row_token, const int32_t* row_k, int64_t rows, int64_t vecs, int64_t topk,
                               const RouteTargets targets) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int32_t t = row_token[r];
    if (t < 0) continue;
    const int32_t s = row_source_rank[r];
    const int64_t slot = int64_t(t) * topk + row_k[r];
    if (threadIdx.x == 0) targets.d_topk_weights[s][slot] = route_dot[r];
    uint4* to = reinterpret_cast<uint4*>(targets.slots[s]) + slot * vecs;
    for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) to[v] = dx_rows[r * vecs + v];
  }
}

// A row of `vecs` chunks (a multiple of 32) that this warp has just written, quantized by the same warp
// (read back from L2). NOTES: __syncwarp orders the lanes' stores of the row before the other lanes'
// loads of it.
__device__ __forceinline__ void quantize_row(const uint4* row, int64_t first_chunk, int64_t vecs, Fp8Rows out,
                                             ScaleSlots slots, int lane) {
  __syncwarp();
  for (int64_t v = lane; v < vecs; v += 32)
    quantize_chunk<false>(row[v], first_chunk + v, true, out.data, out.scales, slots);
}

// One warp per row (moe/backward/swiglu_backward.cuh), each lane owning groups of 8 intermediate columns:
// a CTA per row left most of its threads idle at small I (Qwen3-30B's 768 is 96 groups a row).
__global__ void swiglu_backward_kernel(const uint4* __restrict__ h13, const uint4* __restrict__ da,
                                       const float* __restrict__ row_weight, const int32_t* __restrict__ row_token,
                                       int64_t rows, int64_t groups, uint4* __restrict__ dgu, uint4* __restrict__ wa,
                                       float* __restrict__ route_dot, Fp8Rows dgu_fp8) {
  constexpr int kWarps = kThreads / 32;
  const int lane = threadIdx.x % 32;
  const ScaleSlots slots = fp8_row_slots(rows, groups * 2);
  for (int64_t r = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32; r < rows; r += int64_t(gridDim.x) * kWarps) {
    if (row_token[r] < 0) {  // padding: zeros, whatever h13 holds there
      swiglu_backward_padding_row(groups, dgu + r * groups * 2, wa + r * groups, lane);
      if (lane == 0) route_dot[r] = 0.0f;
      if (dgu_fp8.data != nullptr) quantize_row(dgu + r * groups * 2, r * groups * 2, groups * 2, dgu_fp8, slots, lane);
      continue;
    }
    const float dot = swiglu_backward_row(h13 + r * groups * 2, da + r * groups, row_weight[r], groups,
                                          dgu + r * groups * 2, wa + r * groups, lane);
    if (lane == 0) route_dot[r] = dot;
    if (dgu_fp8.data != nullptr) quantize_row(dgu + r * groups * 2, r * groups * 2, groups * 2, dgu_fp8, slots, lane);
  }
}

__global__ void combine_kernel(const uint4* dx_rows, const float* route_dot, const int32_t* route_row, int64_t tokens,
                               int64_t topk, int64_t vecs, uint4* dx, float* d_topk_weights) {
  const auto row_of = [&](int64_t route) { return route_row != nullptr ? int64_t(route_row[route]) : route; };
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    if (route_dot != nullptr)
      for (int64_t k = threadIdx.x; k < topk; k += blockDim.x)
        d_topk_weights[t * topk + k] = route_dot[row_of(t * topk + k)];
    for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) {
      float acc[kVec] = {};
      for (int64_t k = 0; k < topk; ++k) {  // fixed k order: bitwise deterministic
        const uint4 bits = dx_rows[row_of(t * topk + k) * vecs + v];
        const __nv_bfloat162* d = reinterpret_cast<const __nv_bfloat162*>(&bits);
#pragma unroll
        for (int p = 0; p < kVec / 2; ++p) {
          const float2 f = __bfloat1622float2(d[p]);
          acc[2 * p] += f.x;
          acc[2 * p + 1] += f.y;
        }
      }
      uint4 out;
      __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
      for (int p = 0; p < kVec / 2; ++p) o[p] = __floats2bfloat162_rn(acc[2 * p], acc[2 * p + 1]);
      dx[t * vecs + v] = out;
    }
  }
}

}  // namespace

void set_plan_inputs(const int32_t** ids_table, int32_t* token_counts, const RouteSources& sources, int ranks,
                     cudaStream_t stream) {
  set_plan_inputs_kernel<<<1, 1, 0, stream>>>(ids_table, token_counts, sources, ranks);
  CUDA_CHECK_LAUNCH();
}

void gather_route_rows(const RouteSources& sources, const int32_t* row_source_rank, const int32_t* row_token,
                       const int32_t* row_k, int64_t rows, int64_t hidden, int64_t topk, __nv_bfloat16* x_rows,
                       bool gather_x, __nv_bfloat16* dy_rows, float* row_weight, cudaStream_t stream, Fp8Rows dy_fp8) {
  POUNCE_REQUIRE(dy_fp8.data == nullptr || (dy_fp8.scales != nullptr && dy_rows != nullptr && hidden % 128 == 0),
                 "gather_route_rows: quantized dy rows need their scales, the bf16 dy rows and H = ", hidden,
                 " a multiple of 128");
  if (rows == 0) return;
  gather_kernel<<<grid_for(rows), kThreads, 0, stream>>>(
      sources, row_source_rank, row_token, row_k, rows, hidden / kVec, topk, reinterpret_cast<uint4*>(x_rows), gather_x,
      reinterpret_cast<uint4*>(dy_rows), row_weight, dy_fp8);
  CUDA_CHECK_LAUNCH();
}

void scatter_route_rows(const __nv_bfloat16* dx_rows, const float* route_dot, const int32_t* row_source_rank,
                        const int32_t* row_token, const int32_t* row_k, int64_t rows, int64_t hidden, int64_t topk,
                        const RouteTargets& targets, cudaStream_t stream) {
  if (rows == 0) return;
  scatter_kernel<<<grid_for(rows), kThreads, 0, stream>>>(reinterpret_cast<const uint4*>(dx_rows), route_dot,
                                                          row_source_rank, row_token, row_k, rows, hidden / kVec, topk,
                                                          targets);
  CUDA_CHECK_LAUNCH();
}

void swiglu_backward_rows(const __nv_bfloat16* h13, const __nv_bfloat16* da, const float* row_weight,
                          const int32_t* row_token, int64_t rows, int64_t intermediate, __nv_bfloat16* dgu,
                          __nv_bfloat16* wa, float* route_dot, cudaStream_t stream, Fp8Rows dgu_fp8) {
  POUNCE_REQUIRE(dgu_fp8.data == nullptr || (dgu_fp8.scales != nullptr && intermediate % 128 == 0),
                 "swiglu_backward_rows: quantized dgu rows need their scales and I = ", intermediate,
                 " a multiple of 128");
  if (rows == 0) return;
  swiglu_backward_kernel<<<grid_for((rows + kThreads / 32 - 1) / (kThreads / 32)), kThreads, 0, stream>>>(
      reinterpret_cast<const uint4*>(h13), reinterpret_cast<const uint4*>(da), row_weight, row_token, rows,
      intermediate / kVec, reinterpret_cast<uint4*>(dgu), reinterpret_cast<uint4*>(wa), route_dot, dgu_fp8);
  CUDA_CHECK_LAUNCH();
}

void combine_gradients(const __nv_bfloat16* dx_rows, const float* route_dot, const int32_t* route_row, int64_t tokens,
                       int64_t topk, int64_t hidden, __nv_bfloat16* dx, float* d_topk_weights, cudaStream_t stream) {
  if (tokens == 0) return;
  combine_kernel<<<grid_for(tokens), kThreads, 0, stream>>>(reinterpret_cast<const uint4*>(dx_rows), route_dot,
                                                            route_row, tokens, topk, hidden / kVec,
                                                            reinterpret_cast<uint4*>(dx), d_topk_weights);
  CUDA_CHECK_LAUNCH();
}

}  // namespace pounce::moe::backward

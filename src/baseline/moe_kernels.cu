#include <algorithm>

#include "baseline/moe_kernels.h"
#include "common/cuda_check.h"

namespace pounce::baseline {

namespace {

constexpr int kThreads = 256;
constexpr int kVec = 8;  // bf16 per 16-byte access

// Enough CTAs to fill an H200 several times over; kernels stride over the rest.
int grid_for(int64_t items) { return int(std::clamp<int64_t>(items, 1, 132 * 16)); }

__global__ void permute_rows_kernel(const uint4* x, const int32_t* row_token, int64_t rows, int64_t vecs_per_row,
                                    uint4* pool) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int32_t t = row_token[r];
    for (int64_t v = threadIdx.x; v < vecs_per_row; v += blockDim.x)
      pool[r * vecs_per_row + v] = t >= 0 ? x[t * vecs_per_row + v] : make_uint4(0, 0, 0, 0);
  }
}

__global__ void gather_values_kernel(const float* src, const int32_t* index, int64_t n, float* dst) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int32_t from = index[i];
    dst[i] = from >= 0 ? src[from] : 0.0f;
  }
}

__device__ __forceinline__ float silu(float g) { return g / (1.0f + __expf(-g)); }

__global__ void swiglu_kernel(const uint4* h13, int64_t groups_per_row, int64_t total_groups, uint4* hidden) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total_groups;
       i += int64_t(gridDim.x) * blockDim.x) {
    // Group j of row r: gate values at h13 vector 2j, the matching up values at 2j + 1.
    const int64_t r = i / groups_per_row, j = i % groups_per_row;
    const uint4 gate_bits = h13[(r * groups_per_row + j) * 2];
    const uint4 up_bits = h13[(r * groups_per_row + j) * 2 + 1];
    const __nv_bfloat162* gate = reinterpret_cast<const __nv_bfloat162*>(&gate_bits);
    const __nv_bfloat162* up = reinterpret_cast<const __nv_bfloat162*>(&up_bits);
    uint4 out_bits;
    __nv_bfloat162* out = reinterpret_cast<__nv_bfloat162*>(&out_bits);
    for (int p = 0; p < kVec / 2; ++p) {
      const float2 g = __bfloat1622float2(gate[p]), u = __bfloat1622float2(up[p]);
      out[p] = __floats2bfloat162_rn(silu(g.x) * u.x, silu(g.y) * u.y);
    }
    hidden[i] = out_bits;
  }
}

__global__ void weighted_combine_kernel(const uint4* out, const int32_t* route_row, const float* topk_weights,
                                        int64_t tokens, int64_t topk, int64_t vecs_per_row, uint4* y) {
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    for (int64_t v = threadIdx.x; v < vecs_per_row; v += blockDim.x) {
      float acc[kVec] = {};
      for (int64_t k = 0; k < topk; ++k) {  // fixed k order: bitwise deterministic
        const float w = topk_weights[t * topk + k];
        const uint4 bits = out[route_row[t * topk + k] * vecs_per_row + v];
        const __nv_bfloat162* o = reinterpret_cast<const __nv_bfloat162*>(&bits);
        for (int p = 0; p < kVec / 2; ++p) {
          const float2 f = __bfloat1622float2(o[p]);
          acc[2 * p] += w * f.x;
          acc[2 * p + 1] += w * f.y;
        }
      }
      uint4 result;
      __nv_bfloat162* r = reinterpret_cast<__nv_bfloat162*>(&result);
      for (int p = 0; p < kVec / 2; ++p) r[p] = __floats2bfloat162_rn(acc[2 * p], acc[2 * p + 1]);
      y[t * vecs_per_row + v] = result;
    }
  }
}

}  // namespace

void permute_rows(const __nv_bfloat16* x, const int32_t* row_token, int64_t rows, int64_t hidden, __nv_bfloat16* pool,
                  cudaStream_t stream) {
  POUNCE_REQUIRE(hidden % kVec == 0, "permute_rows: hidden = ", hidden, " must be a multiple of ", kVec);
  if (rows == 0) return;
  permute_rows_kernel<<<grid_for(rows), kThreads, 0, stream>>>(reinterpret_cast<const uint4*>(x), row_token, rows,
                                                               hidden / kVec, reinterpret_cast<uint4*>(pool));
  CUDA_CHECK_LAUNCH();
}

void swiglu_rows(const __nv_bfloat16* h13, int64_t rows, int64_t intermediate, __nv_bfloat16* hidden,
                 cudaStream_t stream) {
  POUNCE_REQUIRE(intermediate % kVec == 0, "swiglu_rows: intermediate = ", intermediate, " must be a multiple of 8");
  const int64_t total = rows * intermediate / kVec;
  if (total == 0) return;
  swiglu_kernel<<<grid_for((total + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      reinterpret_cast<const uint4*>(h13), intermediate / kVec, total, reinterpret_cast<uint4*>(hidden));
  CUDA_CHECK_LAUNCH();
}

void gather_values(const float* src, const int32_t* index, int64_t n, float* dst, cudaStream_t stream) {
  if (n == 0) return;
  gather_values_kernel<<<grid_for((n + kThreads - 1) / kThreads), kThreads, 0, stream>>>(src, index, n, dst);
  CUDA_CHECK_LAUNCH();
}

void weighted_combine(const __nv_bfloat16* out, const int32_t* route_row, const float* topk_weights, int64_t tokens,
                      int64_t topk, int64_t hidden, __nv_bfloat16* y, cudaStream_t stream) {
  POUNCE_REQUIRE(hidden % kVec == 0, "weighted_combine: hidden = ", hidden, " must be a multiple of ", kVec);
  if (tokens == 0) return;
  weighted_combine_kernel<<<grid_for(tokens), kThreads, 0, stream>>>(reinterpret_cast<const uint4*>(out), route_row,
                                                                     topk_weights, tokens, topk, hidden / kVec,
                                                                     reinterpret_cast<uint4*>(y));
  CUDA_CHECK_LAUNCH();
}

}  // namespace pounce::baseline

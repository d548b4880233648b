// The small data-movement kernels of an unfused MoE forward: gather tokens into the expert-contiguous
// pool, SwiGLU over an interleaved gate/up output, and the weighted combine back to token order (and,
// for the unfused expert-parallel backward, one float per row into another row order).
// Shared by the cuBLAS baseline and pounce's own unfused chain.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace pounce::baseline {

// pool[r] = x[row_token[r]]; rows whose token is -1 (padding up to a 128-row m-block) are zero-filled,
// so a GEMM may read them as data harmlessly.
void permute_rows(const __nv_bfloat16* x, const int32_t* row_token, int64_t rows, int64_t hidden, __nv_bfloat16* pool,
                  cudaStream_t stream);

// hidden[r, i] = silu(gate) * up from the interleaved GEMM1 output h13 [rows, 2I] (groups of 8).
void swiglu_rows(const __nv_bfloat16* h13, int64_t rows, int64_t intermediate, __nv_bfloat16* hidden,
                 cudaStream_t stream);

// dst[i] = src[index[i]], or 0 where index[i] is -1: one float per row (router weights, route dots) into
// another row order.
void gather_values(const float* src, const int32_t* index, int64_t n, float* dst, cudaStream_t stream);

// y[t] = sum_k w[t,k] * out[route_row[t*K + k]], k in order, fp32 accumulation, bf16 result.
void weighted_combine(const __nv_bfloat16* out, const int32_t* route_row, const float* topk_weights, int64_t tokens,
                      int64_t topk, int64_t hidden, __nv_bfloat16* y, cudaStream_t stream);

}  // namespace pounce::baseline

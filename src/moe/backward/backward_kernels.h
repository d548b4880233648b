// The data-movement and elementwise kernels of the MoE backward, around its four grouped GEMMs
// (moe/backward/backward_chain.h). Rows are routed rows of the expert-contiguous schedule
// (planner/schedule.h); padding rows come out zero so the weight-gradient GEMMs may sum them.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "pounce/config.h"

namespace pounce::moe::backward {

// A routed row's router-weight gradient <da, a> is summed in segments of this many 16-byte groups (1024
// columns): each segment by one warp, the segments' sums then added in order (swiglu_backward.cuh).
inline constexpr int kSegmentGroups = 128;
constexpr int64_t segments_per_row(int64_t groups) { return (groups + kSegmentGroups - 1) / kSegmentGroups; }

// Every source rank's tensors a backward reads, by value (kernel arguments: a CUDA graph replays them
// with the values of its capture).
struct RouteSources {
  const int32_t* topk_ids[kMaxRanks];
  int32_t tokens[kMaxRanks];
  const __nv_bfloat16* x[kMaxRanks];     // [tokens, H]
  const __nv_bfloat16* dy[kMaxRanks];    // [tokens, H]
  const float* topk_weights[kMaxRanks];  // [tokens, k]
};

// Where each route's results go on its source rank: its dx row into slot [token, k] (more ranks) and
// its router-weight gradient.
struct RouteTargets {
  __nv_bfloat16* slots[kMaxRanks];   // [tokens, k, H]
  float* d_topk_weights[kMaxRanks];  // [tokens, k]
};

// Rows quantized to E4M3 as they are written (the FP8 data gradients' A operands): data [rows, cols] and
// 1 x 128 power-of-two scales K block-major [cols / 128, rows] (as the FP8 grouped GEMM reads them, its
// a_rows being these rows), bit for bit quantize_1x128_device of the bf16 rows with ScaleLayout{rows}
// (formats/quantize_kernel.h). cols must be a multiple of 128. Null: none.
struct Fp8Rows {
  uint8_t* data = nullptr;
  float* scales = nullptr;
};

// Writes the planner's inputs for `ranks` source ranks (their topk_ids pointers and token counts) in
// stream order.
void set_plan_inputs(const int32_t** ids_table, int32_t* token_counts, const RouteSources& sources, int ranks,
                     cudaStream_t stream);

// For every schedule row r < rows, route (s, t, j) = (row_source_rank, row_token, row_k):
// x_rows[r] = x[s][t], dy_rows[r] = dy[s][t], row_weight[r] = topk_weights[s][t, j]; padding rows
// (token -1) and rows past the schedule get zeros. gather_x false: x_rows holds its rows already (a kept
// forward's ring), and only its padding rows are zeroed: they may hold any earlier row, and the weight
// gradients sum them. dy_rows and row_weight may be null (the fused backward gathered dy itself).
// dy_fp8: the dy rows quantized as well (with dy_rows).
void gather_route_rows(const RouteSources& sources, const int32_t* row_source_rank, const int32_t* row_token,
                       const int32_t* row_k, int64_t rows, int64_t hidden, int64_t topk, __nv_bfloat16* x_rows,
                       bool gather_x, __nv_bfloat16* dy_rows, float* row_weight, cudaStream_t stream,
                       Fp8Rows dy_fp8 = {});

// SwiGLU backward of every row, from the gate/up rows h13 [rows, 2I] (interleaved in groups of 8), the
// unscaled da = dy . W2 [rows, I] and the route's weight w:
//   a = silu(g) u;  route_dot[r] = <da, a> (the router-weight gradient, exact when w = 0)
//   dgu = [w da u silu'(g), w da silu(g)] interleaved like h13;   wa = w a (for dW2)
// Each row's dot is summed in a fixed order (bitwise deterministic). Rows with w = 0 give zero dgu and
// wa; padding rows (row_token -1) give zeros without reading h13, which may be anything there.
// dgu_fp8: dgu quantized as well, each row right after its warp wrote it (its bf16 still in L2).
void swiglu_backward_rows(const __nv_bfloat16* h13, const __nv_bfloat16* da, const float* row_weight,
                          const int32_t* row_token, int64_t rows, int64_t intermediate, __nv_bfloat16* dgu,
                          __nv_bfloat16* wa, float* route_dot, cudaStream_t stream, Fp8Rows dgu_fp8 = {});

// dx[t] = sum_k dx_rows[route_row[t, k]] (k in order, fp32) and d_topk_weights[t, k] =
// route_dot[route_row[t, k]]. Without route_row, dx_rows are the token's k slots [tokens, k, H] in
// order; without route_dot, d_topk_weights is not written.
void combine_gradients(const __nv_bfloat16* dx_rows, const float* route_dot, const int32_t* route_row, int64_t tokens,
                       int64_t topk, int64_t hidden, __nv_bfloat16* dx, float* d_topk_weights, cudaStream_t stream);

// More ranks: every schedule row's dx row to slot [token, k] of its source rank and its route dot to
// that rank's d_topk_weights; padding rows are skipped.
void scatter_route_rows(const __nv_bfloat16* dx_rows, const float* route_dot, const int32_t* row_source_rank,
                        const int32_t* row_token, const int32_t* row_k, int64_t rows, int64_t hidden, int64_t topk,
                        const RouteTargets& targets, cudaStream_t stream);

}  // namespace pounce::moe::backward

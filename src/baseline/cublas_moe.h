// The unfused MoE forward built from cuBLAS, as today's training stacks run it: permute tokens into
// expert-contiguous rows, GEMM1 (gate/up) per expert, SwiGLU, GEMM2 (down) per expert, then a
// weighted combine back to token order. It is the baseline pounce's fused kernels are measured
// against, and its small kernels are pounce's own unfused chain.
//
// The routing plan (host planner, P = 1) is built and uploaded by set_routing(), outside forward():
// a loop of cuBLAS GEMMs needs per-expert row counts on the host, which a real stack pays for with a
// device-to-host sync every step. Timing forward() alone therefore favours this baseline.
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <span>
#include <vector>

#include "common/device_buffer.h"

namespace pounce::baseline {

struct MoeDims {
  int64_t max_tokens = 0;
  int64_t hidden = 0;
  int64_t intermediate = 0;
  int64_t experts = 0;
  int64_t topk = 0;
};

enum class GemmCalls {
  kLoop,            // one cublasGemmEx per expert (Megatron's sequential MLP)
  kGroupedBatched,  // one cublasGemmGroupedBatchedEx for all experts
};
const char* gemm_calls_name(GemmCalls calls);

// Gathers x rows into the expert-contiguous pool: pool[r] = x[row_token[r]]; rows whose token is -1
// (padding up to a 128-row m-block) are zero-filled, so a GEMM may read them as data harmlessly.
void permute_rows(const __nv_bfloat16* x, const int32_t* row_token, int64_t rows, int64_t hidden,
                  __nv_bfloat16* pool, cudaStream_t stream);

// hidden[r, i] = silu(gate) * up from the interleaved GEMM1 output h13 [rows, 2I] (groups of 8).
void swiglu_rows(const __nv_bfloat16* h13, int64_t rows, int64_t intermediate, __nv_bfloat16* hidden,
                 cudaStream_t stream);

// y[t] = sum_k w[t,k] * out[route_row[t*K + k]], k in order, fp32 accumulation, bf16 result.
void weighted_combine(const __nv_bfloat16* out, const int32_t* route_row, const float* topk_weights, int64_t tokens,
                      int64_t topk, int64_t hidden, __nv_bfloat16* y, cudaStream_t stream);

class CublasMoe {
 public:
  explicit CublasMoe(const MoeDims& dims);
  ~CublasMoe();
  CublasMoe(const CublasMoe&) = delete;
  CublasMoe& operator=(const CublasMoe&) = delete;

  // w13 [E, 2I, H] (gate/up interleaved in groups of 8), w2 [E, H, I]; device pointers kept, not copied.
  void set_weights(const __nv_bfloat16* w13, const __nv_bfloat16* w2);
  // topk_ids [tokens, k] (host). Validates them, plans, and uploads the plan.
  void set_routing(std::span<const int32_t> topk_ids, int64_t tokens);
  // x [tokens, H], topk_weights [tokens, k], y [tokens, H]: device pointers. No host synchronization.
  void forward(const __nv_bfloat16* x, const float* topk_weights, __nv_bfloat16* y, GemmCalls calls,
               cudaStream_t stream);

  int64_t routes() const { return routes_; }
  int64_t padded_rows() const { return padded_rows_; }

 private:
  void gemm(GemmCalls calls, int which);  // which: 0 = GEMM1 (gate/up), 1 = GEMM2 (down)

  MoeDims dims_;
  cublasHandle_t handle_ = nullptr;
  const __nv_bfloat16* w13_ = nullptr;
  const __nv_bfloat16* w2_ = nullptr;
  bool has_routing_ = false;
  int64_t tokens_ = 0, routes_ = 0, padded_rows_ = 0;
  std::vector<int32_t> expert_routes_, expert_offsets_;  // host copies: cuBLAS takes shapes from the host
  DeviceBuffer<int32_t> row_token_, route_row_;
  DeviceBuffer<__nv_bfloat16> pool_, h13_, hidden_, out_;
  // Grouped-batched call arguments for GEMM1 and GEMM2 (index 0 and 1), non-empty experts only.
  struct Grouped {
    std::vector<int> m, n, k, lda, ldb, ldc, group_size;
    std::vector<cublasOperation_t> trans_a, trans_b;
    std::vector<float> alpha, beta;
    std::vector<const void*> a_host, b_host;  // per group: weights, activations
    std::vector<void*> c_host;
    DeviceBuffer<const void*> a, b;
    DeviceBuffer<void*> c;
  } grouped_[2];
};

}  // namespace pounce::baseline

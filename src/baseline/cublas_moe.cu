#include "baseline/cublas_moe.h"
#include "baseline/moe_kernels.h"
#include "common/cuda_check.h"

namespace pounce::baseline {

EpConfig single_rank_config(const MoeDims& d) {
  EpConfig c;
  c.ranks = 1;
  c.experts = int(d.experts);
  c.topk = int(d.topk);
  c.hidden = d.hidden;
  c.intermediate = d.intermediate;
  c.max_tokens_per_rank = d.max_tokens;
  return c;
}

const char* gemm_calls_name(GemmCalls calls) {
  return calls == GemmCalls::kLoop ? "cublas_loop" : "cublas_grouped_batched";
}

CublasMoe::CublasMoe(const MoeDims& dims) : dims_(dims) {
  const int64_t rows = planner::row_capacity(single_rank_config(dims)).max_padded_rows;  // validates dims
  pool_ = DeviceBuffer<__nv_bfloat16>(rows * dims.hidden);
  h13_ = DeviceBuffer<__nv_bfloat16>(rows * 2 * dims.intermediate);
  hidden_ = DeviceBuffer<__nv_bfloat16>(rows * dims.intermediate);
  out_ = DeviceBuffer<__nv_bfloat16>(rows * dims.hidden);
  CUBLAS_CHECK(cublasCreate(&handle_));
}

CublasMoe::~CublasMoe() {
  if (handle_) cublasDestroy(handle_);
}

void CublasMoe::set_weights(const __nv_bfloat16* w13, const __nv_bfloat16* w2) {
  POUNCE_REQUIRE(w13 && w2, "CublasMoe::set_weights: null weight pointer");
  w13_ = w13;
  w2_ = w2;
  has_routing_ = false;  // the cuBLAS arguments hold pointers into the old weights
}

void CublasMoe::set_routing(std::span<const int32_t> topk_ids, int64_t tokens) {
  POUNCE_REQUIRE(w13_ && w2_, "CublasMoe::set_routing: call set_weights first");
  has_routing_ = false;
  plan_ = make_routing_plan(single_rank_config(dims_), topk_ids, tokens);

  // Row-major C[M,N] = A[M,K] . B[N,K]^T is column-major C^T = op_T(B) . A: cuBLAS gets (N, M, K).
  const int64_t H = dims_.hidden, I = dims_.intermediate;
  for (Gemm which : {Gemm::kGateUp, Gemm::kDown}) {
    Calls& g = calls_[int(which)];
    g = Calls{};
    const bool gate_up = which == Gemm::kGateUp;
    const int64_t N = gate_up ? 2 * I : H, K = gate_up ? H : I;
    for (int64_t e = 0; e < dims_.experts; ++e) {
      if (plan_.expert_routes[e] == 0) continue;  // cuBLAS rejects empty groups
      const int64_t row0 = plan_.expert_offsets[e];
      g.m.push_back(int(N));
      g.n.push_back(plan_.expert_routes[e]);
      g.k.push_back(int(K));
      g.group_size.push_back(1);
      g.trans_a.push_back(CUBLAS_OP_T);
      g.trans_b.push_back(CUBLAS_OP_N);
      g.alpha.push_back(1.0f);
      g.beta.push_back(0.0f);
      g.a_host.push_back(gate_up ? static_cast<const void*>(w13_ + e * 2 * I * H) : w2_ + e * H * I);
      g.b_host.push_back(gate_up ? static_cast<const void*>(pool_.data() + row0 * H) : hidden_.data() + row0 * I);
      g.c_host.push_back(gate_up ? static_cast<void*>(h13_.data() + row0 * 2 * I) : out_.data() + row0 * H);
    }
    g.a = DeviceBuffer<const void*>(g.a_host);
    g.b = DeviceBuffer<const void*>(g.b_host);
    g.c = DeviceBuffer<void*>(g.c_host);
  }
  has_routing_ = true;
}

void CublasMoe::run_gemm(Gemm which, GemmCalls calls, cudaStream_t stream) {
  POUNCE_REQUIRE(has_routing_, "CublasMoe: call set_weights, then set_routing");
  CUBLAS_CHECK(cublasSetStream(handle_, stream));
  const Calls& g = calls_[int(which)];
  const int groups = int(g.group_size.size());
  if (groups == 0) return;
  // Both operands are K-major: lda = ldb = K, ldc = N.
  if (calls == GemmCalls::kGroupedBatched) {
    CUBLAS_CHECK(cublasGemmGroupedBatchedEx(handle_, g.trans_a.data(), g.trans_b.data(), g.m.data(), g.n.data(),
                                            g.k.data(), g.alpha.data(), g.a.data(), CUDA_R_16BF, g.k.data(), g.b.data(),
                                            CUDA_R_16BF, g.k.data(), g.beta.data(), g.c.data(), CUDA_R_16BF, g.m.data(),
                                            groups, g.group_size.data(), CUBLAS_COMPUTE_32F));
    return;
  }
  for (int i = 0; i < groups; ++i)
    CUBLAS_CHECK(cublasGemmEx(handle_, CUBLAS_OP_T, CUBLAS_OP_N, g.m[i], g.n[i], g.k[i], &g.alpha[i], g.a_host[i],
                              CUDA_R_16BF, g.k[i], g.b_host[i], CUDA_R_16BF, g.k[i], &g.beta[i], g.c_host[i],
                              CUDA_R_16BF, g.m[i], CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

void CublasMoe::forward(const __nv_bfloat16* x, const float* topk_weights, __nv_bfloat16* y, GemmCalls calls,
                        cudaStream_t stream) {
  POUNCE_REQUIRE(has_routing_, "CublasMoe::forward: call set_weights, then set_routing");
  permute_rows(x, plan_.row_token.data(), plan_.padded_rows, dims_.hidden, pool_.data(), stream);
  run_gemm(Gemm::kGateUp, calls, stream);
  swiglu_rows(h13_.data(), plan_.padded_rows, dims_.intermediate, hidden_.data(), stream);
  run_gemm(Gemm::kDown, calls, stream);
  weighted_combine(out_.data(), plan_.route_row.data(), topk_weights, plan_.tokens, dims_.topk, dims_.hidden, y,
                   stream);
}

}  // namespace pounce::baseline

#include <cublasLt.h>
#include <cublas_v2.h>

#include "bench/dense_ceiling.h"
#include "bench/device_fill.h"
#include "common/device_buffer.h"

namespace pounce::bench {

DenseBf16Gemm::DenseBf16Gemm(int64_t n) : n_(n), a_(n * n), b_(n * n), c_(n * n) {
  fill_random_bf16(a_.data(), n * n, 1, 1.0f, nullptr);
  fill_random_bf16(b_.data(), n * n, 2, 1.0f, nullptr);
  CUBLAS_CHECK(cublasCreate(&handle_));
}

DenseBf16Gemm::~DenseBf16Gemm() {
  if (handle_) cublasDestroy(handle_);
}

void DenseBf16Gemm::run(cudaStream_t stream) {
  const float alpha = 1.0f, beta = 0.0f;
  const int n = int(n_);
  CUBLAS_CHECK(cublasSetStream(handle_, stream));
  CUBLAS_CHECK(cublasGemmEx(handle_, CUBLAS_OP_T, CUBLAS_OP_N, n, n, n, &alpha, b_.data(), CUDA_R_16BF, n, a_.data(),
                            CUDA_R_16BF, n, &beta, c_.data(), CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

Measured dense_bf16_gemm(int64_t n, int warmup, int reps, cudaStream_t stream) {
  DenseBf16Gemm gemm(n);
  Measured m;
  m.timing = time_on_stream([&](int) { gemm.run(stream); }, stream, warmup, reps);
  m.rate = gemm.flops() / (m.timing.median_ms * 1e-3) / 1e12;
  return m;
}

Measured dense_fp8_gemm(int64_t n, bool fast_accum, int warmup, int reps, cudaStream_t stream) {
  DeviceBuffer<uint8_t> a(n * n), b(n * n);
  DeviceBuffer<__nv_bfloat16> d(n * n);
  fill_random_e4m3(a.data(), n * n, 3, 4.0f, stream);
  fill_random_e4m3(b.data(), n * n, 4, 4.0f, stream);
  const size_t workspace_bytes = size_t(64) << 20;
  DeviceBuffer<uint8_t> workspace(workspace_bytes);

  cublasLtHandle_t lt;
  CUBLAS_CHECK(cublasLtCreate(&lt));
  cublasLtMatmulDesc_t op;
  CUBLAS_CHECK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t trans_a = CUBLAS_OP_T, trans_b = CUBLAS_OP_N;  // FP8 needs the "TN" layout
  const int8_t fast = fast_accum ? 1 : 0;
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &trans_a, sizeof trans_a));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &trans_b, sizeof trans_b));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof fast));
  cublasLtMatrixLayout_t la, lb, ld;
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, n, n, n));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_8F_E4M3, n, n, n));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&ld, CUDA_R_16BF, n, n, n));
  cublasLtMatmulPreference_t pref;
  CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes,
                                                    sizeof workspace_bytes));
  cublasLtMatmulHeuristicResult_t heuristic{};
  int found = 0;
  CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, ld, ld, pref, 1, &heuristic, &found));
  POUNCE_REQUIRE(found > 0, "cublasLt found no FP8 algorithm for ", n, "^3");

  const float alpha = 1.0f, beta = 0.0f;
  Measured m;
  m.timing = time_on_stream(
      [&](int) {
        CUBLAS_CHECK(cublasLtMatmul(lt, op, &alpha, a.data(), la, b.data(), lb, &beta, d.data(), ld, d.data(), ld,
                                    &heuristic.algo, workspace.data(), workspace_bytes, stream));
      },
      stream, warmup, reps);
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatrixLayoutDestroy(la);
  cublasLtMatrixLayoutDestroy(lb);
  cublasLtMatrixLayoutDestroy(ld);
  cublasLtMatmulDescDestroy(op);
  cublasLtDestroy(lt);
  m.rate = 2.0 * double(n) * n * n / (m.timing.median_ms * 1e-3) / 1e12;
  return m;
}

Measured hbm_copy(int64_t bytes, int warmup, int reps, cudaStream_t stream) {
  DeviceBuffer<uint8_t> src(bytes), dst(bytes);
  CUDA_CHECK(cudaMemsetAsync(src.data(), 0x5A, bytes, stream));
  Measured m;
  m.timing = time_on_stream(
      [&](int) { CUDA_CHECK(cudaMemcpyAsync(dst.data(), src.data(), bytes, cudaMemcpyDeviceToDevice, stream)); },
      stream, warmup, reps);
  m.rate = 2.0 * double(bytes) / (m.timing.median_ms * 1e-3) / 1e9;
  return m;
}

}  // namespace pounce::bench

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

namespace {
constexpr size_t kFp8WorkspaceBytes = size_t(64) << 20;
}

DenseFp8Gemm::DenseFp8Gemm(int64_t n, bool fast_accum)
    : n_(n), a_(n * n), b_(n * n), workspace_(kFp8WorkspaceBytes), d_(n * n) {
  fill_random_e4m3(a_.data(), n * n, 3, 4.0f, nullptr);
  fill_random_e4m3(b_.data(), n * n, 4, 4.0f, nullptr);
  CUBLAS_CHECK(cublasLtCreate(&lt_));
  CUBLAS_CHECK(cublasLtMatmulDescCreate(&op_, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t trans_a = CUBLAS_OP_T, trans_b = CUBLAS_OP_N;  // FP8 needs the "TN" layout
  const int8_t fast = fast_accum ? 1 : 0;
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op_, CUBLASLT_MATMUL_DESC_TRANSA, &trans_a, sizeof trans_a));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op_, CUBLASLT_MATMUL_DESC_TRANSB, &trans_b, sizeof trans_b));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op_, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof fast));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&la_, CUDA_R_8F_E4M3, n, n, n));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lb_, CUDA_R_8F_E4M3, n, n, n));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&ld_, CUDA_R_16BF, n, n, n));
  cublasLtMatmulPreference_t pref;
  CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &kFp8WorkspaceBytes,
                                                    sizeof kFp8WorkspaceBytes));
  cublasLtMatmulHeuristicResult_t heuristic{};
  int found = 0;
  CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(lt_, op_, la_, lb_, ld_, ld_, pref, 1, &heuristic, &found));
  cublasLtMatmulPreferenceDestroy(pref);
  POUNCE_REQUIRE(found > 0, "cublasLt found no FP8 algorithm for ", n, "^3");
  algo_ = heuristic.algo;
}

DenseFp8Gemm::~DenseFp8Gemm() {
  if (la_) cublasLtMatrixLayoutDestroy(la_);
  if (lb_) cublasLtMatrixLayoutDestroy(lb_);
  if (ld_) cublasLtMatrixLayoutDestroy(ld_);
  if (op_) cublasLtMatmulDescDestroy(op_);
  if (lt_) cublasLtDestroy(lt_);
}

void DenseFp8Gemm::run(cudaStream_t stream) {
  const float alpha = 1.0f, beta = 0.0f;
  CUBLAS_CHECK(cublasLtMatmul(lt_, op_, &alpha, a_.data(), la_, b_.data(), lb_, &beta, d_.data(), ld_, d_.data(), ld_,
                              &algo_, workspace_.data(), kFp8WorkspaceBytes, stream));
}

Measured dense_fp8_gemm(int64_t n, bool fast_accum, int warmup, int reps, cudaStream_t stream) {
  DenseFp8Gemm gemm(n, fast_accum);
  Measured m;
  m.timing = time_on_stream([&](int) { gemm.run(stream); }, stream, warmup, reps);
  m.rate = gemm.flops() / (m.timing.median_ms * 1e-3) / 1e12;
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

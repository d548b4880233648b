// The chip's practical ceilings, measured in the same run as every kernel they are compared with:
// cuBLAS dense GEMMs (BF16 and FP8) and a device-to-device copy for HBM bandwidth.
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "bench/timing.h"
#include "common/device_buffer.h"

namespace pounce::bench {

struct Measured {
  Timing timing;
  double rate = 0;  // TFLOP/s for GEMMs, GB/s (bytes read + written) for copies
};

// C[n,n] = A[n,n] . B[n,n]^T in BF16 with fp32 accumulation (cublasGemmEx), random inputs. Also run
// interleaved with other kernels, as the ceiling under the same clocks and temperature.
class DenseBf16Gemm {
 public:
  explicit DenseBf16Gemm(int64_t n);
  ~DenseBf16Gemm();
  DenseBf16Gemm(const DenseBf16Gemm&) = delete;
  DenseBf16Gemm& operator=(const DenseBf16Gemm&) = delete;
  void run(cudaStream_t stream);
  double flops() const { return 2.0 * double(n_) * double(n_) * double(n_); }

 private:
  int64_t n_;
  cublasHandle_t handle_ = nullptr;
  DeviceBuffer<__nv_bfloat16> a_, b_, c_;
};
Measured dense_bf16_gemm(int64_t n, int warmup, int reps, cudaStream_t stream);
// C[n,n] = A[n,n] . B[n,n]^T, E4M3 x E4M3 -> BF16 (cublasLt, TN, per-tensor scale 1), random inputs; the
// FP8 ceiling, also run interleaved. fast_accum: CUBLASLT_MATMUL_DESC_FAST_ACCUM.
class DenseFp8Gemm {
 public:
  DenseFp8Gemm(int64_t n, bool fast_accum);
  ~DenseFp8Gemm();
  DenseFp8Gemm(const DenseFp8Gemm&) = delete;
  DenseFp8Gemm& operator=(const DenseFp8Gemm&) = delete;
  void run(cudaStream_t stream);
  double flops() const { return 2.0 * double(n_) * double(n_) * double(n_); }

 private:
  int64_t n_;
  DeviceBuffer<uint8_t> a_, b_, workspace_;
  DeviceBuffer<__nv_bfloat16> d_;
  cublasLtHandle_t lt_ = nullptr;
  cublasLtMatmulDesc_t op_ = nullptr;
  cublasLtMatrixLayout_t la_ = nullptr, lb_ = nullptr, ld_ = nullptr;
  cublasLtMatmulAlgo_t algo_{};
};
Measured dense_fp8_gemm(int64_t n, bool fast_accum, int warmup, int reps, cudaStream_t stream);
// cudaMemcpyAsync device to device of `bytes`.
Measured hbm_copy(int64_t bytes, int warmup, int reps, cudaStream_t stream);

}  // namespace pounce::bench

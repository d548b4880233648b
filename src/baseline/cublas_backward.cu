#include "baseline/cublas_backward.h"
#include "bench/device_fill.h"
#include "common/cuda_check.h"

namespace pounce::baseline {

CublasBackwardGemms::CublasBackwardGemms(const MoeDims& dims, const RoutingPlan& plan, const __nv_bfloat16* w13,
                                         const __nv_bfloat16* w2, cudaStream_t stream)
    : dims_(dims), plan_(plan), w13_(w13), w2_(w2) {
  const int64_t rows = plan.padded_rows, H = dims.hidden, I = dims.intermediate, E = dims.experts;
  x_rows_ = DeviceBuffer<__nv_bfloat16>(rows * H);
  dy_rows_ = DeviceBuffer<__nv_bfloat16>(rows * H);
  dgu_ = DeviceBuffer<__nv_bfloat16>(rows * 2 * I);
  wa_ = DeviceBuffer<__nv_bfloat16>(rows * I);
  da_ = DeviceBuffer<__nv_bfloat16>(rows * I);
  dx_rows_ = DeviceBuffer<__nv_bfloat16>(rows * H);
  dw13_ = DeviceBuffer<float>(E * 2 * I * H);
  dw2_ = DeviceBuffer<float>(E * H * I);
  uint64_t seed = 900;
  for (auto* b : {&x_rows_, &dy_rows_, &dgu_, &wa_})
    bench::fill_random_bf16(b->data(), int64_t(b->size()), seed++, 1.0f, stream);
  CUBLAS_CHECK(cublasCreate(&handle_));
}

CublasBackwardGemms::~CublasBackwardGemms() {
  if (handle_) cublasDestroy(handle_);
}

// Row-major buffers seen column-major: a row-major [r, c] matrix is a column-major c x r one with
// leading dimension c.
void CublasBackwardGemms::run(moe::BackwardGemm which, cudaStream_t stream) {
  POUNCE_REQUIRE(which != moe::BackwardGemm::kGateUp, "cuBLAS backward GEMMs: GEMM1 is the forward's");
  CUBLAS_CHECK(cublasSetStream(handle_, stream));
  const int64_t H = dims_.hidden, I = dims_.intermediate;
  const float one = 1.0f, zero = 0.0f;
  for (int64_t e = 0; e < dims_.experts; ++e) {
    const int r = plan_.expert_routes[e];
    if (r == 0) continue;
    const int64_t row0 = plan_.expert_offsets[e];
    const __nv_bfloat16 *w13 = w13_ + e * 2 * I * H, *w2 = w2_ + e * H * I;
    const __nv_bfloat16 *x = x_rows_.data() + row0 * H, *dy = dy_rows_.data() + row0 * H;
    const __nv_bfloat16 *dgu = dgu_.data() + row0 * 2 * I, *wa = wa_.data() + row0 * I;
    switch (which) {
      case moe::BackwardGemm::kDataDown:  // da [r, I] = dy [r, H] . W2 [H, I]
        CUBLAS_CHECK(cublasGemmEx(handle_, CUBLAS_OP_N, CUBLAS_OP_N, int(I), r, int(H), &one, w2, CUDA_R_16BF, int(I),
                                  dy, CUDA_R_16BF, int(H), &zero, da_.data() + row0 * I, CUDA_R_16BF, int(I),
                                  CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        break;
      case moe::BackwardGemm::kDataGateUp:  // dx [r, H] = dgu [r, 2I] . W13 [2I, H]
        CUBLAS_CHECK(cublasGemmEx(handle_, CUBLAS_OP_N, CUBLAS_OP_N, int(H), r, int(2 * I), &one, w13, CUDA_R_16BF,
                                  int(H), dgu, CUDA_R_16BF, int(2 * I), &zero, dx_rows_.data() + row0 * H, CUDA_R_16BF,
                                  int(H), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        break;
      case moe::BackwardGemm::kWeightDown:  // dW2 [H, I] = dy^T [H, r] . wa [r, I], fp32
        CUBLAS_CHECK(cublasGemmEx(handle_, CUBLAS_OP_N, CUBLAS_OP_T, int(I), int(H), r, &one, wa, CUDA_R_16BF, int(I),
                                  dy, CUDA_R_16BF, int(H), &zero, dw2_.data() + e * H * I, CUDA_R_32F, int(I),
                                  CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        break;
      case moe::BackwardGemm::kWeightGateUp:  // dW13 [2I, H] = dgu^T [2I, r] . x [r, H], fp32
        CUBLAS_CHECK(cublasGemmEx(handle_, CUBLAS_OP_N, CUBLAS_OP_T, int(H), int(2 * I), r, &one, x, CUDA_R_16BF,
                                  int(H), dgu, CUDA_R_16BF, int(2 * I), &zero, dw13_.data() + e * 2 * I * H, CUDA_R_32F,
                                  int(H), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        break;
      case moe::BackwardGemm::kGateUp:
        break;
    }
  }
}

}  // namespace pounce::baseline

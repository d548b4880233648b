#include "gemm/tensor_map.h"

#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include "common/cuda_check.h"

namespace pounce::gemm {
namespace {

PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult status;
    CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &status));
    POUNCE_REQUIRE(fn != nullptr && status == cudaDriverEntryPointSuccess,
                   "the CUDA driver does not provide cuTensorMapEncodeTiled");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encode;
}

}  // namespace

CUtensorMap make_bf16_tensor_map(const void* base, uint64_t inner, uint64_t outer, uint32_t box_inner,
                                 uint32_t box_outer) {
  CUtensorMap map;
  const cuuint64_t dims[2] = {inner, outer};
  const cuuint64_t strides[1] = {inner * 2};  // bf16
  const cuuint32_t box[2] = {box_inner, box_outer};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult status =
      tensor_map_encoder()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(base), dims, strides, box,
                           element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                           CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  POUNCE_REQUIRE(status == CUDA_SUCCESS, "cuTensorMapEncodeTiled failed (CUresult ", int(status), ") for a [", outer,
                 ", ", inner, "] bf16 tensor with box [", box_outer, ", ", box_inner, "]");
  return map;
}

}  // namespace pounce::gemm

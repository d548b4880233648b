#include "gemm/tensor_map.h"

#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <string>

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

CUtensorMap encode(const void* base, CUtensorMapDataType type, uint32_t element_bytes, uint32_t rank,
                   const cuuint64_t* dims, const cuuint32_t* box) {
  CUtensorMap map;
  cuuint64_t strides[2];
  strides[0] = dims[0] * element_bytes;
  if (rank == 3) strides[1] = strides[0] * dims[1];
  const cuuint32_t element_strides[3] = {1, 1, 1};
  const CUresult status = tensor_map_encoder()(
      &map, type, rank, const_cast<void*>(base), dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
      CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  POUNCE_REQUIRE(status == CUDA_SUCCESS, "cuTensorMapEncodeTiled failed (CUresult ", int(status), ") for a ",
                 rank == 3 ? "[" + std::to_string(dims[2]) + ", " : "[", dims[1], ", ", dims[0], "] ",
                 element_bytes == 4   ? "fp32"
                 : element_bytes == 2 ? "bf16"
                                      : "e4m3",
                 " tensor at ", base, " with box [", box[1], ", ", box[0], "] (the base must be 16-byte aligned)");
  return map;
}

}  // namespace

CUtensorMap make_bf16_tensor_map(const void* base, uint64_t inner, uint64_t outer, uint32_t box_inner,
                                 uint32_t box_outer) {
  const cuuint64_t dims[2] = {inner, outer};
  const cuuint32_t box[2] = {box_inner, box_outer};
  return encode(base, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, 2, dims, box);
}

CUtensorMap make_fp8_tensor_map(const void* base, uint64_t inner, uint64_t outer, uint32_t box_inner,
                                uint32_t box_outer) {
  const cuuint64_t dims[2] = {inner, outer};
  const cuuint32_t box[2] = {box_inner, box_outer};
  return encode(base, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, 2, dims, box);
}

CUtensorMap make_3d_tensor_map(const void* base, bool fp32, uint64_t inner, uint64_t middle, uint64_t outer,
                               uint32_t box_inner, uint32_t box_middle) {
  const cuuint64_t dims[3] = {inner, middle, outer};
  const cuuint32_t box[3] = {box_inner, box_middle, 1};
  return encode(base, fp32 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, fp32 ? 4 : 2, 3, dims,
                box);
}

}  // namespace pounce::gemm

#include "common/gpu.h"

#include <cuda_runtime.h>

namespace pounce {

static GpuInfo probe() {
  GpuInfo info;
  int count = 0;
  cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    info.why_absent = std::string("cudaGetDeviceCount: ") + cudaGetErrorString(status);
    cudaGetLastError();  // clear the sticky-free error so later calls start clean
    return info;
  }
  if (count == 0) {
    info.why_absent = "no CUDA device";
    return info;
  }
  cudaDeviceProp prop{};
  status = cudaGetDeviceProperties(&prop, 0);
  if (status != cudaSuccess) {
    info.why_absent = std::string("cudaGetDeviceProperties: ") + cudaGetErrorString(status);
    return info;
  }
  info.present = true;
  info.name = prop.name;
  info.sm_major = prop.major;
  info.sm_minor = prop.minor;
  info.multiprocessors = prop.multiProcessorCount;
  info.global_memory_bytes = int64_t(prop.totalGlobalMem);
  info.l2_bytes = prop.l2CacheSize;
  return info;
}

const GpuInfo& gpu_info() {
  static const GpuInfo info = probe();
  return info;
}

}  // namespace pounce

// Launch of a persistent kernel whose CTAs wait on one another: every CTA must be resident at once, so
// the launch is cooperative (it fails with an error instead of deadlocking when the grid does not fit).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <utility>

#include "common/cuda_check.h"

namespace pounce {

template <typename... Params, typename... Args>
void launch_cooperative(void (*kernel)(Params...), int ctas, int threads, size_t shared_bytes, cudaStream_t stream,
                        Args&&... args) {
  // Per device (one process may drive several GPUs): a host call of a microsecond, every launch.
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared_bytes)));
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(unsigned(ctas));
  config.blockDim = dim3(unsigned(threads));
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  cudaLaunchAttribute cooperative{};
  cooperative.id = cudaLaunchAttributeCooperative;
  cooperative.val.cooperative = 1;
  config.attrs = &cooperative;
  config.numAttrs = 1;
  CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
  CUDA_CHECK_LAUNCH();
}

}  // namespace pounce

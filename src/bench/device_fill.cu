#include <cuda_fp8.h>

#include "bench/device_fill.h"
#include "common/cuda_check.h"

namespace pounce::bench {

namespace {

__device__ __forceinline__ float uniform_pm1(uint64_t seed, int64_t i) {
  // splitmix64 of (seed, index): independent values without per-thread generator state.
  uint64_t z = seed + 0x9E3779B97F4A7C15ull * uint64_t(i + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return float(z >> 40) * (2.0f / 16777216.0f) - 1.0f;  // 24 random bits -> [-1, 1)
}

__global__ void fill_bf16_kernel(__nv_bfloat16* data, int64_t count, uint64_t seed, float scale) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count; i += int64_t(gridDim.x) * blockDim.x)
    data[i] = __float2bfloat16_rn(scale * uniform_pm1(seed, i));
}

__global__ void fill_e4m3_kernel(uint8_t* data, int64_t count, uint64_t seed, float scale) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count; i += int64_t(gridDim.x) * blockDim.x)
    data[i] = __nv_cvt_float_to_fp8(scale * uniform_pm1(seed, i), __NV_SATFINITE, __NV_E4M3);
}

constexpr int kThreads = 256, kBlocks = 132 * 8;

}  // namespace

void fill_random_bf16(__nv_bfloat16* data, int64_t count, uint64_t seed, float scale, cudaStream_t stream) {
  if (count == 0) return;
  fill_bf16_kernel<<<kBlocks, kThreads, 0, stream>>>(data, count, seed, scale);
  CUDA_CHECK_LAUNCH();
}

void fill_random_e4m3(uint8_t* data, int64_t count, uint64_t seed, float scale, cudaStream_t stream) {
  if (count == 0) return;
  fill_e4m3_kernel<<<kBlocks, kThreads, 0, stream>>>(data, count, seed, scale);
  CUDA_CHECK_LAUNCH();
}

}  // namespace pounce::bench

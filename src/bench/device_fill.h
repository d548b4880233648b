// Fills device buffers with pseudo-random values on the GPU (gigabytes of expert weights would take
// minutes on the host). Values come from a counter hash, so a (seed, index) pair always gives the same
// value; they are never all zeros (a GEMM on zeros runs measurably faster than on real data).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace pounce::bench {

// Uniform in [-scale, scale), rounded to bf16.
void fill_random_bf16(__nv_bfloat16* data, int64_t count, uint64_t seed, float scale, cudaStream_t stream);
// Uniform in [-scale, scale), converted to E4M3 with saturation (no NaN codes).
void fill_random_e4m3(uint8_t* data, int64_t count, uint64_t seed, float scale, cudaStream_t stream);

}  // namespace pounce::bench

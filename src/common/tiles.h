// The tile shape every part of pounce agrees on — host planner, device planner, GEMM engine, fused
// kernel — and the arithmetic on it. Host and device code include this one definition.
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define POUNCE_HOST_DEVICE __host__ __device__
#else
#define POUNCE_HOST_DEVICE
#endif

namespace pounce {

inline constexpr int kBlockM = 128;       // rows of a GEMM tile, and of an m-block (one expert's rows, padded)
inline constexpr int kBlockN = 256;       // columns of a GEMM tile
inline constexpr int kBlockK = 64;        // K of one pipeline stage (one 128-byte swizzle row of bf16)
inline constexpr int kShapeQuantum = 64;  // hidden and intermediate must be multiples of this

// Tiles of kBlockN columns covering n (the last may be partial).
POUNCE_HOST_DEVICE constexpr int32_t n_blocks(int64_t n) { return int32_t((n + kBlockN - 1) / kBlockN); }

// The expert owning padded row `row` of an expert-contiguous layout: offsets [experts + 1] hold each
// expert's first row (multiples of kBlockM). The last expert starting at or before the row: empty
// experts share their start with the next one, and "last" skips them.
POUNCE_HOST_DEVICE inline int32_t expert_of_row(const int32_t* offsets, int32_t experts, int64_t row) {
  int32_t lo = 0, hi = experts - 1;
  while (lo < hi) {
    const int32_t mid = (lo + hi + 1) / 2;
    if (offsets[mid] <= row)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

}  // namespace pounce

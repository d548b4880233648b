// TMA descriptors for the GEMM engine's operands: row-major tensors with 128-byte swizzled boxes,
// out-of-bounds reads zero-filled and writes dropped.
#pragma once

#include <cuda.h>

#include <cstdint>

namespace pounce::gemm {

// bf16 [outer, inner] with boxes of [box_outer, box_inner]. Throws pounce::Error (naming the shape and
// box) when the driver rejects the descriptor.
CUtensorMap make_bf16_tensor_map(const void* base, uint64_t inner, uint64_t outer, uint32_t box_inner,
                                 uint32_t box_outer);

// E4M3 (bytes) [outer, inner], as make_bf16_tensor_map.
CUtensorMap make_fp8_tensor_map(const void* base, uint64_t inner, uint64_t outer, uint32_t box_inner,
                                uint32_t box_outer);

// [outer, middle, inner] of bf16 or fp32 with boxes of [1, box_middle, box_inner]: per-expert output
// matrices, so a box that overhangs one expert's rows is clipped instead of writing into the next's.
CUtensorMap make_3d_tensor_map(const void* base, bool fp32, uint64_t inner, uint64_t middle, uint64_t outer,
                               uint32_t box_inner, uint32_t box_middle);

}  // namespace pounce::gemm

// TMA descriptors for the GEMM engine's operands: row-major bf16 [outer, inner] with boxes of
// [box_outer, box_inner], 128-byte swizzle, out-of-bounds reads zero-filled and writes dropped.
#pragma once

#include <cuda.h>

#include <cstdint>

namespace pounce::gemm {

// Throws pounce::Error (naming the shape and box) when the driver rejects the descriptor.
CUtensorMap make_bf16_tensor_map(const void* base, uint64_t inner, uint64_t outer, uint32_t box_inner,
                                 uint32_t box_outer);

}  // namespace pounce::gemm

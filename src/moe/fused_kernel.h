// Launcher of the fused MoE forward kernel (moe/fused_kernel.cu).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include "moe/fused_params.h"

namespace pounce::moe {

// TMA descriptors of the GEMM operands, in this order: x_ring (GEMM1 A), w13, h_ring (GEMM1 C, store
// box), h_ring (GEMM2 A, load box), w2, out_ring (GEMM2 C, store box).
struct FusedMaps {  // CUtensorMap is 64-byte aligned
  CUtensorMap m[6];
};

// One cooperative launch of p.launch_ranks * p.ctas_per_rank CTAs (one per SM; the launch fails rather
// than run CTAs that are not co-resident, which the kernel's barriers need).
void launch_fused_moe(const FusedParams& p, const FusedMaps& maps, cudaStream_t stream);

}  // namespace pounce::moe

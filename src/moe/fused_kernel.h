// Launcher of the fused MoE forward kernel (moe/fused_kernel.cu).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include "moe/fused_params.h"

namespace pounce::moe {

// TMA descriptors of the GEMM operands. The rings are one allocation for every rank of the launch; the
// weights are each rank's own, its local experts only.
struct FusedMaps {             // CUtensorMap is 64-byte aligned
  CUtensorMap x_ring;          // GEMM1 A [ring rows, H]
  CUtensorMap h_ring_store;    // GEMM1 C [ring rows, I], store box
  CUtensorMap h_ring_load;     // GEMM2 A [ring rows, I], load box
  CUtensorMap out_ring_store;  // GEMM2 C [ring rows, H], store box
  CUtensorMap gate_up_kept;    // GEMM1 before SwiGLU [launch ranks * capacity rows, 2I], store box (training)
  CUtensorMap w13[kMaxRanks];  // [launch rank]: GEMM1 B [E/P * 2I, H]
  CUtensorMap w2[kMaxRanks];   // [launch rank]: GEMM2 B [E/P * H, I]
  // The E4M3 forward's (Fp8Rows), box 128 bytes x 128 rows; its Q items load the bf16 hidden rows
  // through h_ring_load.
  CUtensorMap x_ring_fp8;          // GEMM1 A [ring rows, H]
  CUtensorMap hidden_fp8;          // GEMM2 A [ring rows, I]
  CUtensorMap w13_fp8[kMaxRanks];  // GEMM1 B [E/P * 2I, H]
  CUtensorMap w2_fp8[kMaxRanks];   // GEMM2 B [E/P * H, I]
  // The backward's weight gradients (BackwardRows::weight_grads), row buffers read MN-major (boxes 64
  // columns x kBlockK rows) and 3-D outputs [E/P, M, N] (store boxes).
  CUtensorMap wgrad_dy;               // dW2 A [ring rows, H]
  CUtensorMap wgrad_wa;               // dW2 B [ring rows, I]
  CUtensorMap wgrad_dgu;              // dW13 A [ring rows, 2I]
  CUtensorMap wgrad_x;                // dW13 B [ring rows, H]
  CUtensorMap wgrad_dw2[kMaxRanks];   // [launch rank]: [E/P, H, I]
  CUtensorMap wgrad_dw13[kMaxRanks];  // [launch rank]: [E/P, 2I, H]
};

// One cooperative launch of p.launch_ranks * p.ctas_per_rank CTAs (one per SM; the launch fails rather
// than run CTAs that are not co-resident, which the kernel's barriers need). p.fp8: the E4M3 forward.
void launch_fused_moe(const FusedParams& p, const FusedMaps& maps, cudaStream_t stream);

// The fused backward's data path, one cooperative launch (p.backward set; its maps: x_ring the dy rows,
// h_ring_store da, h_ring_load dgu, out_ring_store the dx rows, w2 and w13 N-major), with the weight
// gradients where p.bwd.weight_grads says so (the wgrad_* maps).
void launch_fused_moe_backward(const FusedParams& p, const FusedMaps& maps, cudaStream_t stream);

// Reports a kKeptForward error (into p.error) unless the rows the latest forward kept are those of a
// forward on inputs with this fingerprint.
void launch_check_kept_forward(const FusedParams& p, uint64_t fingerprint, cudaStream_t stream);

}  // namespace pounce::moe

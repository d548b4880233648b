// E4M3 copies of one rank's expert weights in the orientation the backward's data-gradient GEMMs read:
// the FP8 grouped GEMM takes K-major weights only, and there K is the forward's N (dA = dy . W2[e] reads
// W2[e]^T as [I, H]; dx = dgu . W13[e] reads W13[e]^T as [H, 2I]). 128 x 128 blocks with power-of-two
// scales (formats/blockwise.h); each copy is bit for bit the quantized transposed weight.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/device_buffer.h"
#include "gemm/grouped_gemm.h"

namespace pounce::moe {

class Fp8TransposedWeights {
 public:
  // experts local experts of hidden H and intermediate I, both multiples of 128.
  Fp8TransposedWeights(int64_t experts, int64_t hidden, int64_t intermediate);

  // Quantizes w13 [E, 2I, H] and w2 [E, H, I] (bf16, device) into the transposed copies. Call it after
  // every weight update: the backward reads the copies, not the weights.
  // `rank` only names the weights in errors.
  void refresh(const __nv_bfloat16* w13, const __nv_bfloat16* w2, cudaStream_t stream, int rank = 0);
  // Whether the copies were last refreshed from these weights (updates in place are not seen).
  bool refreshed_from(const __nv_bfloat16* w13, const __nv_bfloat16* w2) const {
    return w13 != nullptr && w13 == w13_ && w2 == w2_;
  }

  // The FP8 GEMM operands of the two data gradients, with A (rows quantized 1 x 128) given.
  gemm::Fp8Operands data_down(const uint8_t* dy, const float* dy_scale) const;       // B = W2^T  [E, I, H]
  gemm::Fp8Operands data_gate_up(const uint8_t* dgu, const float* dgu_scale) const;  // B = W13^T [E, H, 2I]

  int64_t experts() const { return experts_; }
  int64_t hidden() const { return hidden_; }
  int64_t intermediate() const { return intermediate_; }
  int64_t device_bytes() const;

 private:
  int64_t experts_, hidden_, intermediate_;
  DeviceBuffer<uint8_t> w13_t_, w2_t_, staging_;  // staging: one expert's weight in its own orientation
  DeviceBuffer<float> w13_t_scales_, w2_t_scales_, staging_scales_;
  const __nv_bfloat16* w13_ = nullptr;  // what the last refresh read
  const __nv_bfloat16* w2_ = nullptr;
};

}  // namespace pounce::moe

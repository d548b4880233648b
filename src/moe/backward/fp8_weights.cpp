#include "moe/backward/fp8_weights.h"

#include <algorithm>

#include "common/cuda_check.h"
#include "common/device_pointer.h"
#include "common/require.h"
#include "formats/quantize_kernel.h"

namespace pounce::moe {

Fp8TransposedWeights::Fp8TransposedWeights(int64_t experts, int64_t hidden, int64_t intermediate)
    : experts_(experts), hidden_(hidden), intermediate_(intermediate) {
  POUNCE_REQUIRE(experts >= 1 && hidden > 0 && intermediate > 0 && hidden % 128 == 0 && intermediate % 128 == 0,
                 "FP8 weights: ", experts, " experts of hidden ", hidden, " and intermediate ", intermediate,
                 " are not supported: both sizes must be positive multiples of 128");
  const int64_t H = hidden, I = intermediate, w13 = experts * 2 * I * H, w2 = experts * H * I;
  POUNCE_REQUIRE(std::max(2 * I, H) / 128 <= 65535, "FP8 weights: an expert's [", 2 * I, ", ", H,
                 "] has more 128-row blocks than one quantizer launch takes (65535)");
  w13_t_ = DeviceBuffer<uint8_t>(w13);
  w2_t_ = DeviceBuffer<uint8_t>(w2);
  staging_ = DeviceBuffer<uint8_t>(2 * I * H);  // one expert's largest matrix
  w13_t_scales_ = DeviceBuffer<float>(w13 / (128 * 128));
  w2_t_scales_ = DeviceBuffer<float>(w2 / (128 * 128));
  staging_scales_ = DeviceBuffer<float>(2 * I * H / (128 * 128));
}

void Fp8TransposedWeights::refresh(const __nv_bfloat16* w13, const __nv_bfloat16* w2, cudaStream_t stream, int rank) {
  const int64_t E = experts_, H = hidden_, I = intermediate_;
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  require_device_tensor(w13, E * 2 * I * H * 2, device, "w13 (FP8 refresh)", rank);
  require_device_tensor(w2, E * H * I * 2, device, "w2 (FP8 refresh)", rank);
  // Expert by expert ([N, K] each): quantized in its own orientation into the staging buffer, then
  // transposed into its place. Stream order keeps the staging buffer's uses apart.
  const auto quantize_transposed = [&](const __nv_bfloat16* w, int64_t n, int64_t k, uint8_t* out, float* scales) {
    const int64_t blocks = (n / 128) * (k / 128);
    for (int64_t e = 0; e < E; ++e) {
      formats::quantize_128x128_device(reinterpret_cast<const uint16_t*>(w + e * n * k), n, k, staging_.data(),
                                       staging_scales_.data(), stream);
      formats::transpose_128x128_device(staging_.data(), staging_scales_.data(), 1, n, k, out + e * n * k,
                                        scales + e * blocks, stream);
    }
  };
  quantize_transposed(w2, H, I, w2_t_.data(), w2_t_scales_.data());
  quantize_transposed(w13, 2 * I, H, w13_t_.data(), w13_t_scales_.data());
  w13_ = w13;
  w2_ = w2;
}

gemm::Fp8Operands Fp8TransposedWeights::data_down(const uint8_t* dy, const float* dy_scale) const {
  return {dy, dy_scale, w2_t_.data(), w2_t_scales_.data()};
}

gemm::Fp8Operands Fp8TransposedWeights::data_gate_up(const uint8_t* dgu, const float* dgu_scale) const {
  return {dgu, dgu_scale, w13_t_.data(), w13_t_scales_.data()};
}

int64_t Fp8TransposedWeights::device_bytes() const {
  int64_t bytes = 0;
  for (size_t b : {w13_t_.bytes(), w2_t_.bytes(), staging_.bytes(), w13_t_scales_.bytes(), w2_t_scales_.bytes(),
                   staging_scales_.bytes()})
    bytes += int64_t(b);
  return bytes;
}

}  // namespace pounce::moe

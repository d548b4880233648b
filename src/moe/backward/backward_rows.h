// The backward's route-row buffers (dy, da, d(gate, up), w.a and dx rows of every routed row, and each
// mode's extras), sized for a layer shape's worst case. They carry nothing from one backward to the
// next: every backward writes each row before it reads it, or reads it only to make padding rows (the
// fused kernel's dy padding rows, zeroed by its S items before the weight gradients sum them). So the
// layers of one shape on one GPU share one set (moe/shared_rows.h).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "common/device_buffer.h"

namespace pounce::moe {

// Route rows quantized to E4M3 along their rows and stored transposed ([cols, rows]), with their scales
// K block-major ([rows / 128, cols]): the FP8 weight gradients' operands.
struct TransposedRows {
  DeviceBuffer<uint8_t> q;
  DeviceBuffer<float> scales;
  size_t bytes() const { return q.bytes() + scales.bytes(); }
};

// Each buffer is made by the first backward that needs it (moe/backward/backward_chain.h says which).
struct BackwardRowBuffers {
  // The chain of kernels', [capacity rows of one rank, width].
  DeviceBuffer<__nv_bfloat16> x_rows, h13;  // a replay's (x rows also when the kept forward lacks them)
  DeviceBuffer<__nv_bfloat16> dy_rows, da, dgu, wa, dx_rows;
  DeviceBuffer<float> row_weight, route_dot;
  DeviceBuffer<uint8_t> dy_fp8, dgu_fp8;  // FP8 data gradients: their A operands, 1 x 128 scales beside
  DeviceBuffer<float> dy_scale, dgu_scale;
  TransposedRows dy_t, wa_t, dgu_t, x_t;  // FP8 weight gradients
  // The fused backward's (moe/fused_layer.h), [launch ranks x capacity rows, width]; x rows once a
  // backward pulls them (more ranks, a bounded forward ring, FusedMoeOptions::keep_x_rows = false).
  struct Fused {
    DeviceBuffer<__nv_bfloat16> dy_rows, da, dgu, wa, dx_rows, x_rows;
    DeviceBuffer<float> segment_dots, row_weight;
  } fused;

  int64_t bytes() const {
    int64_t bytes = 0;
    for (size_t b : {x_rows.bytes(),
                     h13.bytes(),
                     dy_rows.bytes(),
                     da.bytes(),
                     dgu.bytes(),
                     wa.bytes(),
                     dx_rows.bytes(),
                     row_weight.bytes(),
                     route_dot.bytes(),
                     dy_fp8.bytes(),
                     dgu_fp8.bytes(),
                     dy_scale.bytes(),
                     dgu_scale.bytes(),
                     dy_t.bytes(),
                     wa_t.bytes(),
                     dgu_t.bytes(),
                     x_t.bytes(),
                     fused.dy_rows.bytes(),
                     fused.da.bytes(),
                     fused.dgu.bytes(),
                     fused.wa.bytes(),
                     fused.dx_rows.bytes(),
                     fused.x_rows.bytes(),
                     fused.segment_dots.bytes(),
                     fused.row_weight.bytes()})
      bytes += int64_t(b);
    return bytes;
  }
};

}  // namespace pounce::moe

// The backward's route-row buffers (dy, da, d(gate, up), w.a and dx rows of every routed row, and each
// mode's extras), sized for a layer shape's worst case. They carry nothing from one backward to the
// next: every backward writes each row before it reads it, or reads it only to make padding rows (the
// fused kernel's dy padding rows, zeroed by its S items before the weight gradients sum them). So the
// layers of one shape on one GPU share a single set: a model of n MoE layers holds one backward's rows,
// not n (what each layer keeps from its forward stays its own).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <mutex>

#include "common/device_buffer.h"
#include "pounce/config.h"

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
  // The fused backward's (moe/fused_layer.h), [launch ranks x capacity rows, width]; x rows with more
  // than one rank only.
  struct Fused {
    DeviceBuffer<__nv_bfloat16> dy_rows, da, dgu, wa, dx_rows, x_rows;
    DeviceBuffer<float> segment_dots, row_weight;
  } fused;

  int64_t bytes() const;
};

// The set shared by every layer of one shape on one GPU, and the order of their backwards' use of it.
class SharedBackwardRows {
 public:
  // The set of layers with this config and number of ranks launched on the current GPU: made by the
  // first such layer, freed with the last.
  static std::shared_ptr<SharedBackwardRows> of(const EpConfig& config, int launch_ranks);

  BackwardRowBuffers& buffers() { return buffers_; }
  int64_t bytes() const;  // of every buffer made so far

  // One backward's use of the buffers, held from before its first launch to after its last: one host
  // thread enqueues at a time, and the stream waits for the previous use's work (an event; on the same
  // stream the wait costs nothing, and two threads' cudaStreamPerThread are one handle but two streams).
  // Its end is recorded when it goes, after an exception too (whatever it enqueued must finish first).
  // NOTES: inside a CUDA graph capture nothing is waited for or recorded: an event of the capture cannot
  // order eager work, nor the reverse. The caller orders graph replays with eager backwards of the same
  // shape, and with each other (as it must order them with the forwards they follow).
  class Use {
   public:
    Use(SharedBackwardRows& rows, cudaStream_t stream);
    ~Use();
    Use(const Use&) = delete;
    Use& operator=(const Use&) = delete;

   private:
    SharedBackwardRows& rows_;
    std::unique_lock<std::mutex> lock_;
    cudaStream_t stream_;
    bool capturing_ = false;
  };

  SharedBackwardRows(const SharedBackwardRows&) = delete;
  SharedBackwardRows& operator=(const SharedBackwardRows&) = delete;
  ~SharedBackwardRows();

 private:
  SharedBackwardRows() = default;

  BackwardRowBuffers buffers_;
  mutable std::mutex mutex_;    // held by a Use; bytes() reads the buffers' sizes under it
  cudaEvent_t done_ = nullptr;  // recorded by the last use
  bool used_ = false;
};

}  // namespace pounce::moe

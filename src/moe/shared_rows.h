// Row buffers that the layers of one shape on one GPU share: the forward's rings (per ring size; the x
// rows too, except in place at one rank keeping them) and the backward's route rows
// (moe/backward/backward_rows.h).
// None of them carries anything from one call to the next (each forward writes the ring rows it uses
// before reading them, behind its own counters: rows of all-padding tile halves are loaded stale but enter
// no output row; each backward likewise its route rows), so a model of n MoE layers holds them once, not
// n times. What a layer keeps from its forward for its backward (its x ring in place at one rank with
// keep_x_rows, the gate/up rows, the schedule) and its counters stay its own.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>

#include "common/device_buffer.h"
#include "moe/backward/backward_rows.h"
#include "pounce/config.h"

namespace pounce::moe {

class SharedRows {
 public:
  // The set of the layers with this config and number of ranks launched on the current GPU: made by the
  // first such layer, freed with the last.
  static std::shared_ptr<SharedRows> of(const EpConfig& config, int launch_ranks);

  // The hidden and output rings of a ring of `ring_blocks` m-blocks per rank, [launch ranks x ring rows, I]
  // and [.., H] (GEMM1's SwiGLU output and GEMM2's output): made by the first layer with that ring. Layers
  // of one config differ in their ring when their options (ring_bytes, ring_blocks, minibatch_rows,
  // fp8_forward) do; they still share the route rows.
  struct Rings {
    DeviceBuffer<__nv_bfloat16> h, out;
    DeviceBuffer<__nv_bfloat16> x;  // made by x_ring()
  };
  const Rings& rings(int64_t ring_blocks);
  // The x rows of that ring, [.., H], for layers whose backward does not read them from the ring (all but
  // one rank in place keeping them: the others' backwards pull their x rows again). Zero until written.
  __nv_bfloat16* x_ring(int64_t ring_blocks);
  BackwardRowBuffers& backward() { return backward_; }
  int64_t bytes() const;  // of every buffer made so far

  // One forward's or backward's use of the buffers, held from before its first launch to after its last:
  // one host thread enqueues at a time, and the stream waits for the previous use's work (an event; on
  // the same stream the wait costs nothing, and two threads' cudaStreamPerThread are one handle but two
  // streams). Its end is recorded when it goes, after an exception too (what it enqueued must finish).
  // NOTES: inside a CUDA graph capture nothing is waited for or recorded: an event of the capture cannot
  // order eager work, nor the reverse. The caller orders graph replays with the eager calls of layers
  // of the same shape, and with each other.
  class Use {
   public:
    Use(SharedRows& rows, cudaStream_t stream);
    ~Use();
    Use(const Use&) = delete;
    Use& operator=(const Use&) = delete;

   private:
    SharedRows& rows_;
    std::unique_lock<std::mutex> lock_;
    cudaStream_t stream_;
    bool capturing_ = false;
  };

  SharedRows(const SharedRows&) = delete;
  SharedRows& operator=(const SharedRows&) = delete;
  ~SharedRows();

 private:
  SharedRows(const EpConfig& config, int launch_ranks) : config_(config), launch_ranks_(launch_ranks) {}

  const EpConfig config_;
  const int launch_ranks_;
  std::map<int64_t, Rings> rings_;  // by ring size; a map's entries stay where they are as others are added
  BackwardRowBuffers backward_;
  mutable std::mutex mutex_;    // held by a Use; rings() and bytes() take it too
  cudaEvent_t done_ = nullptr;  // recorded by the last use
  bool used_ = false;
};

}  // namespace pounce::moe

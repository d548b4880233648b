// The backward of the MoE layer on one GPU, as a chain of pounce kernels, one rank's experts at a time.
// From a kept forward (KeptForward: its schedule, x rows and gate/up rows before SwiGLU) it gathers each
// route's dy rows; otherwise it replays: plans the routing on the GPU, gathers x and dy rows and
// recomputes GEMM1. Then the four grouped GEMMs of the backward around the SwiGLU backward:
//   da    = dy_rows . W2[e]                        (m-grouped, W2 read N-major)
//   dgu, wa, route dots  = SwiGLU backward (moe/backward/backward_kernels.h)
//   dx_rows = dgu . W13[e]                         (m-grouped, W13 read N-major)
//   dW2[e]  = dy_rows[e]^T . wa[e],  dW13[e] = dgu[e]^T . x_rows[e]      (k-grouped, fp32 sums)
// (the two data gradients optionally in FP8: ExpertGradients::fp8; the two weight gradients too:
// ExpertGradients::fp8_weight_gradients)
// and the way back to token order: at one rank each token sums its dx rows; with more ranks (virtual
// ranks on this GPU) each dx row goes to its source rank's [token, k] slot and, once every rank's
// experts are done, finish() sums each token's slots. No host synchronization: a forward and this
// backward can be captured in one CUDA graph. Deterministic: every sum runs in a fixed order.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "common/device_buffer.h"
#include "gemm/grouped_gemm.h"
#include "moe/backward/backward_rows.h"
#include "moe/backward/fp8_weights.h"
#include "planner/device_planner.h"
#include "pounce/config.h"
#include "pounce/fused_moe.h"

namespace pounce::moe {

// One source rank's tensors in a backward: the forward's inputs, dy, and where its gradients go.
struct BackwardSource {
  const __nv_bfloat16* x = nullptr;     // [tokens, H], the forward's input
  const int32_t* topk_ids = nullptr;    // [tokens, k]
  const float* topk_weights = nullptr;  // [tokens, k]
  int64_t tokens = 0;
  const __nv_bfloat16* dy = nullptr;  // [tokens, H]
  __nv_bfloat16* dx = nullptr;        // [tokens, H]
  float* d_topk_weights = nullptr;    // [tokens, k]
};

// One rank's experts: their weights and where their gradients go.
struct ExpertGradients {
  const __nv_bfloat16* w13 = nullptr;  // [E/P, 2I, H]
  const __nv_bfloat16* w2 = nullptr;   // [E/P, H, I]
  void* dw13 = nullptr;                // [E/P, 2I, H] bf16 or fp32 (see mode)
  void* dw2 = nullptr;                 // [E/P, H, I]
  WeightGradOutput mode = WeightGradOutput::kF32;
  // Set (and refreshed since the last weight update): the two data-gradient GEMMs run in E4M3 on these
  // copies, with dy rows and d(gate, up) quantized 1 x 128 on the way; the weight gradients stay bf16
  // GEMMs on the bf16 rows. Needs H and I multiples of 128.
  const Fp8TransposedWeights* fp8 = nullptr;
  // The two weight-gradient GEMMs in E4M3: each route-row buffer they read (dy, w.a, d(gate, up), x rows)
  // quantized along its rows (the GEMMs' K) into its transpose first. Needs H and I multiples of 128.
  bool fp8_weight_gradients = false;
};

// What a training forward kept for its backward (moe/fused_layer.h), all in device memory, rows in the
// forward's schedule order (expert-contiguous, padded to m-blocks).
struct KeptForward {
  const int32_t* expert_offsets = nullptr;      // [E/P + 1], padded
  const int32_t* expert_rows = nullptr;         // [E/P], the routed rows of each expert (the rest: padding)
  const int32_t* row_source_rank = nullptr;     // [capacity rows]
  const int32_t* row_token = nullptr;           // [capacity rows], -1 for padding
  const int32_t* row_k = nullptr;               // [capacity rows]
  const int32_t* route_row = nullptr;           // one rank: [tokens, k], the row of every route
  __nv_bfloat16* x_rows = nullptr;              // [capacity rows, H] (its padding rows get zeroed); null:
                                                // gathered again from x
  const __nv_bfloat16* gate_up_rows = nullptr;  // [capacity rows, 2I], GEMM1 before SwiGLU
};

// Route rows of one rank's schedule that the weight-gradient GEMMs read: dy rows, d(gate, up) and w.a
// ([capacity rows, H / 2I / I], padding rows zero).
struct RouteRows {
  const __nv_bfloat16* dy = nullptr;
  const __nv_bfloat16* dgu = nullptr;
  const __nv_bfloat16* wa = nullptr;
};

// The five grouped GEMMs of the chain, in the order it runs them.
enum class BackwardGemm {
  kGateUp,        // h13 = x_rows . W13[e]^T            (GEMM1 again; a replay only)
  kDataDown,      // da = dy_rows . W2[e]
  kDataGateUp,    // dx_rows = dgu . W13[e]
  kWeightDown,    // dW2[e] = dy_rows[e]^T . wa[e]
  kWeightGateUp,  // dW13[e] = dgu[e]^T . x_rows[e]
};
inline constexpr int kBackwardGemms = 5;

// The weight-gradient GEMMs' epilogue for an output mode.
constexpr gemm::Epilogue weight_grad_epilogue(WeightGradOutput mode) {
  return mode == WeightGradOutput::kAccumulateF32 ? gemm::Epilogue::kAddF32
         : mode == WeightGradOutput::kBf16        ? gemm::Epilogue::kStore
                                                  : gemm::Epilogue::kStoreF32;
}

class BackwardChain {
 public:
  // Buffers are sized for one rank's worst case of config once. More ranks: slots[s] is source rank s's
  // [max_tokens_per_rank, k, H] buffer for the dx rows of its routes (the fused layer's combine slots,
  // free once its forward is done). The route rows live in `rows` (moe/shared_rows.h shares them; null:
  // the chain's own), which the caller may share with other chains of the same config whose runs are
  // ordered with this one's.
  explicit BackwardChain(const EpConfig& config, std::span<__nv_bfloat16* const> slots = {},
                         std::shared_ptr<BackwardRowBuffers> rows = nullptr);
  ~BackwardChain();

  // Enqueues the backward of rank `rank`'s experts on `stream`: every route that came to them from the
  // P sources (sources[s] is rank s's), from `kept` when given (it must belong to a forward on these
  // inputs), else by replaying the forward's planning and GEMM1. One rank: writes the source's dx and
  // router-weight gradients. More ranks: writes the router-weight gradients of the routes to this rank
  // and their dx rows into the slots; finish() sums them once every rank has run. Throws on
  // host-visible bad input; bad routing ids are found on the device and reported by
  // check_device_errors() (that backward's outputs are garbage).
  void run(int rank, std::span<const BackwardSource> sources, const ExpertGradients& experts, const KeptForward* kept,
           cudaStream_t stream);
  // run()'s host-visible checks alone (a layer checks every rank before it enqueues any).
  void check(int rank, std::span<const BackwardSource> sources, const ExpertGradients& experts) const;
  // One source rank's tensors, and one rank's experts (a rank of a layer across GPUs sees only its own).
  void check_source(int rank, const BackwardSource& source) const;
  void check_experts(int rank, const ExpertGradients& experts) const;
  // The weight gradients alone, from rows the fused backward left (moe/fused_kernel.h) for rank `rank`'s
  // schedule `kept`; x rows from kept.x_rows when it has them (padding rows zero, as the fused kernel
  // leaves them), else gathered from each source rank's tokens x[s] (checked by the caller; across GPUs,
  // peers' memory).
  void run_weight_gradients(int rank, std::span<const __nv_bfloat16* const> x, const ExpertGradients& experts,
                            const KeptForward& kept, const RouteRows& rows, cudaStream_t stream);
  // More ranks: each source's dx from its slots, after run() of every rank.
  void finish(std::span<const BackwardSource> sources, cudaStream_t stream);
  // One rank (config.ranks == 1): its whole backward.
  void run(const BackwardSource& source, const ExpertGradients& experts, const KeptForward* kept, cudaStream_t stream) {
    run(0, std::span(&source, 1), experts, kept, stream);
  }
  void check_device_errors();
  // The GEMMs enqueued from now on record their spans there (a build with POUNCE_TIMELINE), each
  // launch tagged first_kernel + its BackwardGemm; {}: stop.
  void set_timeline(const TimelineSink& sink) { timeline_ = sink; }

  // One GEMM alone on the buffers and weights of the last run (benchmarks; shared route rows may hold
  // another chain's rows since, which changes the results, not the work); weight gradients go to scratch
  // of the chain's own, written as `output` says (kAccumulateF32 adds to what earlier calls left there).
  void run_gemm(BackwardGemm which, cudaStream_t stream, WeightGradOutput output = WeightGradOutput::kF32);
  // The FP8 weight gradients' quantization passes alone (the route rows into their transposes), on the
  // rows of the last run, which had ExpertGradients::fp8_weight_gradients (benchmarks: what they cost).
  void run_weight_gradient_quantization(cudaStream_t stream);

  // Device memory of the chain's own buffers, its route rows not included (BackwardRowBuffers::bytes).
  int64_t device_bytes() const;
  // Rows every buffer holds: the schedule's worst case.
  int64_t capacity_rows() const { return rows_; }

 private:
  void gemm(BackwardGemm which, void* weight_grad, gemm::Epilogue epilogue, cudaStream_t stream);
  void weight_gradients(const ExpertGradients& experts, cudaStream_t stream);
  template <typename T>
  void allocate(DeviceBuffer<T>& buffer, int64_t count, const char* what, cudaStream_t stream);

  EpConfig config_;
  std::vector<__nv_bfloat16*> slots_;  // [source rank], more ranks only
  ExpertGradients last_experts_;
  KeptForward rows_in_use_;  // the last run's schedule and rows: kept, or the chain's own
  RouteRows route_rows_;     // the last run's: the chain's own buffers, or a fused backward's
  int64_t rows_ = 0;         // capacity: every row the schedule can hold
  planner::DevicePlanner planner_;
  DeviceBuffer<const int32_t*> ids_table_;
  DeviceBuffer<int32_t> token_count_;
  std::shared_ptr<BackwardRowBuffers> buffers_;  // the route rows
  DeviceBuffer<float> dw_scratch_;               // run_gemm's weight gradients
  void allocate_transposed_rows(cudaStream_t stream);
  void quantize_transposed_rows(cudaStream_t stream);
  gemm::GroupedGemm gemm_;
  TimelineSink timeline_;
};

}  // namespace pounce::moe

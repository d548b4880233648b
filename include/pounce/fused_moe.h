// pounce::FusedMoe — the fused Mixture-of-Experts layer. One persistent kernel per forward
// plans the routing on the GPU, pulls token rows from their source ranks, runs GEMM1 + SwiGLU and GEMM2
// on the compute SMs as rows arrive, pushes every output row back to its token's [token, k] slot and
// sums y[t] = sum_k w[t, k] * out[t, k] in fixed k order (bitwise deterministic). Its backward gives
// every gradient from what a training forward kept (on one GPU it can also replay a forward that kept
// nothing; across GPUs it needs the kept rows).
//
// Two ways to run an expert-parallel group of P ranks:
//   virtual ranks: all P ranks on the current GPU, in one launch (P = 1 is the plain one-GPU layer);
//   NCCL:          one rank per GPU, given an NCCL communicator of P ranks (one process per GPU, or one
//                  process driving several GPUs).
// Each rank holds the weights of its own E/P experts only.
//
// Limits (each enforced with a pounce::Error that names it):
//   ranks 1..8 (one NVLink node); experts divisible by ranks, at most 1024 per rank; top-k in [1, E];
//   hidden and intermediate positive multiples of 64, at most 65536; max_tokens_per_rank < 2^24;
//   tensors 16-byte aligned, on the layer's GPU. A forward occupies every SM it is given (one CTA per
//   SM, a cooperative launch): kernels on other streams do not run beside it.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "pounce/config.h"
#include "pounce/error.h"

struct ncclComm;  // nccl.h: typedef struct ncclComm* ncclComm_t

namespace pounce {

namespace moe {
class FusedLayer;
struct LayerTesting;
}  // namespace moe

// Optional tuning. Zero means "choose from the shape and the GPU"; the defaults are what the
// benchmarks measured best.
struct FusedMoeOptions {
  int ctas_per_rank = 0;                        // CTAs (one per SM) per rank; 0: the GPU's SMs / ranks on this GPU
  int comm_ctas = 0;                            // of those, CTAs that move rows (dispatch, combine); 0: from the shape
  int engine_rows = -1;                         // rows of each 128-row copy item the bulk-copy engine moves (the CTA's
                                                // warps move the rest); -1: balanced for the row length
  int64_t minibatch_rows = 0;                   // routed rows per minibatch (the fused backward's: at least 16
                                                // m-blocks); 0: two waves of GEMM1 tiles
  int64_t ring_blocks = 0;                      // ring size in 128-row blocks per rank; 0: as ring_bytes allows
  int64_t ring_bytes = 0;                       // ring budget per rank; 0: one rank: every routed row (then nothing is
                                                // combined), more ranks: 1 GiB or six minibatches, whichever is
                                                // more. docs/fused_moe.md gives the formula.
  uint64_t wait_timeout_ns = 5'000'000'000ull;  // any single wait inside the kernel; then a named error
  bool backward_replays = true;  // a backward without its kept forward replays it (false: throws instead)
  // On one GPU, a backward from a kept forward runs as one persistent kernel, the forward's with the
  // directions swapped (same bits as the chain of kernels). Off by default: there the two are within 1-2 %
  // on large experts and the chain is ~2 % faster on small ones (docs/backward.md). A layer across GPUs
  // always runs the persistent kernel.
  bool fused_backward = false;
  // One rank in place: a training forward keeps every routed row's x (its ring, R x H bf16, this layer's
  // own) for the backward's dW13. false: the ring is shared with the layers of the same shape and the
  // backward copies the x rows again from the forward's input (into rows shared by those layers too):
  // R x H x 2 bytes less per layer, one more copy of them per backward (docs/backward.md).
  bool keep_x_rows = true;
  // The backward chain's two data-gradient GEMMs in E4M3 (docs/backward.md#fp8-data-gradients), on copies
  // of the weights that refresh_fp8_weights() quantizes and transposes. Needs H and I multiples of 128 and
  // the chain: not with fused_backward, nor across GPUs (where only the persistent kernel runs).
  bool fp8_data_gradients = false;
  // The two weight-gradient GEMMs in E4M3, their operands (the route rows) quantized along the tokens
  // (docs/backward.md#fp8-data-gradients). Needs H and I multiples of 128; any backward path.
  bool fp8_weight_gradients = false;
  // The forward in E4M3 (docs/fused_moe.md#the-e4m3-forward): inside the kernel each rank quantizes its
  // tokens (1 x 128 blocks, power-of-two scales), dispatch moves the E4M3 rows and their scales, GEMM1 +
  // SwiGLU and GEMM2 run the FP8 grouped GEMM on weight copies that refresh_fp8_weights() quantizes
  // (128 x 128 blocks), and the hidden rows are quantized between the two GEMMs; combine and the sums stay
  // bf16. Needs H and I multiples of 128 and virtual ranks (one GPU); a training forward keeps its gate/up
  // rows as the BF16 one does, and its backward runs the chain (not with fused_backward).
  bool fp8_forward = false;
};

// This rank's experts, bf16, in device memory on the layer's GPU, 16-byte aligned.
struct ExpertWeights {
  const __nv_bfloat16* w13 = nullptr;  // [E/P, 2I, H]: gate and up rows interleaved in groups of 8
  const __nv_bfloat16* w2 = nullptr;   // [E/P, H, I]
};

// One rank's tensors for one forward, device pointers on the layer's GPU, 16-byte aligned.
struct RankIO {
  const __nv_bfloat16* x = nullptr;     // [tokens, H]
  const int32_t* topk_ids = nullptr;    // [tokens, k], global expert ids, distinct within a token
  const float* topk_weights = nullptr;  // [tokens, k]
  int64_t tokens = 0;                   // 0 .. max_tokens_per_rank
  __nv_bfloat16* y = nullptr;           // [tokens, H], written by the forward
};

// One rank's gradients for one backward, device pointers on the layer's GPU, 16-byte aligned.
struct RankGrads {
  const __nv_bfloat16* dy = nullptr;  // [tokens, H], the gradient of y
  __nv_bfloat16* dx = nullptr;        // [tokens, H]
  float* d_topk_weights = nullptr;    // [tokens, k]
  void* dw13 = nullptr;               // [E/P, 2I, H], bf16 or fp32 as WeightGradOutput says
  void* dw2 = nullptr;                // [E/P, H, I]
};

// How weight gradients are written: bf16, fp32, or added into an existing fp32 gradient (the "main
// grad" that training keeps across micro-batches).
enum class WeightGradOutput { kBf16 = 0, kF32 = 1, kAccumulateF32 = 2 };  // values of the C ABI's too

class FusedMoe {
 public:
  // Virtual ranks: all config.ranks ranks on the current GPU.
  explicit FusedMoe(const EpConfig& config, const FusedMoeOptions& options = {});
  // This GPU's rank of `comm`, a communicator of config.ranks ranks, one per GPU. Collective: every
  // rank constructs its layer with the same config and options (a mismatch throws, naming the field).
  FusedMoe(const EpConfig& config, ncclComm* comm, const FusedMoeOptions& options = {});
  // `{}` or nullptr in the communicator's place would choose the constructor above and fail at run time;
  // as a compile error instead: FusedMoe(config) or FusedMoe(config, options) is the one-GPU layer.
  FusedMoe(const EpConfig& config, std::nullptr_t, const FusedMoeOptions& options = {}) = delete;
  ~FusedMoe();
  FusedMoe(FusedMoe&&) noexcept;
  FusedMoe& operator=(FusedMoe&&) noexcept;

  // The weights of every rank on this GPU, in rank order: config.ranks entries for virtual ranks, one
  // for an NCCL rank. The layer keeps the pointers (no copy): the tensors must outlive its forwards, and
  // an update in place is seen by the next forward.
  void set_weights(std::span<const ExpertWeights> ranks);
  void set_weights(const ExpertWeights& weights) { set_weights(std::span(&weights, 1)); }

  // Enqueues one forward of every rank on this GPU on `stream`: one launch, no host synchronization, so
  // it can be captured in a CUDA graph. Throws on bad host-visible input (shapes, null or misaligned
  // pointers, calls in the wrong order). Bad routing ids are found on the device: check_device_errors()
  // reports them, and y is left untouched.
  // keep_for_backward (a training forward): the forward also keeps what its backward needs, the gate/up
  // rows before SwiGLU (2I bf16 per routed row) beside its schedule, so that backward neither plans again
  // nor recomputes GEMM1. The first such forward allocates them: run one before capturing a graph.
  void forward(std::span<const RankIO> ranks, cudaStream_t stream, bool keep_for_backward = false);
  void forward(const RankIO& rank, cudaStream_t stream, bool keep_for_backward = false) {
    forward(std::span(&rank, 1), stream, keep_for_backward);
  }

  // Enqueues the backward of a forward on the same inputs (the forward's RankIO, whose y is not read):
  // dx, the router-weight gradients and the weight gradients of every rank on this GPU (grads[r]: rank
  // r's tokens and its experts' weight gradients). No host synchronization. It starts from what the
  // forward kept when that forward is the layer's latest, kept its rows, and ran on these same inputs
  // and weights; otherwise it replays the forward's planning and GEMM1 (correct, slower:
  // last_backward_replayed() says which ran). A forward the host did not see in between (a CUDA graph
  // replay) is caught on the device and reported by check_device_errors(); inputs changed in place since
  // their forward are not detected. Keep each forward and its backward in order on one stream: the
  // backward reads the forward's buffers (and with more ranks writes its combine slots). On one GPU (one
  // rank or virtual ranks) it runs as a chain of pounce kernels, or see fused_backward. A layer across GPUs
  // (collective: every rank calls it) runs the persistent kernel from the kept rows only, and throws
  // without them. The first backward allocates its buffers (a replay, or a kept forward whose ring does
  // not hold every x row, needs more): run one of each kind before capturing a graph.
  // The backward's route rows (dy, d(gate, up), w.a and dx of every routed row: most of its memory) and
  // the forward's hidden and output rings carry nothing from one call to the next, so the layers of one
  // config on one GPU share one set (with a ring pair per ring size): a model of n such layers holds them
  // once. Their forwards and backwards therefore run one after another: enqueued from one host thread at a
  // time, each stream waiting on the GPU for the set's previous call. Not inside a CUDA graph capture: the caller
  // orders graph replays holding such calls with each other and with eager calls of layers of the same config (as it
  // orders a backward with the forward it follows); unordered, they may give wrong results. Across GPUs every rank must
  // call the forwards and backwards of its layers of one config in the same order (as a model does): a rank calling
  // them in another order makes its peers' kernels wait for calls queued behind others, until the bounded waits end it
  // with an error.
  void backward(std::span<const RankIO> forward_inputs, std::span<const RankGrads> grads, WeightGradOutput mode,
                cudaStream_t stream);
  void backward(const RankIO& forward_input, const RankGrads& grads, WeightGradOutput mode, cudaStream_t stream) {
    backward(std::span(&forward_input, 1), std::span(&grads, 1), mode, stream);
  }

  // With FusedMoeOptions::fp8_forward or fp8_data_gradients: quantizes the weights of set_weights into the
  // E4M3 copies the forward's GEMMs (fp8_forward) and the backward's data gradients read, on `stream`.
  // Call it after set_weights and after every update of the weights' values (the layer cannot see updates
  // in place); before the first call after set_weights, a forward refuses to run with fp8_forward and a
  // backward with fp8_data_gradients. The first call allocates the backward's copies: make it before
  // capturing a graph.
  void refresh_fp8_weights(cudaStream_t stream);

  // After the stream has synchronized: throws pounce::Error describing a failure inside the kernel (bad
  // routing, a routing past max_routes_per_rank; or a wait that gave up, with its likely cause and the
  // counter it watched). On one GPU the layer is then ready for the next forward; a layer spanning GPUs
  // must be rebuilt on every rank.
  void check_device_errors();

  const EpConfig& config() const;
  int ranks_on_this_gpu() const;
  // What the layer resolved its options to.
  int ctas_per_rank() const;
  int comm_ctas() const;
  int engine_rows() const;
  int64_t minibatch_rows() const;
  int64_t backward_minibatch_rows() const;  // of the fused backward (FusedMoeOptions::fused_backward)
  int64_t ring_blocks() const;
  bool in_place() const;  // one rank whose ring holds every routed row: nothing is combined
  int64_t max_m_blocks() const;
  // Device memory the layer allocated on this GPU (ring, schedule, counters, combine slots; after the
  // first backward, the backward's buffers too), weights and the caller's tensors not included. Of it,
  // shared_device_bytes() is the rings and route rows shared with the other layers of the same config on
  // this GPU (see backward()), all that any of them made so far; layers with the same
  // shared_buffers_id() hold the same set, so the memory of several layers is their device_bytes() less
  // their shared part, plus each set once.
  int64_t device_bytes() const;
  int64_t shared_device_bytes() const;
  const void* shared_buffers_id() const;
  // Whether the latest backward had to replay its forward (nothing kept for it; see backward()).
  bool last_backward_replayed() const;

  // The in-kernel timeline, in a build configured with -DPOUNCE_TIMELINE=ON (otherwise start_timeline
  // throws). From start_timeline on, every forward and backward of this layer records what each CTA did
  // and when: planning, row moves, each GEMM tile's mainloop and epilogue, the sums (up to max_events
  // spans; a second start_timeline starts afresh). stop_timeline synchronizes the device and returns them
  // as Chrome trace JSON (open it in ui.perfetto.dev; tools/timeline.py draws it). It throws if the
  // buffer overflowed. Do not capture a CUDA graph while a timeline records: its launches would keep
  // writing into the buffer that stop_timeline frees.
  void start_timeline(int64_t max_events = int64_t(1) << 21);
  std::string stop_timeline();

 private:
  friend struct moe::LayerTesting;
  std::unique_ptr<moe::FusedLayer> layer_;
};

}  // namespace pounce

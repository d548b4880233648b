// pounce's unfused expert-parallel chain: the baseline the fused layer is measured against across GPUs,
// built the way expert parallelism is usually run (an all-to-all each way around the expert GEMMs), with
// pounce's own kernels. On every rank:
//   1. permute: the x row of each route into a send buffer, grouped by the rank that holds its expert,
//      then by that expert, then in (token, k) order;
//   2. all-to-all of those rows (NCCL grouped sends and receives; virtual ranks on one GPU: copies);
//   3. the received rows permuted into the expert-contiguous layout the grouped GEMM reads (padded to
//      128-row m-blocks), GEMM1 + SwiGLU, GEMM2, and the output rows permuted back into received order;
//   4. the all-to-all back;
//   5. the weighted combine: y[t] = sum_k w[t,k] * row of route (t, k), k in order, fp32.
// The routing is planned on the host from every rank's topk_ids, once, outside the forward: the chain's
// best case (no exchange of counts, no host synchronization in a forward).
// The backward retraces it: dy rows (and each route's router weight) out by the dispatch exchange, the
// experts' data gradients (dgrad down, the SwiGLU backward with the router weights and each route's
// <da, a>, dgrad gate/up) and weight gradients on the expert ranks, dx rows (and the route dots) back by
// the return exchange, then dx[t] = sum_k of its rows and d_topk_weights[t, k] = <da, a> of the route.
// A training forward keeps GEMM1's gate/up rows (GEMM1, then a SwiGLU pass) and the x rows it pooled.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdint>
#include <span>
#include <vector>

#include "common/device_buffer.h"
#include "gemm/grouped_gemm.h"
#include "pounce/config.h"
#include "pounce/fused_moe.h"

namespace pounce::baseline {

// One exchange of one rank: rows to every destination rank, in rank order, from `send`; rows from every
// source rank, in rank order, into `recv`. A row is `row_bytes` bytes: H bf16, or one float.
struct RowExchange {
  const void* send = nullptr;
  std::vector<int64_t> send_rows;  // [P]
  void* recv = nullptr;
  std::vector<int64_t> recv_rows;  // [P]
  int64_t row_bytes = 0;
};

enum class Exchange {
  kDispatch,  // x rows (forward) or dy rows (backward) to the experts' ranks
  kReturn,    // output rows (forward) or dx rows (backward) back to their source ranks
  kWeights,   // backward: each route's router weight, beside its dy row
  kDots,      // backward: each route's <da, a> (its router-weight gradient), beside its dx row
};

class UnfusedEpMoe {
 public:
  // Rank `rank` of config.ranks; it holds experts [rank E/P, (rank + 1) E/P).
  UnfusedEpMoe(const EpConfig& config, int rank);

  // This rank's experts: w13 [E/P, 2I, H] (gate and up rows interleaved in groups of 8), w2 [E/P, H, I].
  void set_weights(const __nv_bfloat16* w13, const __nv_bfloat16* w2);
  // Every rank's routing, topk_ids[r] = rank r's [tokens_r, k] (host): expert ids checked against the
  // range, then planned. It replaces the chain's tables: synchronize with its last forward first.
  void set_routing(std::span<const std::vector<int32_t>> topk_ids);

  // The forward's steps, on one stream, with the two exchanges between them (exchange_on_one_gpu or
  // exchange_over_nccl): permute_for_dispatch, kDispatch, run_experts, kReturn, combine. A training
  // forward (keep_for_backward) keeps what the backward reads.
  void permute_for_dispatch(const __nv_bfloat16* x, cudaStream_t stream);
  void run_experts(cudaStream_t stream, bool keep_for_backward = false);
  void combine(const float* topk_weights, __nv_bfloat16* y, cudaStream_t stream);
  // The backward of the latest training forward, on the same routing: permute_for_backward, kDispatch and
  // kWeights, run_experts_backward, kReturn and kDots, combine_backward. Weight gradients of this rank's
  // experts: dw13 [E/P, 2I, H], dw2 [E/P, H, I], bf16 or fp32, or added into fp32 (`output`).
  void permute_for_backward(const __nv_bfloat16* dy, const float* topk_weights, cudaStream_t stream);
  void run_experts_backward(void* dw13, void* dw2, WeightGradOutput output, cudaStream_t stream);
  void combine_backward(__nv_bfloat16* dx, float* d_topk_weights, cudaStream_t stream);
  RowExchange exchange(Exchange which) const;

  int64_t tokens() const { return tokens_; }
  // Rows this rank sends to other ranks in one forward, both exchanges together (it receives as many:
  // what goes out in one exchange comes back in the other).
  int64_t rows_to_others() const;
  // After synchronizing: throws if a GEMM reported a device-side error.
  void check_device_errors() { gemm_.check_device_errors(); }

 private:
  void m_grouped(const __nv_bfloat16* a, const __nv_bfloat16* b, gemm::Major b_major, int64_t n, int64_t k,
                 __nv_bfloat16* c, gemm::Epilogue epilogue, cudaStream_t stream);

  EpConfig config_;
  int rank_;
  int64_t tokens_ = 0;
  const __nv_bfloat16* w13_ = nullptr;
  const __nv_bfloat16* w2_ = nullptr;
  std::vector<int64_t> send_rows_, recv_rows_;  // [P]: this rank's rows to and from each rank
  int64_t padded_rows_ = 0;
  bool kept_ = false;                     // the latest forward kept its rows for a backward
  DeviceBuffer<int32_t> send_token_;      // [sent rows]: the token of each send row
  DeviceBuffer<int32_t> send_route_;      // [sent rows]: the route (t * k + j) of each send row
  DeviceBuffer<int32_t> route_row_;       // [tokens, k]: the send (and returned) row of each route
  DeviceBuffer<int32_t> pool_source_;     // [padded rows]: the received row of each GEMM row, -1: padding
  DeviceBuffer<int32_t> pool_row_;        // [received rows]: the GEMM row of each received row
  DeviceBuffer<int32_t> expert_offsets_;  // [E/P + 1]
  DeviceBuffer<int32_t> expert_rows_;     // [E/P]: the routed rows of each expert
  // Rows in send, received and GEMM (pool) order. The backward reuses the forward's exchange buffers for
  // its dy and dx rows, and reads the pooled x rows (pool_) and the kept gate/up rows (h13_).
  DeviceBuffer<__nv_bfloat16> send_, recv_, pool_, hidden_, out_, back_send_, back_recv_;
  DeviceBuffer<__nv_bfloat16> h13_, dy_pool_, da_, dgu_, wa_;  // [padded rows, 2I / H / I / 2I / I]
  // One float per row: router weights (send, received, pool order) and route dots (pool, received, send).
  DeviceBuffer<float> weight_send_, weight_recv_, weight_pool_, dot_pool_, dot_back_send_, dot_back_recv_;
  gemm::GroupedGemm gemm_;
};

// One exchange of virtual ranks on one GPU (ranks[r] is rank r): copies, in stream order.
void exchange_on_one_gpu(std::span<UnfusedEpMoe* const> ranks, Exchange which, cudaStream_t stream);
// One rank's part of an exchange over NCCL: grouped sends and receives on `stream`.
void exchange_over_nccl(const RowExchange& exchange, ncclComm_t comm, cudaStream_t stream);

}  // namespace pounce::baseline

#include "baseline/unfused_ep.h"

#include <numeric>

#include "baseline/moe_kernels.h"
#include "comm/nccl_window.h"
#include "common/cuda_check.h"
#include "common/require.h"
#include "common/tiles.h"
#include "moe/backward/backward_chain.h"
#include "moe/backward/backward_kernels.h"

namespace pounce::baseline {

UnfusedEpMoe::UnfusedEpMoe(const EpConfig& config, int rank) : config_(config), rank_(rank) {
  check_config(config);
  POUNCE_REQUIRE(rank >= 0 && rank < config.ranks, "unfused EP chain: rank ", rank, " of ", config.ranks);
}

void UnfusedEpMoe::set_weights(const __nv_bfloat16* w13, const __nv_bfloat16* w2) {
  POUNCE_REQUIRE(w13 && w2, "unfused EP chain: null weight pointer");
  w13_ = w13;
  w2_ = w2;
}

namespace {

// Grows `buffer` to at least `count` elements (one at least: kernels and TMA descriptors get a pointer).
template <typename T>
void reserve(DeviceBuffer<T>& buffer, int64_t count) {
  if (int64_t(buffer.size()) < std::max<int64_t>(count, 1)) buffer = DeviceBuffer<T>(std::max<int64_t>(count, 1));
}

int64_t total(const std::vector<int64_t>& rows) { return std::accumulate(rows.begin(), rows.end(), int64_t(0)); }

}  // namespace

void UnfusedEpMoe::set_routing(std::span<const std::vector<int32_t>> topk_ids) {
  const int P = config_.ranks, k = config_.topk, E = config_.experts, local = config_.local_experts();
  POUNCE_REQUIRE(int(topk_ids.size()) == P, "unfused EP chain: routing of ", topk_ids.size(), " ranks, the chain has ",
                 P);
  // routes[s][d * local + e]: routes of rank s to local expert e of rank d.
  std::vector<std::vector<int64_t>> routes(P, std::vector<int64_t>(int64_t(P) * local, 0));
  for (int s = 0; s < P; ++s) {
    POUNCE_REQUIRE(topk_ids[s].size() % k == 0 && int64_t(topk_ids[s].size()) / k <= config_.max_tokens_per_rank,
                   "unfused EP chain: rank ", s, "'s topk_ids hold ", topk_ids[s].size(), " entries: not [tokens, ", k,
                   "] with at most ", config_.max_tokens_per_rank, " tokens");
    for (size_t i = 0; i < topk_ids[s].size(); ++i) {
      const int32_t e = topk_ids[s][i];
      POUNCE_REQUIRE(e >= 0 && e < E, "unfused EP chain: rank ", s, " token ", i / k, " routes to expert ", e,
                     ", outside [0, ", E, ")");
      ++routes[s][e];
    }
  }
  const std::vector<int32_t>& mine = topk_ids[rank_];
  tokens_ = int64_t(mine.size()) / k;

  // Send side: runs (destination, expert) in order, each in (token, k) order.
  std::vector<int64_t> run_start(int64_t(P) * local + 1, 0);
  std::partial_sum(routes[rank_].begin(), routes[rank_].end(), run_start.begin() + 1);
  send_rows_.assign(P, 0);
  for (int d = 0; d < P; ++d) send_rows_[d] = run_start[(d + 1) * local] - run_start[d * local];
  std::vector<int32_t> send_token(run_start.back()), send_route(run_start.back()), route_row(mine.size());
  std::vector<int64_t> next = run_start;
  for (size_t i = 0; i < mine.size(); ++i) {
    const int64_t row = next[mine[i]]++;
    send_token[row] = int32_t(i / k);
    send_route[row] = int32_t(i);
    route_row[i] = int32_t(row);
  }

  // Receive side: the block of each source in rank order, each holding its runs for this rank's experts
  // in expert order. The GEMM's layout: expert e's rows from every source in source order, padded.
  recv_rows_.assign(P, 0);
  std::vector<int64_t> expert_routes(local, 0);
  for (int s = 0; s < P; ++s)
    for (int e = 0; e < local; ++e) {
      recv_rows_[s] += routes[s][int64_t(rank_) * local + e];
      expert_routes[e] += routes[s][int64_t(rank_) * local + e];
    }
  std::vector<int32_t> offsets(local + 1, 0);
  for (int e = 0; e < local; ++e)
    offsets[e + 1] = offsets[e] + int32_t((expert_routes[e] + kBlockM - 1) / kBlockM * kBlockM);
  padded_rows_ = offsets[local];
  const int64_t received = std::accumulate(recv_rows_.begin(), recv_rows_.end(), int64_t(0));
  std::vector<int32_t> pool_source(padded_rows_, -1), pool_row(received);
  std::vector<int64_t> filled(offsets.begin(), offsets.end() - 1);  // next GEMM row of each expert
  int64_t at = 0;                                                   // received row
  for (int s = 0; s < P; ++s)
    for (int e = 0; e < local; ++e)
      for (int64_t i = 0; i < routes[s][int64_t(rank_) * local + e]; ++i, ++at) {
        pool_source[filled[e]] = int32_t(at);
        pool_row[at] = int32_t(filled[e]++);
      }

  const int64_t H = config_.hidden, I = config_.intermediate;
  const int64_t sent = run_start.back();
  reserve(send_token_, sent);
  reserve(send_route_, sent);
  reserve(route_row_, int64_t(route_row.size()));
  reserve(pool_source_, padded_rows_);
  reserve(pool_row_, received);
  reserve(expert_offsets_, local + 1);
  reserve(expert_rows_, local);
  send_token_.upload(send_token);
  send_route_.upload(send_route);
  route_row_.upload(route_row);
  pool_source_.upload(pool_source);
  pool_row_.upload(pool_row);
  expert_offsets_.upload(offsets);
  expert_rows_.upload(std::vector<int32_t>(expert_routes.begin(), expert_routes.end()));
  for (auto [buffer, rows] :
       {std::pair(&send_, sent), std::pair(&back_recv_, sent), std::pair(&recv_, received),
        std::pair(&back_send_, received), std::pair(&pool_, padded_rows_), std::pair(&out_, padded_rows_)})
    reserve(*buffer, rows * H);
  reserve(hidden_, padded_rows_ * I);
  // The backward's one float per row (router weights out, route dots back), small: reserved here, so
  // every rank's exchange buffers exist before any rank's backward exchanges.
  for (auto [buffer, rows] : {std::pair(&weight_send_, sent), std::pair(&dot_back_recv_, sent),
                              std::pair(&weight_recv_, received), std::pair(&dot_back_send_, received),
                              std::pair(&weight_pool_, padded_rows_), std::pair(&dot_pool_, padded_rows_)})
    reserve(*buffer, rows);
  kept_ = false;  // a new routing: no forward of it kept anything yet
}

void UnfusedEpMoe::permute_for_dispatch(const __nv_bfloat16* x, cudaStream_t stream) {
  POUNCE_REQUIRE(w13_ != nullptr && !send_rows_.empty(), "unfused EP chain: call set_weights and set_routing first");
  permute_rows(x, send_token_.data(), total(send_rows_), config_.hidden, send_.data(), stream);
}

void UnfusedEpMoe::m_grouped(const __nv_bfloat16* a, const __nv_bfloat16* b, gemm::Major b_major, int64_t n, int64_t k,
                             __nv_bfloat16* c, gemm::Epilogue epilogue, cudaStream_t stream) {
  gemm::GroupedGemmArgs g;
  g.a = a;
  g.a_rows = padded_rows_;
  g.b = b;
  g.b_major = b_major;
  g.experts = config_.local_experts();
  g.n = n;
  g.k = k;
  g.c = c;
  g.expert_offsets = expert_offsets_.data();
  g.expert_rows = expert_rows_.data();
  g.epilogue = epilogue;
  gemm_.run(g, stream);
}

void UnfusedEpMoe::run_experts(cudaStream_t stream, bool keep_for_backward) {
  const int64_t H = config_.hidden, I = config_.intermediate;
  permute_rows(recv_.data(), pool_source_.data(), padded_rows_, H, pool_.data(), stream);
  if (keep_for_backward) {  // the gate/up rows stay for the SwiGLU backward
    reserve(h13_, padded_rows_ * 2 * I);
    m_grouped(pool_.data(), w13_, gemm::Major::kK, 2 * I, H, h13_.data(), gemm::Epilogue::kStore, stream);
    swiglu_rows(h13_.data(), padded_rows_, I, hidden_.data(), stream);
  } else {
    m_grouped(pool_.data(), w13_, gemm::Major::kK, 2 * I, H, hidden_.data(), gemm::Epilogue::kSwiGLU, stream);
  }
  m_grouped(hidden_.data(), w2_, gemm::Major::kK, H, I, out_.data(), gemm::Epilogue::kStore, stream);
  permute_rows(out_.data(), pool_row_.data(), total(recv_rows_), H, back_send_.data(), stream);
  kept_ = keep_for_backward;
}

void UnfusedEpMoe::permute_for_backward(const __nv_bfloat16* dy, const float* topk_weights, cudaStream_t stream) {
  POUNCE_REQUIRE(kept_,
                 "unfused EP chain: backward without a training forward on this routing "
                 "(run_experts with keep_for_backward)");
  const int64_t sent = total(send_rows_);
  permute_rows(dy, send_token_.data(), sent, config_.hidden, send_.data(), stream);
  gather_values(topk_weights, send_route_.data(), sent, weight_send_.data(), stream);
}

void UnfusedEpMoe::run_experts_backward(void* dw13, void* dw2, WeightGradOutput output, cudaStream_t stream) {
  POUNCE_REQUIRE(kept_,
                 "unfused EP chain: backward without a training forward on this routing "
                 "(run_experts with keep_for_backward)");
  POUNCE_REQUIRE(dw13 && dw2, "unfused EP chain: null weight-gradient pointer");
  const int64_t H = config_.hidden, I = config_.intermediate, rows = padded_rows_, received = total(recv_rows_);
  for (auto [buffer, width] :
       {std::pair(&dy_pool_, H), std::pair(&da_, I), std::pair(&dgu_, 2 * I), std::pair(&wa_, I)})
    reserve(*buffer, rows * width);
  // Into the GEMMs' layout (padding rows: zero dy, zero weight).
  permute_rows(recv_.data(), pool_source_.data(), rows, H, dy_pool_.data(), stream);
  gather_values(weight_recv_.data(), pool_source_.data(), rows, weight_pool_.data(), stream);
  m_grouped(dy_pool_.data(), w2_, gemm::Major::kMN, I, H, da_.data(), gemm::Epilogue::kStore, stream);
  // Padding rows (pool_source -1) come out zero, as the weight gradients need.
  moe::backward::swiglu_backward_rows(h13_.data(), da_.data(), weight_pool_.data(), pool_source_.data(), rows, I,
                                      dgu_.data(), wa_.data(), dot_pool_.data(), stream);
  m_grouped(dgu_.data(), w13_, gemm::Major::kMN, H, 2 * I, out_.data(), gemm::Epilogue::kStore, stream);
  permute_rows(out_.data(), pool_row_.data(), received, H, back_send_.data(), stream);
  gather_values(dot_pool_.data(), pool_row_.data(), received, dot_back_send_.data(), stream);

  const gemm::Epilogue epilogue = moe::weight_grad_epilogue(output);
  const auto k_grouped = [&](const __nv_bfloat16* a, int64_t m, const __nv_bfloat16* b, int64_t n, void* c) {
    gemm::KGroupedGemmArgs g;
    g.a = a;
    g.b = b;
    g.rows = rows;
    g.m = m;
    g.n = n;
    g.experts = config_.local_experts();
    g.expert_offsets = expert_offsets_.data();
    g.expert_rows = expert_rows_.data();
    g.c = c;
    g.epilogue = epilogue;
    gemm_.run_k_grouped(g, stream);
  };
  k_grouped(dy_pool_.data(), H, wa_.data(), I, dw2);     // dW2[e] = dy_rows^T . w a
  k_grouped(dgu_.data(), 2 * I, pool_.data(), H, dw13);  // dW13[e] = dgu^T . x_rows
}

void UnfusedEpMoe::combine_backward(__nv_bfloat16* dx, float* d_topk_weights, cudaStream_t stream) {
  moe::backward::combine_gradients(back_recv_.data(), dot_back_recv_.data(), route_row_.data(), tokens_, config_.topk,
                                   config_.hidden, dx, d_topk_weights, stream);
}

void UnfusedEpMoe::combine(const float* topk_weights, __nv_bfloat16* y, cudaStream_t stream) {
  weighted_combine(back_recv_.data(), route_row_.data(), topk_weights, tokens_, config_.topk, config_.hidden, y,
                   stream);
}

RowExchange UnfusedEpMoe::exchange(Exchange which) const {
  const int64_t row = config_.hidden * int64_t(sizeof(__nv_bfloat16));
  switch (which) {
    case Exchange::kDispatch:
      return {send_.data(), send_rows_, recv_.data(), recv_rows_, row};
    case Exchange::kReturn:
      return {back_send_.data(), recv_rows_, back_recv_.data(), send_rows_, row};
    case Exchange::kWeights:
      return {weight_send_.data(), send_rows_, weight_recv_.data(), recv_rows_, sizeof(float)};
    case Exchange::kDots:
      return {dot_back_send_.data(), recv_rows_, dot_back_recv_.data(), send_rows_, sizeof(float)};
  }
  return {};
}

int64_t UnfusedEpMoe::rows_to_others() const {
  return total(send_rows_) - send_rows_[rank_] + total(recv_rows_) - recv_rows_[rank_];
}

void exchange_on_one_gpu(std::span<UnfusedEpMoe* const> ranks, Exchange which, cudaStream_t stream) {
  const int P = int(ranks.size());
  std::vector<RowExchange> ex;
  for (const UnfusedEpMoe* r : ranks) ex.push_back(r->exchange(which));
  for (int s = 0; s < P; ++s) {
    int64_t from = 0;  // rows of s's send buffer before destination d's
    for (int d = 0; d < P; ++d) {
      int64_t to = 0;  // rows of d's receive buffer before source s's
      for (int q = 0; q < s; ++q) to += ex[d].recv_rows[q];
      const int64_t rows = ex[s].send_rows[d];
      POUNCE_REQUIRE(rows == ex[d].recv_rows[s], "unfused EP chain: rank ", s, " sends ", rows, " rows to rank ", d,
                     ", which expects ", ex[d].recv_rows[s], " (routings set differently)");
      const int64_t bytes = ex[s].row_bytes;
      if (rows > 0)
        CUDA_CHECK(cudaMemcpyAsync(static_cast<uint8_t*>(ex[d].recv) + to * bytes,
                                   static_cast<const uint8_t*>(ex[s].send) + from * bytes, rows * bytes,
                                   cudaMemcpyDeviceToDevice, stream));
      from += rows;
    }
  }
}

void exchange_over_nccl(const RowExchange& exchange, ncclComm_t comm, cudaStream_t stream) {
  const int P = int(exchange.send_rows.size());
  const int64_t bytes = exchange.row_bytes;  // rows move as bytes: NCCL copies them, it does not reduce
  const auto* send = static_cast<const uint8_t*>(exchange.send);
  auto* recv = static_cast<uint8_t*>(exchange.recv);
  NCCL_CHECK(ncclGroupStart());
  int64_t sent = 0, received = 0;
  for (int r = 0; r < P; ++r) {
    if (exchange.send_rows[r] > 0)
      NCCL_CHECK(ncclSend(send + sent * bytes, size_t(exchange.send_rows[r] * bytes), ncclUint8, r, comm, stream));
    if (exchange.recv_rows[r] > 0)
      NCCL_CHECK(ncclRecv(recv + received * bytes, size_t(exchange.recv_rows[r] * bytes), ncclUint8, r, comm, stream));
    sent += exchange.send_rows[r];
    received += exchange.recv_rows[r];
  }
  NCCL_CHECK(ncclGroupEnd());
}

}  // namespace pounce::baseline

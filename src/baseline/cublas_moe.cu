#include "baseline/cublas_moe.h"

#include <algorithm>

#include "common/cuda_check.h"
#include "planner/schedule.h"

namespace pounce::baseline {

namespace {

constexpr int kThreads = 256;
constexpr int kVec = 8;  // bf16 per 16-byte access

// Enough CTAs to fill an H200 several times over; kernels stride over the rest.
int grid_for(int64_t items) { return int(std::clamp<int64_t>(items, 1, 132 * 16)); }

__global__ void permute_rows_kernel(const uint4* x, const int32_t* row_token, int64_t rows, int64_t vecs_per_row,
                                    uint4* pool) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int32_t t = row_token[r];
    for (int64_t v = threadIdx.x; v < vecs_per_row; v += blockDim.x)
      pool[r * vecs_per_row + v] = t >= 0 ? x[t * vecs_per_row + v] : make_uint4(0, 0, 0, 0);
  }
}

__device__ __forceinline__ float silu(float g) { return g / (1.0f + __expf(-g)); }

__global__ void swiglu_kernel(const uint4* h13, int64_t groups_per_row, int64_t total_groups, uint4* hidden) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total_groups;
       i += int64_t(gridDim.x) * blockDim.x) {
    // Group j of row r: gate values at h13 vector 2j, the matching up values at 2j + 1.
    const int64_t r = i / groups_per_row, j = i % groups_per_row;
    const uint4 gate_bits = h13[(r * groups_per_row + j) * 2];
    const uint4 up_bits = h13[(r * groups_per_row + j) * 2 + 1];
    const __nv_bfloat162* gate = reinterpret_cast<const __nv_bfloat162*>(&gate_bits);
    const __nv_bfloat162* up = reinterpret_cast<const __nv_bfloat162*>(&up_bits);
    uint4 out_bits;
    __nv_bfloat162* out = reinterpret_cast<__nv_bfloat162*>(&out_bits);
    for (int p = 0; p < kVec / 2; ++p) {
      const float2 g = __bfloat1622float2(gate[p]), u = __bfloat1622float2(up[p]);
      out[p] = __floats2bfloat162_rn(silu(g.x) * u.x, silu(g.y) * u.y);
    }
    hidden[i] = out_bits;
  }
}

__global__ void weighted_combine_kernel(const uint4* out, const int32_t* route_row, const float* topk_weights,
                                        int64_t tokens, int64_t topk, int64_t vecs_per_row, uint4* y) {
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    for (int64_t v = threadIdx.x; v < vecs_per_row; v += blockDim.x) {
      float acc[kVec] = {};
      for (int64_t k = 0; k < topk; ++k) {  // fixed k order: bitwise deterministic
        const float w = topk_weights[t * topk + k];
        const uint4 bits = out[route_row[t * topk + k] * vecs_per_row + v];
        const __nv_bfloat162* o = reinterpret_cast<const __nv_bfloat162*>(&bits);
        for (int p = 0; p < kVec / 2; ++p) {
          const float2 f = __bfloat1622float2(o[p]);
          acc[2 * p] += w * f.x;
          acc[2 * p + 1] += w * f.y;
        }
      }
      uint4 result;
      __nv_bfloat162* r = reinterpret_cast<__nv_bfloat162*>(&result);
      for (int p = 0; p < kVec / 2; ++p) r[p] = __floats2bfloat162_rn(acc[2 * p], acc[2 * p + 1]);
      y[t * vecs_per_row + v] = result;
    }
  }
}

}  // namespace

const char* gemm_calls_name(GemmCalls calls) {
  return calls == GemmCalls::kLoop ? "cublas_loop" : "cublas_grouped_batched";
}

void permute_rows(const __nv_bfloat16* x, const int32_t* row_token, int64_t rows, int64_t hidden,
                  __nv_bfloat16* pool, cudaStream_t stream) {
  POUNCE_REQUIRE(hidden % kVec == 0, "permute_rows: hidden = ", hidden, " must be a multiple of ", kVec);
  if (rows == 0) return;
  permute_rows_kernel<<<grid_for(rows), kThreads, 0, stream>>>(reinterpret_cast<const uint4*>(x), row_token, rows,
                                                               hidden / kVec, reinterpret_cast<uint4*>(pool));
  CUDA_CHECK_LAUNCH();
}

void swiglu_rows(const __nv_bfloat16* h13, int64_t rows, int64_t intermediate, __nv_bfloat16* hidden,
                 cudaStream_t stream) {
  POUNCE_REQUIRE(intermediate % kVec == 0, "swiglu_rows: intermediate = ", intermediate, " must be a multiple of 8");
  const int64_t total = rows * intermediate / kVec;
  if (total == 0) return;
  swiglu_kernel<<<grid_for((total + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      reinterpret_cast<const uint4*>(h13), intermediate / kVec, total, reinterpret_cast<uint4*>(hidden));
  CUDA_CHECK_LAUNCH();
}

void weighted_combine(const __nv_bfloat16* out, const int32_t* route_row, const float* topk_weights, int64_t tokens,
                      int64_t topk, int64_t hidden, __nv_bfloat16* y, cudaStream_t stream) {
  POUNCE_REQUIRE(hidden % kVec == 0, "weighted_combine: hidden = ", hidden, " must be a multiple of ", kVec);
  if (tokens == 0) return;
  weighted_combine_kernel<<<grid_for(tokens), kThreads, 0, stream>>>(reinterpret_cast<const uint4*>(out), route_row,
                                                                     topk_weights, tokens, topk, hidden / kVec,
                                                                     reinterpret_cast<uint4*>(y));
  CUDA_CHECK_LAUNCH();
}

namespace {

planner::EpConfig single_rank_config(const MoeDims& d) {
  planner::EpConfig c;
  c.ranks = 1;
  c.experts = int(d.experts);
  c.topk = int(d.topk);
  c.hidden = d.hidden;
  c.intermediate = d.intermediate;
  c.max_tokens_per_rank = d.max_tokens;
  return c;
}

}  // namespace

CublasMoe::CublasMoe(const MoeDims& dims) : dims_(dims) {
  const planner::Capacity cap = planner::worst_case_capacity(single_rank_config(dims));  // validates dims
  const int64_t rows = cap.max_padded_rows;
  row_token_ = DeviceBuffer<int32_t>(rows);
  route_row_ = DeviceBuffer<int32_t>(dims.max_tokens * dims.topk);
  pool_ = DeviceBuffer<__nv_bfloat16>(rows * dims.hidden);
  h13_ = DeviceBuffer<__nv_bfloat16>(rows * 2 * dims.intermediate);
  hidden_ = DeviceBuffer<__nv_bfloat16>(rows * dims.intermediate);
  out_ = DeviceBuffer<__nv_bfloat16>(rows * dims.hidden);
  CUBLAS_CHECK(cublasCreate(&handle_));
}

CublasMoe::~CublasMoe() {
  if (handle_) cublasDestroy(handle_);
}

void CublasMoe::set_weights(const __nv_bfloat16* w13, const __nv_bfloat16* w2) {
  POUNCE_REQUIRE(w13 && w2, "CublasMoe::set_weights: null weight pointer");
  w13_ = w13;
  w2_ = w2;
  has_routing_ = false;  // the plan holds pointers into the old weights
}

void CublasMoe::set_routing(std::span<const int32_t> topk_ids, int64_t tokens) {
  POUNCE_REQUIRE(w13_ && w2_, "CublasMoe::set_routing: call set_weights first");
  has_routing_ = false;
  const planner::EpConfig config = single_rank_config(dims_);
  const std::span<const int32_t> per_rank[1] = {topk_ids};
  const int64_t token_counts[1] = {tokens};
  const planner::RankSchedule s = planner::build_schedule(config, 0, per_rank, token_counts, planner::kBlockM);

  has_routing_ = true;
  tokens_ = tokens;
  routes_ = s.routes();
  padded_rows_ = s.padded_rows();
  expert_routes_ = s.expert_routes;
  expert_offsets_ = s.expert_offsets;
  std::vector<int32_t> route_row(tokens * dims_.topk, -1);
  for (int64_t row = 0; row < padded_rows_; ++row)
    if (s.row_token[row] >= 0) route_row[int64_t(s.row_token[row]) * dims_.topk + s.row_k[row]] = int32_t(row);
  row_token_.upload(s.row_token);
  route_row_.upload(route_row);

  // Row-major C[M,N] = A[M,K] . B[N,K]^T is column-major C^T = op_T(B) . A: cuBLAS gets (N, M, K).
  const int64_t H = dims_.hidden, I = dims_.intermediate;
  for (int which = 0; which < 2; ++which) {
    Grouped& g = grouped_[which];
    g = Grouped{};
    const int64_t N = which == 0 ? 2 * I : H, K = which == 0 ? H : I;
    for (int64_t e = 0; e < dims_.experts; ++e) {
      if (expert_routes_[e] == 0) continue;  // cuBLAS rejects empty groups
      const int64_t row0 = expert_offsets_[e];
      g.m.push_back(int(N));
      g.n.push_back(expert_routes_[e]);
      g.k.push_back(int(K));
      g.group_size.push_back(1);
      g.trans_a.push_back(CUBLAS_OP_T);
      g.trans_b.push_back(CUBLAS_OP_N);
      g.alpha.push_back(1.0f);
      g.beta.push_back(0.0f);
      g.a_host.push_back(which == 0 ? static_cast<const void*>(w13_ + e * 2 * I * H) : w2_ + e * H * I);
      g.b_host.push_back(which == 0 ? static_cast<const void*>(pool_.data() + row0 * H) : hidden_.data() + row0 * I);
      g.c_host.push_back(which == 0 ? static_cast<void*>(h13_.data() + row0 * 2 * I) : out_.data() + row0 * H);
    }
    g.lda = g.k;  // both operands are K-major
    g.ldb = g.k;
    g.ldc = g.m;
    g.a = DeviceBuffer<const void*>(g.a_host);
    g.b = DeviceBuffer<const void*>(g.b_host);
    g.c = DeviceBuffer<void*>(g.c_host);
  }
}

void CublasMoe::gemm(GemmCalls calls, int which) {
  const Grouped& g = grouped_[which];
  const int groups = int(g.group_size.size());
  if (groups == 0) return;
  if (calls == GemmCalls::kGroupedBatched) {
    CUBLAS_CHECK(cublasGemmGroupedBatchedEx(handle_, g.trans_a.data(), g.trans_b.data(), g.m.data(), g.n.data(),
                                            g.k.data(), g.alpha.data(), g.a.data(), CUDA_R_16BF, g.lda.data(),
                                            g.b.data(), CUDA_R_16BF, g.ldb.data(), g.beta.data(), g.c.data(),
                                            CUDA_R_16BF, g.ldc.data(), groups, g.group_size.data(),
                                            CUBLAS_COMPUTE_32F));
    return;
  }
  for (int i = 0; i < groups; ++i)
    CUBLAS_CHECK(cublasGemmEx(handle_, CUBLAS_OP_T, CUBLAS_OP_N, g.m[i], g.n[i], g.k[i], &g.alpha[i], g.a_host[i],
                              CUDA_R_16BF, g.lda[i], g.b_host[i], CUDA_R_16BF, g.ldb[i], &g.beta[i], g.c_host[i],
                              CUDA_R_16BF, g.ldc[i], CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

void CublasMoe::forward(const __nv_bfloat16* x, const float* topk_weights, __nv_bfloat16* y, GemmCalls calls,
                        cudaStream_t stream) {
  POUNCE_REQUIRE(has_routing_, "CublasMoe::forward: call set_weights, then set_routing");
  CUBLAS_CHECK(cublasSetStream(handle_, stream));
  permute_rows(x, row_token_.data(), padded_rows_, dims_.hidden, pool_.data(), stream);
  gemm(calls, 0);
  swiglu_rows(h13_.data(), padded_rows_, dims_.intermediate, hidden_.data(), stream);
  gemm(calls, 1);
  weighted_combine(out_.data(), route_row_.data(), topk_weights, tokens_, dims_.topk, dims_.hidden, y, stream);
}

}  // namespace pounce::baseline

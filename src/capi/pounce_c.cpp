// The C ABI of include/pounce/pounce_c.h over pounce::FusedMoe: every entry point runs its body inside
// guarded(), which turns any exception into a status and this thread's last-error message.
#include "pounce/pounce_c.h"

#include <nccl.h>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "comm/nccl_window.h"
#include "common/cuda_check.h"
#include "common/device_pointer.h"
#include "common/require.h"
#include "formats/quantize_kernel.h"
#include "pounce/fused_moe.h"

struct pounce_moe {
  std::unique_ptr<pounce::FusedMoe> layer;
  ncclComm_t comm = nullptr;  // owned by NCCL layers
};

namespace {

static_assert(sizeof(ncclUniqueId) == POUNCE_NCCL_UNIQUE_ID_BYTES);

thread_local std::string last_error;

template <typename Body>
int guarded(Body&& body) noexcept {
  try {
    body();
    return POUNCE_OK;
  } catch (const pounce::Error& e) {
    last_error = e.what();
    return POUNCE_ERROR;
  } catch (const std::exception& e) {
    last_error = e.what();
    return POUNCE_ERROR_INTERNAL;
  } catch (...) {
    last_error = "unknown exception";
    return POUNCE_ERROR_INTERNAL;
  }
}

template <typename T>
const T& required(const T* p, const char* name) {
  POUNCE_REQUIRE(p != nullptr, name, " is NULL");
  return *p;
}

pounce::FusedMoe& layer_of(pounce_moe* layer) { return *required(layer, "layer").layer; }

// The MX converters' buffers, once the shape is whole 1 x 32 blocks and every pointer is set (otherwise
// the converter names the problem itself): device memory of the current GPU, large enough, so that a
// host pointer is an error here instead of a fault in the kernel that loses the CUDA context.
void require_mx_buffers(const char* name, int64_t rows, int64_t cols, const void* bf16, const char* bf16_name,
                        const void* q, const void* scales) {
  const bool checkable = bf16 != nullptr && q != nullptr && scales != nullptr && rows > 0 && cols > 0 &&
                         cols % 32 == 0 && rows <= INT64_MAX / 2 / cols;
  if (!checkable) return;
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  const std::string prefix = std::string(name) + ": ";
  pounce::require_device_memory(bf16, 2 * rows * cols, 16, device, prefix + bf16_name);
  pounce::require_device_memory(q, rows * cols, 8, device, prefix + "q");
  pounce::require_device_memory(scales, rows * cols / 32, 1, device, prefix + "scales");
}

pounce::EpConfig to_config(const pounce_config* c) {
  const pounce_config& config = required(c, "config");
  return {.ranks = config.ranks,
          .experts = config.experts,
          .topk = config.topk,
          .hidden = config.hidden,
          .intermediate = config.intermediate,
          .max_tokens_per_rank = config.max_tokens_per_rank,
          .max_routes_per_rank = config.max_routes_per_rank};
}

pounce::FusedMoeOptions to_options(const pounce_options* o) {
  if (o == nullptr) return {};
  return {.ctas_per_rank = o->ctas_per_rank,
          .comm_ctas = o->comm_ctas,
          .engine_rows = o->engine_rows,
          .minibatch_rows = o->minibatch_rows,
          .ring_blocks = o->ring_blocks,
          .ring_bytes = o->ring_bytes,
          .wait_timeout_ns = o->wait_timeout_ns,
          .backward_replays = o->backward_replays != 0,
          .fused_backward = o->fused_backward != 0,
          .keep_x_rows = o->keep_x_rows != 0,
          .fp8_data_gradients = o->fp8_data_gradients != 0,
          .fp8_weight_gradients = o->fp8_weight_gradients != 0,
          .fp8_forward = o->fp8_forward != 0};
}

// Finalizes and destroys a communicator, reporting the first failure after trying both.
void destroy_comm(ncclComm_t comm) {
  const ncclResult_t finalized = ncclCommFinalize(comm);
  const ncclResult_t destroyed = ncclCommDestroy(comm);
  POUNCE_REQUIRE(finalized == ncclSuccess, "ncclCommFinalize failed: ", ncclGetErrorString(finalized));
  POUNCE_REQUIRE(destroyed == ncclSuccess, "ncclCommDestroy failed: ", ncclGetErrorString(destroyed));
}

}  // namespace

extern "C" {

int pounce_abi_version(void) { return POUNCE_C_ABI_VERSION; }

const char* pounce_last_error(void) { return last_error.c_str(); }

int pounce_default_options(pounce_options* out) {
  return guarded([&] {
    POUNCE_REQUIRE(out != nullptr, "out is NULL");
    const pounce::FusedMoeOptions d;
    *out = {.ctas_per_rank = d.ctas_per_rank,
            .comm_ctas = d.comm_ctas,
            .engine_rows = d.engine_rows,
            .minibatch_rows = d.minibatch_rows,
            .ring_blocks = d.ring_blocks,
            .ring_bytes = d.ring_bytes,
            .wait_timeout_ns = d.wait_timeout_ns,
            .backward_replays = d.backward_replays ? 1 : 0,
            .fused_backward = d.fused_backward ? 1 : 0,
            .fp8_data_gradients = d.fp8_data_gradients ? 1 : 0,
            .fp8_weight_gradients = d.fp8_weight_gradients ? 1 : 0,
            .fp8_forward = d.fp8_forward ? 1 : 0,
            .keep_x_rows = d.keep_x_rows ? 1 : 0};
  });
}

int pounce_moe_create(const pounce_config* config, const pounce_options* options, pounce_moe** out) {
  return guarded([&] {
    POUNCE_REQUIRE(out != nullptr, "out is NULL");
    *out = nullptr;
    const pounce::EpConfig ep = to_config(config);
    pounce::check_config(ep);  // named before the layer's first CUDA call
    auto layer = std::make_unique<pounce_moe>();
    layer->layer = std::make_unique<pounce::FusedMoe>(ep, to_options(options));
    *out = layer.release();
  });
}

int pounce_nccl_unique_id(char out[POUNCE_NCCL_UNIQUE_ID_BYTES]) {
  return guarded([&] {
    POUNCE_REQUIRE(out != nullptr, "out is NULL");
    pounce::comm::checked_nccl_version();
    pounce::comm::disable_multicast();
    ncclUniqueId id;
    NCCL_CHECK(ncclGetUniqueId(&id));
    std::copy_n(id.internal, POUNCE_NCCL_UNIQUE_ID_BYTES, out);
  });
}

int pounce_moe_create_nccl(const pounce_config* config, const pounce_options* options,
                           const char unique_id[POUNCE_NCCL_UNIQUE_ID_BYTES], int rank, pounce_moe** out) {
  return guarded([&] {
    POUNCE_REQUIRE(out != nullptr, "out is NULL");
    POUNCE_REQUIRE(unique_id != nullptr, "unique_id is NULL");
    *out = nullptr;
    const pounce::EpConfig ep = to_config(config);
    pounce::check_config(ep);  // named before any rank waits on the others
    POUNCE_REQUIRE(rank >= 0 && rank < ep.ranks, "NCCL: rank ", rank, " is not a rank of a group of ", ep.ranks);
    pounce::comm::checked_nccl_version();
    pounce::comm::disable_multicast();
    ncclUniqueId id;
    std::copy_n(unique_id, POUNCE_NCCL_UNIQUE_ID_BYTES, id.internal);
    auto layer = std::make_unique<pounce_moe>();
    NCCL_CHECK(ncclCommInitRank(&layer->comm, ep.ranks, id, rank));
    try {
      layer->layer = std::make_unique<pounce::FusedMoe>(ep, layer->comm, to_options(options));
    } catch (...) {
      ncclCommAbort(layer->comm);  // the layer's own error is the one to report
      throw;
    }
    *out = layer.release();
  });
}

int pounce_moe_set_weights(pounce_moe* layer, int n, const void* const* w13, const void* const* w2) {
  return guarded([&] {
    pounce::FusedMoe& moe = layer_of(layer);
    POUNCE_REQUIRE(n >= 0 && (n == 0 || (w13 != nullptr && w2 != nullptr)), "set_weights: n = ", n,
                   " with w13 and w2 arrays of n pointers each");
    std::vector<pounce::ExpertWeights> weights(n);
    for (int r = 0; r < n; ++r) {
      weights[r] = {static_cast<const __nv_bfloat16*>(w13[r]), static_cast<const __nv_bfloat16*>(w2[r])};
    }
    moe.set_weights(weights);
  });
}

int pounce_moe_refresh_fp8_weights(pounce_moe* layer, void* stream) {
  return guarded([&] { layer_of(layer).refresh_fp8_weights(static_cast<cudaStream_t>(stream)); });
}

int pounce_moe_forward(pounce_moe* layer, int n, const pounce_rank_io* ios, int keep_for_backward, void* stream) {
  return guarded([&] {
    pounce::FusedMoe& moe = layer_of(layer);
    POUNCE_REQUIRE(n >= 0 && (n == 0 || ios != nullptr), "forward: n = ", n, " with an array of n pounce_rank_io");
    std::vector<pounce::RankIO> ranks(n);
    for (int r = 0; r < n; ++r) {
      ranks[r] = {static_cast<const __nv_bfloat16*>(ios[r].x), ios[r].topk_ids, ios[r].topk_weights, ios[r].tokens,
                  static_cast<__nv_bfloat16*>(ios[r].y)};
    }
    moe.forward(ranks, static_cast<cudaStream_t>(stream), keep_for_backward != 0);
  });
}

int pounce_moe_backward(pounce_moe* layer, int n, const pounce_rank_io* forward_inputs, const pounce_rank_grads* grads,
                        int weight_grad_output, void* stream) {
  return guarded([&] {
    pounce::FusedMoe& moe = layer_of(layer);
    POUNCE_REQUIRE(n >= 0 && (n == 0 || (forward_inputs != nullptr && grads != nullptr)), "backward: n = ", n,
                   " with arrays of n pounce_rank_io and pounce_rank_grads");
    POUNCE_REQUIRE(
        weight_grad_output >= POUNCE_WEIGHT_GRAD_BF16 && weight_grad_output <= POUNCE_WEIGHT_GRAD_ACCUMULATE_F32,
        "backward: weight_grad_output = ", weight_grad_output, " is not a pounce_weight_grad_output");
    std::vector<pounce::RankIO> ins(n);
    std::vector<pounce::RankGrads> outs(n);
    for (int r = 0; r < n; ++r) {
      const pounce_rank_io& io = forward_inputs[r];
      const pounce_rank_grads& g = grads[r];
      ins[r] = {static_cast<const __nv_bfloat16*>(io.x), io.topk_ids, io.topk_weights, io.tokens,
                static_cast<__nv_bfloat16*>(io.y)};
      outs[r] = {static_cast<const __nv_bfloat16*>(g.dy), static_cast<__nv_bfloat16*>(g.dx), g.d_topk_weights, g.dw13,
                 g.dw2};
    }
    moe.backward(ins, outs, static_cast<pounce::WeightGradOutput>(weight_grad_output),
                 static_cast<cudaStream_t>(stream));
  });
}

int pounce_moe_check_device_errors(pounce_moe* layer) {
  return guarded([&] { layer_of(layer).check_device_errors(); });
}

int pounce_moe_get_info(const pounce_moe* layer, pounce_moe_info* out) {
  return guarded([&] {
    POUNCE_REQUIRE(out != nullptr, "out is NULL");
    const pounce::FusedMoe& moe = *required(layer, "layer").layer;
    *out = {.ranks_on_this_gpu = moe.ranks_on_this_gpu(),
            .ctas_per_rank = moe.ctas_per_rank(),
            .comm_ctas = moe.comm_ctas(),
            .engine_rows = moe.engine_rows(),
            .minibatch_rows = moe.minibatch_rows(),
            .ring_blocks = moe.ring_blocks(),
            .max_m_blocks = moe.max_m_blocks(),
            .device_bytes = moe.device_bytes(),
            .in_place = moe.in_place() ? 1 : 0,
            .last_backward_replayed = moe.last_backward_replayed() ? 1 : 0,
            .shared_bytes = moe.shared_device_bytes(),
            .shared_id = reinterpret_cast<uintptr_t>(moe.shared_buffers_id())};
  });
}

int pounce_moe_destroy(pounce_moe* layer) {
  return guarded([&] {
    std::unique_ptr<pounce_moe> owned(layer);
    if (!owned) return;
    owned->layer.reset();  // its NCCL window goes before the communicator
    if (owned->comm) destroy_comm(std::exchange(owned->comm, nullptr));
  });
}

int pounce_bf16_to_mxfp8(const void* x, int64_t rows, int64_t cols, void* q, void* scales, void* stream) {
  return guarded([&] {
    require_mx_buffers("pounce_bf16_to_mxfp8", rows, cols, x, "x", q, scales);
    pounce::formats::quantize_mxfp8_device(static_cast<const uint16_t*>(x), rows, cols, static_cast<uint8_t*>(q),
                                           static_cast<uint8_t*>(scales), static_cast<cudaStream_t>(stream));
  });
}

int pounce_mxfp8_to_bf16(const void* q, const void* scales, int64_t rows, int64_t cols, void* out, void* stream) {
  return guarded([&] {
    require_mx_buffers("pounce_mxfp8_to_bf16", rows, cols, out, "out", q, scales);
    pounce::formats::dequantize_mxfp8_device(static_cast<const uint8_t*>(q), static_cast<const uint8_t*>(scales), rows,
                                             cols, static_cast<uint16_t*>(out), static_cast<cudaStream_t>(stream));
  });
}

}  // extern "C"

/* pounce's C ABI: the fused MoE layer (pounce::FusedMoe, include/pounce/fused_moe.h) behind plain C types,
 * for bindings that load libpounce.so at run time (the Python package loads it with ctypes).
 *
 * Every function returns a status: POUNCE_OK (0), or non-zero on failure, when pounce_last_error() holds
 * the message (pounce::Error's own, naming what was wrong). No C++ exception crosses this boundary.
 * Layers act on the current CUDA device, as pounce::FusedMoe does: create, use and destroy a layer with
 * its GPU current. Device pointers are bf16 unless named otherwise. */
#ifndef POUNCE_POUNCE_C_H_
#define POUNCE_POUNCE_C_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Raised whenever a struct below changes layout or a function is added; bindings compare it with
 * pounce_abi_version(). */
#define POUNCE_C_ABI_VERSION 11
#define POUNCE_NCCL_UNIQUE_ID_BYTES 128

enum {
  POUNCE_OK = 0,
  POUNCE_ERROR = 1,          /* pounce::Error: bad input, a limit, a device error; the message names it */
  POUNCE_ERROR_INTERNAL = 2, /* any other exception (out of host memory, ...) */
};

/* pounce::EpConfig. */
typedef struct pounce_config {
  int32_t ranks;               /* P, the expert-parallel group size (1 to 8) */
  int32_t experts;             /* E, global; rank r owns experts [r E/P, (r+1) E/P) */
  int32_t topk;                /* k, experts per token (1 to E) */
  int64_t hidden;              /* H, a multiple of 64 */
  int64_t intermediate;        /* I, a multiple of 64 */
  int64_t max_tokens_per_rank; /* every buffer is sized from it */
  int64_t max_routes_per_rank; /* routes one rank may receive (the rows its buffers hold); 0: the worst case */
} pounce_config;

/* pounce::FusedMoeOptions; pounce_default_options() fills the library's defaults. */
typedef struct pounce_options {
  int32_t ctas_per_rank;
  int32_t comm_ctas;
  int32_t engine_rows;
  int64_t minibatch_rows;
  int64_t ring_blocks;
  int64_t ring_bytes;
  uint64_t wait_timeout_ns;
  int32_t backward_replays;     /* 1: a backward without its kept forward replays it; 0: it fails instead */
  int32_t fused_backward;       /* 1: on one GPU a backward from kept rows runs the persistent kernel */
  int32_t fp8_data_gradients;   /* 1: the backward chain's data gradients in E4M3 (see refresh_fp8_weights) */
  int32_t fp8_weight_gradients; /* 1: the backward's weight gradients in E4M3 */
  int32_t fp8_forward;          /* 1: the forward in E4M3 (virtual ranks; see refresh_fp8_weights) */
  int32_t keep_x_rows;          /* 1: one rank in place keeps each routed row's x for the backward (0: copied again) */
} pounce_options;

/* pounce::RankIO: one rank's tensors for one forward, device pointers, 16-byte aligned. */
typedef struct pounce_rank_io {
  const void* x;             /* [tokens, H] bf16 */
  const int32_t* topk_ids;   /* [tokens, k], global expert ids, distinct within a token */
  const float* topk_weights; /* [tokens, k] */
  int64_t tokens;            /* 0 .. max_tokens_per_rank */
  void* y;                   /* [tokens, H] bf16, written by the forward */
} pounce_rank_io;

/* pounce::RankGrads: one rank's gradients for one backward, device pointers, 16-byte aligned. */
typedef struct pounce_rank_grads {
  const void* dy;        /* [tokens, H] bf16 */
  void* dx;              /* [tokens, H] bf16 */
  float* d_topk_weights; /* [tokens, k] */
  void* dw13;            /* [E/P, 2I, H], bf16 or fp32 (see pounce_weight_grad_output) */
  void* dw2;             /* [E/P, H, I] */
} pounce_rank_grads;

/* pounce::WeightGradOutput. */
enum pounce_weight_grad_output {
  POUNCE_WEIGHT_GRAD_BF16 = 0,
  POUNCE_WEIGHT_GRAD_F32 = 1,
  POUNCE_WEIGHT_GRAD_ACCUMULATE_F32 = 2, /* added to what dw13 and dw2 hold */
};

/* What a layer resolved (the getters of pounce::FusedMoe). */
typedef struct pounce_moe_info {
  int32_t ranks_on_this_gpu; /* config.ranks for virtual ranks, 1 for an NCCL rank */
  int32_t ctas_per_rank;
  int32_t comm_ctas;
  int32_t engine_rows;
  int64_t minibatch_rows;
  int64_t ring_blocks;
  int64_t max_m_blocks;
  int64_t device_bytes; /* device memory the layer allocated on this GPU (not weights, not the caller's tensors) */
  int32_t in_place;     /* 1: one rank whose ring holds every routed row, nothing is combined */
  int32_t last_backward_replayed; /* 1: the latest backward found nothing kept and replayed its forward */
  int64_t shared_bytes; /* of device_bytes, the rings and route rows the layers of one config on a GPU share */
  uint64_t shared_id;   /* equal for layers that share them (count shared_bytes once per id) */
} pounce_moe_info;

typedef struct pounce_moe pounce_moe; /* a layer: pounce::FusedMoe, and the NCCL communicator it owns, if any */

/* POUNCE_C_ABI_VERSION of the library. */
int pounce_abi_version(void);

/* The message of this thread's latest failed call ("" before any); valid until the next call fails. */
const char* pounce_last_error(void);

int pounce_default_options(pounce_options* out);

/* Virtual ranks: all config->ranks ranks on the current GPU. options may be NULL (the defaults). */
int pounce_moe_create(const pounce_config* config, const pounce_options* options, pounce_moe** out);

/* A fresh NCCL unique id, made on one rank (rank 0) and handed to every rank of the group. */
int pounce_nccl_unique_id(char out[POUNCE_NCCL_UNIQUE_ID_BYTES]);

/* This process's rank of a group of config->ranks processes, one GPU each (the current one): creates an
 * NCCL communicator from unique_id (ncclCommInitRank, NVLink multicast turned off first) that the layer
 * owns. Collective: every rank calls it with the same config and options. */
int pounce_moe_create_nccl(const pounce_config* config, const pounce_options* options,
                           const char unique_id[POUNCE_NCCL_UNIQUE_ID_BYTES], int rank, pounce_moe** out);

/* The weights of the ranks on this GPU, in rank order (n = ranks_on_this_gpu): w13[r] [E/P, 2I, H] with
 * gate and up rows interleaved in groups of 8, w2[r] [E/P, H, I]. The layer keeps the pointers, no copy. */
int pounce_moe_set_weights(pounce_moe* layer, int n, const void* const* w13, const void* const* w2);

/* With the fp8_forward or fp8_data_gradients option: quantizes the weights into the E4M3 copies the forward
 * and the backward read, on `stream` (pounce::FusedMoe::refresh_fp8_weights). After set_weights and after
 * every weight update. */
int pounce_moe_refresh_fp8_weights(pounce_moe* layer, void* stream);

/* Enqueues one forward of the n = ranks_on_this_gpu ranks on this GPU on `stream` (a cudaStream_t; NULL
 * is the default stream). No host synchronization. keep_for_backward = 1: a training forward, which keeps
 * what its backward needs (pounce::FusedMoe::forward). */
int pounce_moe_forward(pounce_moe* layer, int n, const pounce_rank_io* ios, int keep_for_backward, void* stream);

/* Enqueues the backward of a forward on the same inputs (its pounce_rank_io, y unused) for the n ranks on
 * this GPU (pounce::FusedMoe::backward; across GPUs collective, from the kept rows of the latest forward).
 * `weight_grad_output` is a pounce_weight_grad_output. No host synchronization. */
int pounce_moe_backward(pounce_moe* layer, int n, const pounce_rank_io* forward_inputs, const pounce_rank_grads* grads,
                        int weight_grad_output, void* stream);

/* Fails with the message of an error a kernel reported (bad routing ids, a wait that gave up); reads host
 * memory only, unless an error is there. Call it once the forward's stream has synchronized to be sure to
 * see the forward's errors; a forward refuses to run while one is pending. */
int pounce_moe_check_device_errors(pounce_moe* layer);

int pounce_moe_get_info(const pounce_moe* layer, pounce_moe_info* out);

/* Frees the layer (NULL is fine). Collective for an NCCL layer: it then destroys its communicator. */
int pounce_moe_destroy(pounce_moe* layer);

/* MXFP8 at the layer's boundary (OCP MX v1.0: E4M3 elements, one E8M0 scale per 32 consecutive elements
 * of a row), enqueued on `stream`. bf16 x [rows, cols] -> q [rows, cols] E4M3 and scales [rows, cols / 32]
 * E8M0 (pounce::formats::quantize_mxfp8_device), and back to bf16 (dequantize_mxfp8_device: exact for
 * scale codes 3 to 246). cols a multiple of 32; x and out 16-byte, q 8-byte aligned. */
int pounce_bf16_to_mxfp8(const void* x, int64_t rows, int64_t cols, void* q, void* scales, void* stream);
int pounce_mxfp8_to_bf16(const void* q, const void* scales, int64_t rows, int64_t cols, void* out, void* stream);

#ifdef __cplusplus
}
#endif

#endif /* POUNCE_POUNCE_C_H_ */

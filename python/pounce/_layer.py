"""Layer: the C++ layer (pounce::FusedMoe) behind a MoE, created on first use and found by the custom
ops through an integer key."""

import ctypes
import itertools
import math
import weakref
from typing import Optional

import torch

from . import _lib
from ._lib import Error

_layers: "weakref.WeakValueDictionary[int, Layer]" = weakref.WeakValueDictionary()
_keys = itertools.count(1)

# Rows of a virtual rank start at a multiple of this many tokens, so that every rank's topk_ids and
# topk_weights slice stays 16-byte aligned (4 tokens x k x 4 bytes).
_TOKEN_ALIGN = 4


def _ceil_to(n: int, m: int) -> int:
    return -(-n // m) * m


class Layer:
    """The fused layer of one MoE on one GPU; what the ops `pounce::moe_forward` and `pounce::moe_backward`
    run on. The C++ object is made on the first forward, on the GPU of its inputs, with room for forwards
    of `max_tokens` tokens (this process's; with `virtual_ranks`, split over them; default: that forward's). On one GPU a later forward with more tokens replaces it
    with a larger one; across GPUs (`group`) every rank must keep the same size, so there a larger forward
    is an error that asks for `max_tokens`.

    Ranks: `group`, a torch.distributed process group with one rank per GPU (this process holds experts
    [rank E/P, (rank+1) E/P)), or `virtual_ranks` P on this GPU (this process holds all E experts; each
    forward's tokens are split over the P ranks in order), or neither (one rank).
    `capacity_factor`: the routes one rank's experts may receive in a forward, as a multiple of the
    balanced load (tokens per rank x topk), which sizes the layer's per-rank row buffers
    (EpConfig::max_routes_per_rank); None: every route of every rank (P times the balanced load). A
    forward past it on some rank computes nothing and raises pounce.Error naming the rank.
    `options`: a dict of pounce::FusedMoeOptions fields (ring_bytes, wait_timeout_ns, ...)."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        experts: int,
        topk: int,
        group=None,
        *,
        virtual_ranks: Optional[int] = None,
        max_tokens: Optional[int] = None,
        capacity_factor: Optional[float] = None,
        options: Optional[dict] = None,
    ):
        self._handle = None  # ctypes.c_void_p of the C++ layer
        if capacity_factor is not None and not capacity_factor > 0:
            raise Error(f"pounce: capacity_factor = {capacity_factor} must be positive (None: the worst case)")
        self.capacity_factor = capacity_factor
        if group is not None and virtual_ranks is not None:
            raise Error("pounce: give either group (one rank per GPU) or virtual_ranks (all on this GPU), not both")
        self.hidden, self.intermediate, self.experts, self.topk = hidden, intermediate, experts, topk
        self.group = group
        self.virtual_ranks = virtual_ranks or 1
        self.ranks = self.virtual_ranks if group is None else torch.distributed.get_world_size(group)
        self.rank = 0 if group is None else torch.distributed.get_rank(group)
        if self.ranks < 1 or experts % self.ranks != 0:
            raise Error(f"pounce: experts = {experts} must be divisible by the {self.ranks} ranks")
        # The experts whose weights this process holds: its own, or every virtual rank's.
        self.experts_here = experts if group is None else experts // self.ranks
        self.max_tokens = max_tokens
        self.options = dict(options or {})
        self.key = next(_keys)
        _layers[self.key] = self
        self._device = None
        self._sized_for = 0  # what the C++ layer was sized for
        self._weights = None  # (w13, w2) pointers last handed to it
        self._kept = None  # what the latest forward ran on, when it kept its rows for the backward
        self._fp8_of = None  # fp8_forward, fp8_data_gradients: the weights (pointers, versions) its E4M3 copies hold

    @staticmethod
    def get(key: int) -> "Layer":
        layer = _layers.get(key)
        if layer is None:
            raise Error(f"pounce: layer {key} no longer exists")
        return layer

    # ---- the C++ layer -------------------------------------------------------------------------------

    def _options(self) -> _lib.Options:
        options = _lib.default_options()
        for name, value in self.options.items():
            if name not in dict(_lib.Options._fields_):
                raise Error(f"pounce: unknown option {name!r}; the options are {[f for f, _ in _lib.Options._fields_]}")
            setattr(options, name, value)
        return options

    def _config(self, tokens_per_rank: int) -> _lib.Config:
        max_routes = 0  # the worst case
        if self.capacity_factor is not None:
            max_routes = max(1, math.ceil(self.capacity_factor * tokens_per_rank * self.topk))
        return _lib.Config(
            self.ranks, self.experts, self.topk, self.hidden, self.intermediate, tokens_per_rank, max_routes
        )

    def _tokens_per_rank(self, tokens: int) -> int:
        """Tokens of the busiest rank when a forward has `tokens` tokens on this GPU."""
        if self.virtual_ranks == 1:
            return tokens
        return _ceil_to(-(-tokens // self.virtual_ranks), _TOKEN_ALIGN)

    def _rank_spans(self, tokens: int):
        """(first token, end) of each rank's share of `tokens` tokens, in rank order."""
        chunk = self._tokens_per_rank(tokens)
        return [(min(r * chunk, tokens), min((r + 1) * chunk, tokens)) for r in range(self.virtual_ranks)]

    def _rank_ios(self, x, topk_ids, topk_weights, y=None):
        """Every rank's RankIO for these tensors (y: the forward's output; none for a backward)."""
        ios = (_lib.RankIO * self.virtual_ranks)()
        for r, (t0, t1) in enumerate(self._rank_spans(x.shape[0])):
            out = _address(y, t0) if y is not None else 0
            ios[r] = _lib.RankIO(_address(x, t0), _address(topk_ids, t0), _address(topk_weights, t0), t1 - t0, out)
        return ios

    def _create(self, tokens_per_rank: int, device: torch.device) -> None:
        lib = _lib.library()
        handle = ctypes.c_void_p()
        config, options = self._config(tokens_per_rank), self._options()
        if self.group is None:
            _lib.check(lib.pounce_moe_create(ctypes.byref(config), ctypes.byref(options), ctypes.byref(handle)))
        else:
            unique_id = [None]
            if self.rank == 0:
                buffer = ctypes.create_string_buffer(_lib.NCCL_UNIQUE_ID_BYTES)
                _lib.check(lib.pounce_nccl_unique_id(buffer))
                unique_id = [buffer.raw]
            src = torch.distributed.get_global_rank(self.group, 0)
            torch.distributed.broadcast_object_list(unique_id, src=src, group=self.group, device=device)
            _lib.check(
                lib.pounce_moe_create_nccl(
                    ctypes.byref(config), ctypes.byref(options), unique_id[0], self.rank, ctypes.byref(handle)
                )
            )
        self._handle, self._device, self._sized_for, self._weights = handle, device, tokens_per_rank, None
        self._fp8_of = None

    def _group_max(self, tokens: int, device: torch.device) -> int:
        count = torch.tensor([tokens], dtype=torch.int64, device=device)
        torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX, group=self.group)
        return int(count.item())

    def _ensure(self, tokens: int, device: torch.device) -> None:
        """Makes the C++ layer on `device` with room for `tokens` tokens, unless it has it already."""
        need = self._tokens_per_rank(tokens)
        if self._handle is not None and self._device == device and need <= self._sized_for:
            return
        if torch.cuda.is_current_stream_capturing():
            raise Error(
                f"pounce: a forward of {tokens} tokens needs a new layer, which allocates memory and so cannot "
                "happen during CUDA graph capture: run one forward with the largest token count before capturing"
            )
        if self.group is None:
            size = max(need, self._tokens_per_rank(self.max_tokens or 0), 1)
            if self._handle is not None:  # grown or moved: forwards in flight still use the old one
                torch.cuda.current_stream(self._device).synchronize()
                self.close()
        else:
            if self._handle is not None:
                raise Error(
                    f"pounce: this rank has {tokens} tokens, above the {self._sized_for} the layer was made "
                    "for; across GPUs every rank keeps the same size: pass max_tokens to the MoE"
                )
            # Every rank takes part in the reduction, so a rank over max_tokens fails on all of them
            # together (alone, it would leave the others waiting in the collectives of _create).
            largest = self._group_max(tokens, device)
            size = self.max_tokens or largest
            if largest > size:
                raise Error(f"pounce: a rank has {largest} tokens, above max_tokens = {size}")
        self._create(size, device)

    def _set_weights(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """Hands the weights' addresses to the C++ layer when they changed (it keeps pointers, no copy)."""
        pointers = (w13.data_ptr(), w2.data_ptr())
        if self._weights == pointers:
            return
        n = self.virtual_ranks
        w13_ranks = [w.data_ptr() for w in w13.chunk(n)]
        w2_ranks = [w.data_ptr() for w in w2.chunk(n)]
        _lib.check(
            _lib.library().pounce_moe_set_weights(
                self._handle, n, (ctypes.c_void_p * n)(*w13_ranks), (ctypes.c_void_p * n)(*w2_ranks)
            )
        )
        self._weights = pointers
        self._fp8_of = None

    def _refresh_fp8_weights(self, w13: torch.Tensor, w2: torch.Tensor, stream: int, option: str) -> None:
        """With `option` (fp8_forward: called by the forward; fp8_data_gradients: by the backward): quantizes
        the weights into the C++ layer's E4M3 copies when their values may have changed since (new tensors,
        or an in-place update: the optimizer bumps a tensor's version). Inside a CUDA graph capture it
        always refreshes, so that every replay quantizes the weights of that moment."""
        if not self.options.get(option):
            return
        of = (w13.data_ptr(), w2.data_ptr(), w13._version, w2._version)
        capturing = torch.cuda.is_current_stream_capturing()
        if self._fp8_of == of and not capturing:
            return
        _lib.check(_lib.library().pounce_moe_refresh_fp8_weights(self._handle, stream))
        # A captured refresh runs only when the graph replays (with the weights of that moment): the next
        # eager backward refreshes again.
        self._fp8_of = None if capturing else of

    def refresh_fp8_weights(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """fp8_forward, fp8_data_gradients: quantizes the weights into the E4M3 copies now, on the current
        stream: after updates that the tensors' versions do not show (writes through .data, fused optimizer
        kernels). Nothing to do before the layer's first forward."""
        option = next((o for o in ("fp8_forward", "fp8_data_gradients") if self.options.get(o)), None)
        if self._handle is None or option is None:
            return
        with torch.cuda.device(self._device):
            self._set_weights(w13, w2)
            self._fp8_of = None
            self._refresh_fp8_weights(w13, w2, torch.cuda.current_stream(self._device).cuda_stream, option)

    # ---- used by the ops -----------------------------------------------------------------------------

    def forward(self, x, topk_ids, topk_weights, w13, w2, keep: bool = False) -> torch.Tensor:
        """y = the MoE of x, enqueued on the current stream (the body of pounce::moe_forward); `keep`: keep
        the gate/up rows for this forward's backward."""
        tokens = x.shape[0]
        with torch.cuda.device(x.device):
            self._ensure(tokens, x.device)
            # An error a kernel reported in an earlier forward surfaces here, before the next one runs.
            self.check_device_errors(synchronize=False)
            self._set_weights(w13, w2)
            y = torch.empty_like(x)
            ios = self._rank_ios(x, topk_ids, topk_weights, y)
            stream = torch.cuda.current_stream(x.device).cuda_stream
            self._refresh_fp8_weights(w13, w2, stream, "fp8_forward")
            _lib.check(_lib.library().pounce_moe_forward(self._handle, self.virtual_ranks, ios, int(keep), stream))
        self._kept = _inputs_key(x, topk_ids, topk_weights, w13, w2) if keep else None
        return y

    def runs_backward(self, x: torch.Tensor) -> bool:
        """Whether the C++ layer can compute backwards of this input: on CUDA tensors (one GPU, or across
        GPUs from the rows its forward kept: see group_kept_forward)."""
        return x.is_cuda

    def group_kept_forward(self, x, topk_ids, topk_weights, w13, w2) -> bool:
        """Whether the layer's latest forward, on every rank of the group, ran on these tensors and kept its
        rows: across GPUs the C++ backward starts only from them, and every rank must take the same path
        (the other one is PyTorch's, with all_to_all). A rank without tokens cannot tell its forwards apart
        (every pointer of an empty tensor is null: it may answer yes for an older forward), so the ranks
        agree by an all_reduce (MIN) of their answers, read on the host: the one synchronization of this
        path. The answers are the C++ layer's own test (pointers, token counts, weights, latest forward),
        so where all say yes every rank's C++ backward finds its kept rows."""
        mine = self._kept == _inputs_key(x, topk_ids, topk_weights, w13, w2)
        verdict = torch.tensor([1 if mine else 0], dtype=torch.int32, device=x.device)
        torch.distributed.all_reduce(verdict, op=torch.distributed.ReduceOp.MIN, group=self.group)
        return bool(verdict.item())

    def backward(self, dy, x, topk_ids, topk_weights, w13, w2, main_grads=None):
        """(dx, d_topk_weights, dw13, dw2) of a forward on these inputs, by pounce's backward on the current
        stream: no host synchronization. It starts from the rows the forward kept when that forward was this
        layer's latest, on these tensors. The op has checked every tensor (bf16 x, dy, w13 and w2, fp32
        topk_weights), so the gradients take their inputs' dtypes. main_grads: fp32 tensors shaped like w13
        and w2 that the weight gradients are added to (then dw13 and dw2 are None)."""
        tokens, n = x.shape[0], self.virtual_ranks
        with torch.cuda.device(x.device):
            self._ensure(tokens, x.device)
            self.check_device_errors(synchronize=False)
            self._set_weights(w13, w2)
            dx = torch.empty_like(x)
            d_topk_weights = torch.empty_like(topk_weights)
            if main_grads is None:
                dw13, dw2 = torch.empty_like(w13), torch.empty_like(w2)  # bf16, as the op's inputs are
                mode = _lib.WEIGHT_GRAD_BF16
            else:
                dw13, dw2 = main_grads
                mode = _lib.WEIGHT_GRAD_ACCUMULATE_F32
            ios, grads = self._rank_ios(x, topk_ids, topk_weights), (_lib.RankGrads * n)()
            dw13_ranks, dw2_ranks = dw13.chunk(n), dw2.chunk(n)
            for r, (t0, _) in enumerate(self._rank_spans(tokens)):
                grads[r] = _lib.RankGrads(
                    _address(dy, t0),
                    _address(dx, t0),
                    _address(d_topk_weights, t0),
                    dw13_ranks[r].data_ptr(),
                    dw2_ranks[r].data_ptr(),
                )
            stream = torch.cuda.current_stream(x.device).cuda_stream
            self._refresh_fp8_weights(w13, w2, stream, "fp8_data_gradients")
            _lib.check(
                _lib.library().pounce_moe_backward(self._handle, n, ios, grads, mode, stream)
            )
        if main_grads is not None:
            return dx, d_topk_weights, None, None
        return dx, d_topk_weights, dw13, dw2

    # ---- public --------------------------------------------------------------------------------------

    def check_device_errors(self, synchronize: bool = True) -> None:
        """Raises pounce.Error for an error a kernel of this layer reported (bad routing ids: out of range
        or repeated within a token; a wait that gave up). With `synchronize`, the current stream is
        synchronized first, so every forward enqueued so far is covered. Every forward also runs it
        (without synchronizing) before it enqueues anything."""
        if self._handle is None:
            return
        with torch.cuda.device(self._device):
            if synchronize:
                torch.cuda.current_stream().synchronize()
            _lib.check(_lib.library().pounce_moe_check_device_errors(self._handle))

    def info(self) -> Optional[dict]:
        """What the C++ layer resolved (ranks on this GPU, CTAs, ring, device bytes...), None before the
        first forward. Of device_bytes, shared_bytes is the rings and the backward's route rows, which the
        layers of one shape on a GPU share: layers with the same shared_id hold the same ones (count them
        once)."""
        if self._handle is None:
            return None
        info = _lib.Info()
        _lib.check(_lib.library().pounce_moe_get_info(self._handle, ctypes.byref(info)))
        result = {name: getattr(info, name) for name, _ in _lib.Info._fields_}
        result["in_place"] = bool(result["in_place"])
        result["last_backward_replayed"] = bool(result["last_backward_replayed"])
        result["max_tokens_per_rank"] = self._sized_for
        result["max_routes_per_rank"] = self._config(self._sized_for).max_routes_per_rank  # 0: the worst case
        return result

    def close(self) -> None:
        """Frees the C++ layer (the next forward makes a new one). Collective across GPUs: every rank of
        the group calls it, in the same order as for its other layers."""
        if self._handle is None:
            return
        handle, self._handle, self._weights, self._fp8_of = self._handle, None, None, None
        with torch.cuda.device(self._device):
            _lib.check(_lib.library().pounce_moe_destroy(handle))

    def __del__(self):
        # Across GPUs freeing is collective, which garbage collection cannot promise: those layers are freed
        # by close() or with the process. (_handle is set first in __init__, so a layer whose arguments
        # were rejected stops at it.)
        if self._handle is not None and self.group is None:
            try:
                self.close()
            except Exception:  # noqa: BLE001  (nothing can be raised from __del__)
                pass


def _address(t: torch.Tensor, row: int) -> int:
    """Address of row `row` of a contiguous 2-D tensor (its end when row == rows)."""
    return t.data_ptr() + row * t.stride(0) * t.element_size()


def _inputs_key(x, topk_ids, topk_weights, w13, w2):
    """What the C++ layer compares to decide a forward's rows are this backward's (pointers and tokens)."""
    return (x.shape[0],) + tuple(t.data_ptr() for t in (x, topk_ids, topk_weights, w13, w2))


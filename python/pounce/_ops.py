"""The custom ops: pounce::moe_forward (the fused kernel through the C ABI) and pounce::moe_backward
(pounce's backward kernels; across GPUs from the kept rows of its forward, else PyTorch), or
pounce::moe_backward_into_main_grads when the forward was given fp32 main grads (the weight gradients
are added to them), with their fake (meta) implementations and the autograd formula joining them.

The layer is passed as an int, the key of a pounce Layer, so the ops stay opaque to torch.compile and
can be captured in CUDA graphs (the PyTorch backward synchronizes with the host: not that one)."""

from typing import Optional, Tuple

import torch
from torch import Tensor

from ._layer import Layer
from ._lib import Error


def check_inputs(x, topk_ids, topk_weights, w13, w2, layer: Layer, *, pointers: bool) -> None:
    """Raises pounce.Error naming the first input that the fused layer cannot take. `pointers`: also
    check 16-byte alignment (real tensors only; fake tensors have no address)."""
    H, I, k, E = layer.hidden, layer.intermediate, layer.topk, layer.experts_here
    if x.dim() != 2 or x.shape[1] != H:
        raise Error(f"pounce.moe: x has shape {tuple(x.shape)}, expected [tokens, hidden = {H}]")
    T = x.shape[0]
    expected = {
        "x": (x, torch.bfloat16, (T, H)),
        "topk_ids": (topk_ids, torch.int32, (T, k)),
        "topk_weights": (topk_weights, torch.float32, (T, k)),
        "w13": (w13, torch.bfloat16, (E, 2 * I, H)),
        "w2": (w2, torch.bfloat16, (E, H, I)),
    }
    for name, (t, dtype, shape) in expected.items():
        if t.dtype != dtype:
            raise Error(f"pounce.moe: {name} has dtype {t.dtype}, expected {dtype}")
        if tuple(t.shape) != shape:
            raise Error(f"pounce.moe: {name} has shape {tuple(t.shape)}, expected {list(shape)}")
        if not t.is_contiguous():
            raise Error(f"pounce.moe: {name} is not contiguous (strides {t.stride()}): pass {name}.contiguous()")
        if pointers and t.numel() > 0 and t.data_ptr() % 16 != 0:
            raise Error(f"pounce.moe: {name} at {t.data_ptr():#x} is not 16-byte aligned")
    for name, (t, _, _) in expected.items():
        if t.device.type != "cuda":
            raise Error(f"pounce.moe: {name} is on {t.device}, expected a CUDA device")
        if t.device != x.device:
            raise Error(f"pounce.moe: {name} is on {t.device}, x on {x.device}: all on one GPU")


def check_main_grads(main_w13, main_w2, w13, w2, *, pointers: bool) -> None:
    """Raises pounce.Error unless main_w13 and main_w2 are both None, or fp32 tensors shaped like w13 and
    w2, contiguous, on their GPU (and, with `pointers`, 16-byte aligned)."""
    if (main_w13 is None) != (main_w2 is None):
        raise Error("pounce.moe: give main grads for both w13 and w2, or for neither")
    if main_w13 is None:
        return
    for name, t, w in (("main_w13", main_w13, w13), ("main_w2", main_w2, w2)):
        if t.dtype != torch.float32 or t.shape != w.shape:
            raise Error(
                f"pounce.moe: {name} is {t.dtype} {tuple(t.shape)}, expected torch.float32 {list(w.shape)} "
                "(the fp32 gradient the weight's gradients are added to)"
            )
        if not t.is_contiguous():
            raise Error(f"pounce.moe: {name} is not contiguous (strides {t.stride()})")
        if t.device != w.device:
            raise Error(f"pounce.moe: {name} is on {t.device}, its weight on {w.device}")
        if pointers and t.numel() > 0 and t.data_ptr() % 16 != 0:
            raise Error(f"pounce.moe: {name} at {t.data_ptr():#x} is not 16-byte aligned")


@torch.library.custom_op("pounce::moe_forward", mutates_args=())
def moe_forward(
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    w13: Tensor,
    w2: Tensor,
    layer: int,
    keep: bool = False,
    main_w13: Optional[Tensor] = None,
    main_w2: Optional[Tensor] = None,
) -> Tensor:
    """y [T, H] = sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]), by the fused kernel on the
    current CUDA stream. keep: a training forward; the layer keeps the gate/up rows for its backward, so
    the backward does not recompute them (and across GPUs can run at all). main_w13, main_w2: fp32
    gradients (shaped like w13 and w2) that the backward adds the weight gradients to, instead of
    returning them; the forward only checks them."""
    owner = Layer.get(layer)
    check_inputs(x, topk_ids, topk_weights, w13, w2, owner, pointers=True)
    check_main_grads(main_w13, main_w2, w13, w2, pointers=True)
    return owner.forward(x, topk_ids, topk_weights, w13, w2, keep=keep and owner.runs_backward(x))


@moe_forward.register_fake
def _(x, topk_ids, topk_weights, w13, w2, layer, keep=False, main_w13=None, main_w2=None):
    check_inputs(x, topk_ids, topk_weights, w13, w2, Layer.get(layer), pointers=False)
    check_main_grads(main_w13, main_w2, w13, w2, pointers=False)
    return torch.empty_like(x)


# ---- backward ----------------------------------------------------------------------------------------
# pounce's backward (libpounce, no host synchronization): on one GPU (one rank or virtual ranks) always;
# across GPUs when the layer's latest forward was this op's, kept for it (the persistent kernel starts
# from those rows). Otherwise across GPUs (several forwards before their backwards, as pipeline
# schedules run them): the PyTorch backward below.


def _split_w13_rows(gu: Tensor) -> Tuple[Tensor, Tensor]:
    """Gate and up columns of [n, 2I] values laid out like w13's rows (groups of 8, interleaved)."""
    n, two_i = gu.shape
    pairs = gu.view(n, two_i // 16, 2, 8)
    return pairs[:, :, 0].reshape(n, two_i // 2), pairs[:, :, 1].reshape(n, two_i // 2)


def _join_w13_rows(g: Tensor, u: Tensor) -> Tensor:
    n, i = g.shape
    return torch.stack((g.view(n, i // 8, 8), u.view(n, i // 8, 8)), dim=2).reshape(n, 2 * i)


def expert_gradients(x, dy, weight, expert, w13, w2):
    """Gradients of routes already on their expert's rank, in fp32: x, dy [R, H] rows, weight [R] their
    router weights, expert [R] the index into w13 [E, 2I, H] and w2 [E, H, I]. Returns dx [R, H] (each
    route's share of dx), d_weight [R], dw13 and dw2 (fp32, shaped like w13 and w2). The math of
    reference::moe_backward (src/reference/moe_layer.cpp), one expert at a time."""
    R, E = x.shape[0], w13.shape[0]
    dx = torch.zeros(R, x.shape[1], dtype=torch.float32, device=x.device)
    d_weight = torch.zeros(R, dtype=torch.float32, device=x.device)
    dw13 = torch.zeros(w13.shape, dtype=torch.float32, device=x.device)
    dw2 = torch.zeros(w2.shape, dtype=torch.float32, device=x.device)
    order = torch.argsort(expert, stable=True)
    counts = torch.bincount(expert, minlength=E).tolist()  # the per-expert loop needs them on the host
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = order[start : start + n]
        start += n
        xe, dye, we = x[rows].float(), dy[rows].float(), weight[rows].float()[:, None]
        W13, W2 = w13[e].float(), w2[e].float()
        g, u = _split_w13_rows(xe @ W13.T)
        s = torch.sigmoid(g)
        a = g * s * u  # silu(g) * u
        da = dye @ W2  # W2^T dy, before the router weight: <dy, o> = <W2^T dy, a>
        d_weight[rows] = (da * a).sum(1)
        dw2[e] = (we * dye).T @ a
        da = we * da
        dgu = _join_w13_rows(da * u * s * (1 + g * (1 - s)), da * g * s)
        dx[rows] = dgu @ W13
        dw13[e] = dgu.T @ xe
    return dx, d_weight, dw13, dw2


def _exchange(rows: Tensor, send: list, recv: list, group) -> Tensor:
    """all_to_all of rows: send[r] rows to rank r, recv[r] rows from it."""
    out = rows.new_empty((sum(recv),) + tuple(rows.shape[1:]))
    torch.distributed.all_to_all_single(out, rows, recv, send, group=group)
    return out


def backward_gradients(dy, x, topk_ids, topk_weights, w13, w2, layer: int, main_grads=None):
    """(dx, d_topk_weights, dw13, dw2) of pounce::moe_forward. On one GPU: pounce's backward kernels.
    Across GPUs: pounce's fused backward from the rows the forward kept, when that forward is the layer's
    latest (the ranks agree on it by one all_reduce of a flag, read on the host); otherwise in PyTorch
    with fp32 accumulation (each route's x and dy rows travel to its
    expert's rank and its dx share and router-weight gradient back, all_to_all; this path synchronizes
    with the host: per-expert loop). main_grads: (main_w13, main_w2), fp32, which the weight gradients
    are added to; dw13 and dw2 are then None."""
    owner = Layer.get(layer)
    if main_grads is not None:
        check_main_grads(*main_grads, w13, w2, pointers=x.is_cuda)
    if owner.runs_backward(x) and (owner.group is None or owner.group_kept_forward(x, topk_ids, topk_weights, w13, w2)):
        check_inputs(x, topk_ids, topk_weights, w13, w2, owner, pointers=True)
        if dy.dtype != x.dtype or dy.shape != x.shape or not dy.is_contiguous() or dy.data_ptr() % 16 != 0:
            raise Error(f"pounce.moe backward: dy must be a contiguous, 16-byte aligned {x.dtype} tensor shaped "
                        f"like x {tuple(x.shape)}; got {dy.dtype} {tuple(dy.shape)}")
        return owner.backward(dy, x, topk_ids, topk_weights, w13, w2, main_grads)
    T, k = topk_ids.shape
    token = torch.arange(T, device=x.device).repeat_interleave(k)  # route (t, k) -> t, routes in (t, k) order
    expert, weight = topk_ids.reshape(-1).long(), topk_weights.reshape(-1)
    if owner.group is None:  # this process holds every expert
        d_route, d_weight, dw13, dw2 = expert_gradients(x[token], dy[token], weight, expert, w13, w2)
    else:
        local = owner.experts_here
        order = torch.argsort(expert // local, stable=True)  # routes by their expert's rank
        send = torch.bincount(expert // local, minlength=owner.ranks)
        recv = torch.empty_like(send)
        torch.distributed.all_to_all_single(recv, send, group=owner.group)
        send, recv = send.tolist(), recv.tolist()
        g = owner.group
        d_there, w_there, dw13, dw2 = expert_gradients(
            _exchange(x[token[order]], send, recv, g),
            _exchange(dy[token[order]], send, recv, g),
            _exchange(weight[order], send, recv, g),
            _exchange(expert[order] % local, send, recv, g),
            w13,
            w2,
        )
        d_route, d_weight = d_there.new_empty(T * k, x.shape[1]), w_there.new_empty(T * k)
        d_route[order] = _exchange(d_there, recv, send, g)
        d_weight[order] = _exchange(w_there, recv, send, g)
    dx = d_route.view(T, k, x.shape[1]).sum(1)  # k in order: deterministic
    if main_grads is not None:
        main_grads[0].add_(dw13)
        main_grads[1].add_(dw2)
        return dx.to(x.dtype), d_weight.view(T, k), None, None
    return dx.to(x.dtype), d_weight.view(T, k), dw13.to(w13.dtype), dw2.to(w2.dtype)


@torch.library.custom_op("pounce::moe_backward", mutates_args=())
def moe_backward(
    dy: Tensor, x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w13: Tensor, w2: Tensor, layer: int
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx, d_topk_weights, dw13, dw2) of pounce::moe_forward (backward_gradients)."""
    return backward_gradients(dy, x, topk_ids, topk_weights, w13, w2, layer)


@moe_backward.register_fake
def _(dy, x, topk_ids, topk_weights, w13, w2, layer):
    return torch.empty_like(x), torch.empty_like(topk_weights), torch.empty_like(w13), torch.empty_like(w2)


@torch.library.custom_op("pounce::moe_backward_into_main_grads", mutates_args=("main_w13", "main_w2"))
def moe_backward_into_main_grads(
    dy: Tensor,
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    w13: Tensor,
    w2: Tensor,
    main_w13: Tensor,
    main_w2: Tensor,
    layer: int,
) -> Tuple[Tensor, Tensor]:
    """(dx, d_topk_weights) of pounce::moe_forward; its weight gradients are added to main_w13 and main_w2
    (fp32), as Megatron-style training accumulates micro-batches (backward_gradients)."""
    dx, d_topk_weights, _, _ = backward_gradients(dy, x, topk_ids, topk_weights, w13, w2, layer, (main_w13, main_w2))
    return dx, d_topk_weights


@moe_backward_into_main_grads.register_fake
def _(dy, x, topk_ids, topk_weights, w13, w2, main_w13, main_w2, layer):
    return torch.empty_like(x), torch.empty_like(topk_weights)


def _placeholder_gradient(w: Tensor) -> Optional[Tensor]:
    """The gradient autograd passes on for a weight (the parameter itself) whose gradient went into its main
    grad: none, unless the weight carries Megatron's grad_added_to_main_grad flag. Megatron's data-parallel
    wrapper sets it and waits for a gradient to reach each such weight (its hook then starts that bucket's
    reduction): that weight gets a placeholder, flagged as already added, which the hook drops; zeros when
    the weight is marked zero_out_wgrad (the hook then adds it), else uninitialized, as Megatron's own
    fused weight-gradient layers do. Without such a hook the placeholder stays in .grad."""
    if not hasattr(w, "grad_added_to_main_grad"):
        return None
    w.grad_added_to_main_grad = True
    make = torch.zeros if getattr(w, "zero_out_wgrad", False) else torch.empty
    return make(w.shape, dtype=w.dtype, device=w.device)


def _setup_context(ctx, inputs, output):
    x, topk_ids, topk_weights, w13, w2, layer = inputs[:6]
    ctx.save_for_backward(x, topk_ids, topk_weights, w13, w2)
    ctx.layer = layer
    # NOTES: the main grads are kept on ctx, not saved for backward. The backward writes them, and a
    # saved tensor that was written fails autograd's version check in every other backward that saved
    # it: the same main grads in two forwards awaiting their backwards (micro-batches in flight, a layer
    # called twice), or layers whose main grads are views of one buffer, as Megatron keeps them.
    ctx.main_grads = tuple(inputs[7:9]) if inputs[7] is not None else None  # PyTorch passes the defaults too
    # The parameters themselves, for their flags: what saved_tensors returns is a copy under activation
    # checkpointing or saved-tensor hooks.
    ctx.weights = (w13, w2)


def _backward(ctx, dy):
    x, topk_ids, topk_weights, w13, w2 = ctx.saved_tensors
    wants_w13, wants_w2 = ctx.needs_input_grad[3], ctx.needs_input_grad[4]
    if ctx.main_grads is not None and (wants_w13 or wants_w2):
        if not (wants_w13 and wants_w2):
            raise Error("pounce.moe: with main grads, w13 and w2 must both require gradients or neither")
        dx, d_topk_weights = torch.ops.pounce.moe_backward_into_main_grads(
            dy.contiguous(), x, topk_ids, topk_weights, w13, w2, *ctx.main_grads, ctx.layer
        )
        dw13, dw2 = (_placeholder_gradient(w) for w in ctx.weights)
    else:
        dx, d_topk_weights, dw13, dw2 = torch.ops.pounce.moe_backward(
            dy.contiguous(), x, topk_ids, topk_weights, w13, w2, ctx.layer
        )
    return dx, None, d_topk_weights, dw13, dw2, None, None, None, None


moe_forward.register_autograd(_backward, setup_context=_setup_context)

"""pounce.MoE (the module) and pounce.moe (the function): the fused MoE forward as a PyTorch layer."""

import math
from typing import Optional, Tuple

import torch
from torch import Tensor, nn

from . import _ops  # noqa: F401  (registers torch.ops.pounce.*)
from ._layer import Layer
from ._lib import Error


def interleave_w13(gate: Tensor, up: Tensor) -> Tensor:
    """w13 [E, 2I, H] from gate and up [E, I, H]: rows 16j..16j+7 are gate rows 8j..8j+7 and rows
    16j+8..16j+15 up rows 8j..8j+7 (reference::w13_row), as pounce's kernels expect."""
    if gate.shape != up.shape or gate.dim() != 3 or gate.shape[1] % 8 != 0:
        raise Error(f"pounce: gate {tuple(gate.shape)} and up {tuple(up.shape)} must both be [E, I, H], I % 8 == 0")
    E, I, H = gate.shape
    return torch.stack((gate.reshape(E, I // 8, 8, H), up.reshape(E, I // 8, 8, H)), dim=2).reshape(E, 2 * I, H)


def split_w13(w13: Tensor):
    """(gate, up) [E, I, H] from w13 [E, 2I, H]: the inverse of interleave_w13."""
    E, two_i, H = w13.shape
    pairs = w13.reshape(E, two_i // 16, 2, 8, H)
    return pairs[:, :, 0].reshape(E, two_i // 2, H), pairs[:, :, 1].reshape(E, two_i // 2, H)


_shared_layers = {}


def moe(
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    w13: Tensor,
    w2: Tensor,
    *,
    layer: Optional[Layer] = None,
    group=None,
    virtual_ranks: Optional[int] = None,
    main_grads: Optional[Tuple[Tensor, Tensor]] = None,
) -> Tensor:
    """y [T, H] bf16 = sum_k topk_weights[t, k] * (w2[e] @ (silu(g) * u)), [g, u] = w13[e] @ x[t],
    e = topk_ids[t, k], for x [T, H] bf16, topk_ids [T, k] int32 (int64 is converted), topk_weights
    [T, k] fp32, w13 [E_here, 2I, H] (gate and up rows interleaved in groups of 8: interleave_w13) and
    w2 [E_here, H, I] bf16, all contiguous on one GPU. Differentiable in x, topk_weights, w13 and w2;
    the backward runs pounce's backward kernels (across GPUs from the kept rows of the latest forward,
    else PyTorch, fp32).

    layer: the pounce.Layer to run on; without one, a layer shared by calls of the same shape, group and
    virtual_ranks is used (pass one explicitly under torch.compile). group / virtual_ranks: as for MoE.
    main_grads: (main_w13, main_w2), fp32 tensors shaped like w13 and w2: the backward adds the weight
    gradients to them in fp32 (pounce's kernels accumulate into them directly) and gives w13 and w2 no
    gradient through autograd.

    x may have leading dimensions ([batch, seq, H], topk_ids and topk_weights [batch, seq, k] or
    [batch * seq, k]): they are flattened into tokens and y takes x's shape. Under torch.autocast to
    bf16, x is cast to bf16 as a matmul's operand would be, and the router weights to fp32 (exactly)."""
    leading = x.shape[:-1]
    if x.dim() != 2 and x.dim() > 0:
        for name, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
            if t.dim() < 1 or t.shape[:-1] not in (leading, (leading.numel(),)):
                raise Error(f"pounce.moe: x has shape {tuple(x.shape)}, so {name} must be {[*leading, 'k']} or "
                            f"{[leading.numel(), 'k']}; got {tuple(t.shape)}")
        x = x.reshape(-1, x.shape[-1])
        topk_ids = topk_ids.reshape(-1, topk_ids.shape[-1])
        topk_weights = topk_weights.reshape(-1, topk_weights.shape[-1])
    device = x.device.type
    if torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == torch.bfloat16:
        x = x.to(torch.bfloat16)
        topk_weights = topk_weights.float()
    if layer is None:
        ranks = torch.distributed.get_world_size(group) if group is not None else 1
        shape = (x.shape[1], w2.shape[2], w13.shape[0] * ranks, topk_ids.shape[1])
        key = shape + (x.device, group, virtual_ranks)
        layer = _shared_layers.get(key)
        if layer is None:
            layer = _shared_layers[key] = Layer(*shape, group, virtual_ranks=virtual_ranks)
    if topk_ids.dtype == torch.int64:
        topk_ids = topk_ids.to(torch.int32)
    # A forward that autograd will differentiate keeps what its backward needs (the gate/up rows).
    keep = torch.is_grad_enabled() and any(t.requires_grad for t in (x, topk_weights, w13, w2))
    main_w13, main_w2 = main_grads if main_grads is not None else (None, None)
    y = torch.ops.pounce.moe_forward(x, topk_ids, topk_weights, w13, w2, layer.key, keep, main_w13, main_w2)
    return y if len(leading) == 1 else y.reshape(*leading, y.shape[-1])


class MoE(nn.Module):
    """The routed experts of a Mixture-of-Experts layer, SwiGLU FFNs run by pounce's fused kernel.

    MoE(hidden, intermediate, experts, topk, group=None, *, max_tokens=None, capacity_factor=None,
        main_grad=False, dtype=torch.bfloat16, device=None, virtual_ranks=None, options=None)

    Parameters: this rank's experts only, w13 [E/P, 2I, H] (each expert's gate and up projections, rows
    interleaved in groups of 8: use load_experts to set them from separate tensors) and w2 [E/P, H, I]
    (down), bf16. Initialised as nn.Linear initialises its weight: uniform in +-1/sqrt(fan_in), fan_in = H
    for w13 and I for w2 (seed each rank differently, or its experts start equal to another rank's).

    forward(x [T, H] bf16, topk_ids [T, k] int32 or int64, topk_weights [T, k] fp32) -> y [T, H] bf16,
    differentiable in x, topk_weights, w13 and w2. The backward (pounce::moe_backward) runs pounce's
    backward kernels from the gate/up rows its training forward kept. With a process group that takes
    the backward right after its forward (as a plain training step runs them; the ranks agree on that by
    one all_reduce of a flag, read on the host); a backward whose forward
    is not the layer's latest (several forwards before their backwards, as pipeline schedules run them)
    is computed in PyTorch instead (fp32 accumulation, a per-expert loop that synchronizes with the
    host).

    group: a torch.distributed process group, one rank per GPU (torchrun): rank r holds experts
    [r E/P, (r+1) E/P), tokens travel over NVLink through NCCL. Every rank calls forward (with its own
    tokens) and close() together. virtual_ranks=P: all P ranks on this GPU, for testing; the module then
    holds all E experts and each forward's tokens are split over the ranks in order.

    The fused layer is made on the first forward, on x's GPU, sized for forwards of up to max_tokens
    tokens each (the tokens this process passes; with virtual_ranks, split over them; default: that
    forward's count). On one GPU a forward with more tokens makes a larger one; across GPUs every rank
    keeps the first size, so pass max_tokens when the count varies. Make it before CUDA graph capture (one
    forward with the largest count).

    capacity_factor: the routes one rank's experts may receive in a forward, as a multiple of the balanced
    load (max tokens per rank x topk). It sizes the rows a rank holds (the kept gate/up rows, the
    backward's rows, the schedule); None sizes them for every token of every rank routed to one rank, P
    times the balanced load, which at P = 8 and DeepSeek-V3's shape is ~4 GB of kept rows per layer for
    8192 tokens per rank. A forward whose routing sends some rank more stops before moving any data, on
    every rank, and raises pounce.Error naming the rank and its routes (nothing is dropped silently); on
    one GPU the module runs on, across GPUs call close() on every rank (the next forward makes a new
    layer).

    main_grad: the weight gradients are added in fp32 to w13.main_grad and w2.main_grad (fp32 tensors
    shaped like the weights, made as zeros on the first forward unless the training framework set them,
    as Megatron's distributed optimizer does with views of its gradient buffer) instead of becoming bf16
    .grad: micro-batches accumulate without a bf16 rounding each, and the weights' .grad stays None (a
    weight with Megatron's grad_added_to_main_grad flag gets a placeholder instead, for its hooks). Zero
    the main grads after each optimizer step.

    Memory: MoE layers of one shape on a GPU (same hidden, intermediate, experts, topk, ranks and token
    size) share their scratch rows, the forward's hidden and output rings and the backward's rows, so a
    model's n layers hold them once (layer.info(): shared_bytes, shared_id). Their forwards and backwards
    are ordered on the GPU in call order, across streams too; calls inside a CUDA graph are the caller's to
    order with other layers' calls, and across GPUs every rank calls its layers in the same order.

    Device errors (routing ids out of range or repeated within a token, a routing past capacity_factor; a
    wait that gave up) end the kernel and are raised as pounce.Error by the next forward, or by
    check_device_errors(). options: a dict
    of pounce::FusedMoeOptions fields (ring_bytes, wait_timeout_ns, ...); {"fp8_forward": 1} runs the forward
    in E4M3, {"fp8_data_gradients": 1} (one GPU) the backward's data-gradient GEMMs, both on E4M3 copies of
    the weights, refreshed whenever the weights
    changed by PyTorch's own ops (a new tensor, or an in-place update that bumps the tensor's version,
    as torch.optim's do) and at every CUDA-graph replay; after writes the versions do not show (through
    .data, or fused optimizer kernels), call refresh_fp8_weights()."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        experts: int,
        topk: int,
        group=None,
        *,
        max_tokens: Optional[int] = None,
        capacity_factor: Optional[float] = None,
        main_grad: bool = False,
        dtype: torch.dtype = torch.bfloat16,
        device=None,
        virtual_ranks: Optional[int] = None,
        options: Optional[dict] = None,
    ):
        super().__init__()
        if dtype != torch.bfloat16:
            raise Error(f"pounce.MoE: dtype = {dtype}: the fused layer runs bf16 only")
        self.layer = Layer(
            hidden,
            intermediate,
            experts,
            topk,
            group,
            virtual_ranks=virtual_ranks,
            max_tokens=max_tokens,
            capacity_factor=capacity_factor,
            options=options,
        )
        self.uses_main_grad = main_grad
        n = self.layer.experts_here
        self.w13 = nn.Parameter(torch.empty(n, 2 * intermediate, hidden, dtype=dtype, device=device))
        self.w2 = nn.Parameter(torch.empty(n, hidden, intermediate, dtype=dtype, device=device))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.w13.uniform_(-1 / math.sqrt(self.layer.hidden), 1 / math.sqrt(self.layer.hidden))
            self.w2.uniform_(-1 / math.sqrt(self.layer.intermediate), 1 / math.sqrt(self.layer.intermediate))

    def load_experts(self, gate: Tensor, up: Tensor, down: Tensor) -> None:
        """Sets this rank's experts from separate projections, as checkpoints store them: gate and up
        [E/P, I, H] (nn.Linear(H, I) weights), down [E/P, H, I] (nn.Linear(I, H) weights)."""
        if tuple(down.shape) != tuple(self.w2.shape):
            raise Error(f"pounce.MoE.load_experts: down has shape {tuple(down.shape)}, expected {list(self.w2.shape)}")
        w13 = interleave_w13(gate, up)
        if tuple(w13.shape) != tuple(self.w13.shape):
            raise Error(
                f"pounce.MoE.load_experts: gate and up have shape {tuple(gate.shape)}, expected "
                f"{[self.w13.shape[0], self.w13.shape[1] // 2, self.w13.shape[2]]}"
            )
        with torch.no_grad():
            self.w13.copy_(w13)
            self.w2.copy_(down)

    def forward(self, x: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> Tensor:
        main_grads = None
        if self.uses_main_grad and torch.is_grad_enabled():
            compiling = torch.compiler.is_compiling()
            for w in (self.w13, self.w2):
                if compiling and hasattr(w, "grad_added_to_main_grad"):
                    raise Error(
                        "pounce.MoE(main_grad=True): a weight flagged grad_added_to_main_grad (Megatron's data-"
                        "parallel protocol) needs its placeholder gradient, which a compiled backward cannot give"
                    )
                if getattr(w, "main_grad", None) is None:
                    if compiling:
                        raise Error(
                            "pounce.MoE(main_grad=True): the weights have no main_grad yet, and a compiled region "
                            "cannot make one: run one forward outside torch.compile first (or set them)"
                        )
                    w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
            main_grads = (self.w13.main_grad, self.w2.main_grad)
        return moe(x, topk_ids, topk_weights, self.w13, self.w2, layer=self.layer, main_grads=main_grads)

    def refresh_fp8_weights(self) -> None:
        """With options={"fp8_forward": 1} or {"fp8_data_gradients": 1}: quantize the weights into the E4M3 copies now
        (after updates the tensors' versions do not show)."""
        self.layer.refresh_fp8_weights(self.w13.detach(), self.w2.detach())

    def check_device_errors(self) -> None:
        """Synchronizes the current stream and raises pounce.Error for an error a forward's kernel
        reported. The next forward checks the same without synchronizing."""
        self.layer.check_device_errors()

    def close(self) -> None:
        """Frees the fused layer's GPU memory (the next forward makes it again). Across GPUs every rank
        calls it; layers on one GPU are also freed with the module."""
        self.layer.close()

    def extra_repr(self) -> str:
        L = self.layer
        where = f", ranks={L.ranks}" + (", virtual" if L.group is None and L.ranks > 1 else "")
        main_grad = ", main_grad=True" if self.uses_main_grad else ""
        return f"hidden={L.hidden}, intermediate={L.intermediate}, experts={L.experts}, topk={L.topk}{where}{main_grad}"

"""Shared by the tests: the skip reasons, an eager fp32 MoE to compare against, random problems."""

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: the Python package's tests need it")
import pounce  # noqa: E402


def gpu_skip_reason():
    """Why the fused layer cannot run here, or None on a Hopper GPU."""
    if not torch.cuda.is_available():
        return "needs a CUDA GPU: torch.cuda.is_available() is False"
    if torch.cuda.get_device_capability() != (9, 0):
        return f"needs a Hopper GPU (sm_90), this is {torch.cuda.get_device_name()}"
    return None


needs_hopper = pytest.mark.skipif(gpu_skip_reason() is not None, reason=str(gpu_skip_reason()))


def library_skip_reason():
    """Why libpounce.so cannot be loaded here (not built, not installed), or None."""
    try:
        pounce._lib.library()
    except pounce.Error as e:
        return f"libpounce.so not loadable (build it with cmake, or install the package): {e}"
    return None


def reference_route_outputs(x, topk_ids, w13, w2):
    """Each route's expert output before its router weight, [T, k, H] fp32 (differentiable), one expert at
    a time."""
    x, w13, w2 = x.float(), w13.float(), w2.float()
    gate, up = pounce.split_w13(w13)
    out = torch.zeros(*topk_ids.shape, x.shape[-1], device=x.device)
    for e in range(w13.shape[0]):
        tokens, slot = (topk_ids == e).nonzero(as_tuple=True)
        if tokens.numel() == 0:
            continue
        xe = x[tokens]
        out = out.index_put((tokens, slot), (torch.nn.functional.silu(xe @ gate[e].T) * (xe @ up[e].T)) @ w2[e].T)
    return out


def reference_moe(x, topk_ids, topk_weights, w13, w2):
    """The MoE of pounce.moe in fp32 eager PyTorch (differentiable): the routes' outputs weighted and summed."""
    return (topk_weights.float()[..., None] * reference_route_outputs(x, topk_ids, w13, w2)).sum(1)


def random_routing(tokens, experts, topk, *, pattern="uniform", generator=None, device="cpu"):
    """topk_ids [T, k] int32 (distinct experts per token) and topk_weights [T, k] fp32.
    pattern: "uniform"; "skewed" (most routes to the first experts, the last ones empty); "zero-weights"
    (uniform ids, a third of the weights exactly 0 and token 0 with only zeros)."""
    if pattern == "skewed":
        bias = torch.linspace(4, -4, experts)
        bias[experts // 2 :] = -1e9  # the second half of the experts gets nothing
        logits = torch.randn(tokens, experts, generator=generator) + bias
    else:
        logits = torch.randn(tokens, experts, generator=generator)
    ids = logits.topk(topk, dim=-1).indices.to(torch.int32)
    weights = torch.rand(tokens, topk, generator=generator)
    if pattern == "zero-weights":
        weights[torch.rand(tokens, topk, generator=generator) < 1 / 3] = 0
        weights[:1] = 0
    return ids.to(device), weights.to(device)


def relative_error(got, want):
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()

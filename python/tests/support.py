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
    pattern: "uniform"; "zipf" (expert popularity ~ 1 / rank^1.2 over a random ranking: a few hot experts);
    "skewed" (most routes to the first experts, the last ones empty); "zero-weights" (uniform ids, a third
    of the weights exactly 0 and token 0 with only zeros); "hot" (every token on the same k experts, so
    one expert's rows span many m-blocks)."""
    if pattern == "hot":
        ids = torch.randperm(experts, generator=generator)[:topk].to(torch.int32).repeat(tokens, 1)
        return ids.to(device), torch.rand(tokens, topk, generator=generator).to(device)
    if pattern == "skewed":
        bias = torch.linspace(4, -4, experts)
        bias[experts // 2 :] = -1e9  # the second half of the experts gets nothing
        logits = torch.randn(tokens, experts, generator=generator) + bias
    elif pattern == "zipf":
        # k experts drawn without replacement with probability ~ popularity: a top-k over
        # log(popularity) + Gumbel noise.
        rank = torch.randperm(experts, generator=generator).double() + 1
        gumbel = -torch.log(-torch.log(torch.rand(tokens, experts, generator=generator, dtype=torch.float64)))
        logits = -1.2 * torch.log(rank) + gumbel
    elif pattern in ("uniform", "zero-weights"):
        logits = torch.randn(tokens, experts, generator=generator)
    else:
        raise ValueError(f"random_routing: unknown pattern {pattern!r}")
    ids = logits.topk(topk, dim=-1).indices.to(torch.int32)
    weights = torch.rand(tokens, topk, generator=generator)
    if pattern == "zero-weights":
        weights[torch.rand(tokens, topk, generator=generator) < 1 / 3] = 0
        weights[:1] = 0
    return ids.to(device), weights.to(device)


def relative_error(got, want):
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def expect_close(name, got, want, tolerance=1e-2):
    if want.abs().sum() == 0:
        assert got.abs().sum() == 0, f"{name} should be exactly zero"
    else:
        error = relative_error(got, want)
        assert error < tolerance, f"{name}: relative L2 error {error:.2e}"


def expect_route_dots_close(got, want, dy, route_outputs):
    """d_topk_weights[t, j] = <dy[t], o[t, j]>: dot products of H terms that may cancel. Each is held to
    2^-8 of |dy[t]| |o[t, j]| (an emulation of the bf16 rows and gate/up values stays within 2^-9.6 of it;
    a wrong route misses by ~|dy| |o| / sqrt(H)); with enough routes for the sum to be well conditioned,
    all of them together also to 1e-2 relative L2 (which catches an error common to every route)."""
    bound = 2.0**-8 * dy.float().norm(dim=-1, keepdim=True) * route_outputs.norm(dim=-1)
    excess = (got.float() - want.float()).abs() - bound
    worst = int(excess.argmax())
    assert excess.max() <= 0, (
        f"d_topk_weights: route {divmod(worst, got.shape[-1])} is {got.flatten()[worst]:.5g}, "
        f"expected {want.flatten()[worst]:.5g} within {bound.flatten()[worst]:.3g}"
    )
    if got.numel() >= 64:
        expect_close("d_topk_weights", got, want)


def expect_matches_reference(moe, x, topk_ids, topk_weights, y, dy, where=""):
    """y = moe(x, topk_ids, topk_weights) and the gradients its backward of dy left in x, topk_weights and
    the module's weights, against the eager fp32 MoE on the same values."""
    leaves = [t.detach().float().requires_grad_() for t in (x, topk_weights, moe.w13, moe.w2)]
    want = reference_moe(leaves[0], topk_ids, *leaves[1:])
    want.backward(dy.float())
    expect_close(f"{where}y", y, want)
    for name, got, leaf in zip(("dx", "dw13", "dw2"), (x, moe.w13, moe.w2), (leaves[0], leaves[2], leaves[3])):
        # Without tokens the reference's graph never reaches the leaves: their gradients are zero.
        expect_close(f"{where}{name}", got.grad, leaf.grad if leaf.grad is not None else torch.zeros_like(leaf))
    if x.shape[0] == 0:
        return
    with torch.no_grad():
        route_outputs = reference_route_outputs(x, topk_ids, moe.w13, moe.w2)
    expect_route_dots_close(topk_weights.grad, leaves[1].grad, dy, route_outputs)


def expect_checkpointing_gives_the_plain_bits(layers, routings, x, dy, reentrant):
    """torch.utils.checkpoint around `layers` with residuals (h = h + moe(h) for each, on its routing)
    gives the output, dx and every weight gradient of the same step without checkpointing, bit for bit."""

    def block(h):
        for moe, (ids, weights) in zip(layers, routings):
            h = h + moe(h, ids, weights)
        return h

    def step(checkpointed):
        for moe in layers:
            moe.w13.grad = moe.w2.grad = None
        h = x.clone().requires_grad_()
        y = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=reentrant) if checkpointed else block(h)
        y.backward(dy)
        return [y.detach(), h.grad] + [w.grad.clone() for moe in layers for w in (moe.w13, moe.w2)]

    names = ["y", "dx"] + [f"{w} of layer {i}" for i in range(len(layers)) for w in ("dw13", "dw2")]
    for name, plain, checkpointed in zip(names, step(False), step(True)):
        assert torch.equal(plain, checkpointed), f"{name} differs under checkpointing"

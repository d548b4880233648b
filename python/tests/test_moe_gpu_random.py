"""pounce.MoE on drawn configurations against the eager fp32 MoE: shapes (H and I any multiple of 64, odd
token counts and none, top-k from 1 to 12), rank counts (one, and 2 to 8 virtual ranks, odd ones included),
expert counts up to 48, or up to 1024 on one rank (the most a rank may hold) with small H and I, routings
(uniform, Zipf, half the experts empty, every token on the same experts, exact-zero weights), the fused
backward, a bounded ring that the forward reuses and the backward replays, and several steps on one
module with the token count and the routing changing between them; the E4M3 forward and data gradients
on drawn configurations within FP8's band; then the layer shapes of real models. Skipped without a Hopper
GPU. POUNCE_DRAWN_CONFIGS and POUNCE_DRAWN_FP8_CONFIGS draw more configurations (a longer search for
failing ones), from seed POUNCE_DRAWN_FIRST_SEED on (default 0), so that a search can draw configurations
that earlier searches did not."""

import os
import random

import pytest
from support import (
    expect_close,
    expect_matches_reference,
    needs_hopper,
    pounce,
    random_routing,
    reference_moe,
    torch,
)

pytestmark = needs_hopper

PATTERNS = ("uniform", "zipf", "skewed", "zero-weights", "hot")
CONFIGS = int(os.environ.get("POUNCE_DRAWN_CONFIGS", 12))
FP8_CONFIGS = int(os.environ.get("POUNCE_DRAWN_FP8_CONFIGS", 4))
FIRST_SEED = int(os.environ.get("POUNCE_DRAWN_FIRST_SEED", 0))


def draw_config(seed):
    """One configuration, reproducible from its seed: the layer's shape, ranks, options and step sizes."""
    r = random.Random(seed)
    P = r.choice([None, None, 2, 3, 5, 6, 7, 8])
    ranks = P or 1
    if r.random() < 0.15:  # many small experts, up to 1024 on one rank (the most a rank may hold)
        E = ranks * r.randint(49 // ranks + 1, 1024 // ranks)
        H, I = 64 * r.randint(1, 4), 64 * r.randint(1, 2)
    else:
        E = ranks * r.randint(1, 48 // ranks)
        H, I = 64 * r.randint(1, 12), 64 * r.randint(1, 8)
    k = r.randint(1, min(E, 12))
    options = {}
    if r.random() < 0.5:
        options["fused_backward"] = 1
    if r.random() < 0.3:  # a ring of two 128-row minibatches: reused within a forward, replayed by the backward
        options.update(minibatch_rows=128, ring_blocks=2)
    steps = [r.randint(1, 700) for _ in range(3)]
    steps[r.randrange(3)] |= 1  # an odd token count in every configuration
    if seed % 6 == 2:
        steps[1] = 0  # a step without tokens between two with
    if seed % 6 == 0:
        steps[2] = 1
    if r.random() < 0.3:  # in place at one rank (else no effect): the x ring shared, the backward copying x again
        options["keep_x_rows"] = 0
    return dict(P=P, E=E, k=k, H=H, I=I, options=options, steps=steps, seed=seed)


def config_id(seed):
    c = draw_config(seed)
    options = ",".join(f"{k}={v}" for k, v in c["options"].items())
    return f"s{seed}_P{c['P'] or 1}_E{c['E']}_k{c['k']}_H{c['H']}_I{c['I']}_T{'-'.join(map(str, c['steps']))}" + (
        f"_{options}" if options else ""
    )


def drawn_steps(moe, c, seed, g):
    """The steps of a drawn configuration on `moe`, the routing pattern changing with the step: yields
    (where, x, ids, weights, y, dy) after each step's forward and its backward of dy. Routes with only
    zero weights must give exact zeros."""
    for step, T in enumerate(c["steps"]):
        pattern = PATTERNS[(seed + step) % len(PATTERNS)]
        where = f"step {step} (T {T}, {pattern}): "
        x = torch.randn(T, c["H"], generator=g).bfloat16().cuda().requires_grad_()
        ids, weights = random_routing(T, c["E"], c["k"], pattern=pattern, generator=g, device="cuda")
        weights.requires_grad_()
        moe.w13.grad = moe.w2.grad = None
        y = moe(x, ids, weights)
        dy = torch.randn(y.shape, generator=g).to(y)
        y.backward(dy)
        if pattern == "zero-weights" and T > 0:
            assert y[0].abs().sum() == 0, f"{where}token 0 has only zero weights"
        yield where, x, ids, weights, y, dy


@pytest.mark.parametrize("seed", range(FIRST_SEED, FIRST_SEED + CONFIGS), ids=config_id)
def test_drawn_configuration_over_steps_matches_the_eager_reference(seed):
    c = draw_config(seed)
    g = torch.Generator().manual_seed(seed)
    moe = pounce.MoE(c["H"], c["I"], c["E"], c["k"], virtual_ranks=c["P"], device="cuda", options=c["options"])
    with torch.no_grad():
        moe.w13.copy_(torch.randn(moe.w13.shape, generator=g) * 0.1)
        moe.w2.copy_(torch.randn(moe.w2.shape, generator=g) * 0.1)
    for where, x, ids, weights, y, dy in drawn_steps(moe, c, seed, g):
        expect_matches_reference(moe, x, ids, weights, y, dy, where=where)
    moe.check_device_errors()


def draw_fp8_config(seed):
    """An E4M3 configuration (fp8_forward or fp8_data_gradients): H and I multiples of 128 (E4M3 blocks)."""
    r = random.Random(1_000_003 * (seed + 1))
    P = r.choice([None, None, 2, 3, 5, 7])
    ranks = P or 1
    if r.random() < 0.15:  # many small experts
        E = ranks * r.randint(29 // ranks + 1, 512 // ranks)
        H, I = 128 * r.randint(1, 2), 128
    else:
        E = ranks * r.randint(1, 28 // ranks)
        H, I = 128 * r.randint(1, 6), 128 * r.randint(1, 4)
    k = r.randint(1, min(E, 9))
    option = r.choice(["fp8_forward", "fp8_data_gradients"])
    steps = [r.randint(1, 600) for _ in range(2)]
    steps[r.randrange(2)] |= 1
    return dict(P=P, E=E, k=k, H=H, I=I, option=option, steps=steps)


def fp8_config_id(seed):
    c = draw_fp8_config(seed)
    steps = "-".join(map(str, c["steps"]))
    return f"s{seed}_{c['option']}_P{c['P'] or 1}_E{c['E']}_k{c['k']}_H{c['H']}_I{c['I']}_T{steps}"


@pytest.mark.parametrize("seed", range(FIRST_SEED, FIRST_SEED + FP8_CONFIGS), ids=fp8_config_id)
def test_drawn_fp8_configuration_over_steps_is_within_the_fp8_band(seed):
    """Outputs and gradients within 0.1 relative L2 of the eager fp32 MoE (E4M3 keeps 3 fraction bits: the
    checks at fixed shapes measure 3.6-5.1 %); the routes with only zero weights give exact zeros."""
    c = draw_fp8_config(seed)
    g = torch.Generator().manual_seed(seed)
    moe = pounce.MoE(c["H"], c["I"], c["E"], c["k"], virtual_ranks=c["P"], device="cuda", options={c["option"]: 1})
    with torch.no_grad():
        moe.w13.copy_(torch.randn(moe.w13.shape, generator=g) / c["H"] ** 0.5)
        moe.w2.copy_(torch.randn(moe.w2.shape, generator=g) / c["I"] ** 0.5)
    for where, x, ids, weights, y, dy in drawn_steps(moe, c, seed, g):
        leaves = [t.detach().float().requires_grad_() for t in (x, weights, moe.w13, moe.w2)]
        want = reference_moe(*leaves[:1], ids, *leaves[1:])
        want.backward(dy.float())
        expect_close(f"{where}y", y, want, tolerance=0.1)
        for name, got, leaf in zip(("dx", "d_topk_weights", "dw13", "dw2"), (x, weights, moe.w13, moe.w2), leaves):
            reference = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            if name != "d_topk_weights" or got.numel() >= 64:  # a few route dots may cancel
                expect_close(f"{where}{name}", got.grad, reference, tolerance=0.1)
    moe.check_device_errors()


# Model shapes: (name, H, I, experts on this GPU, k, T, virtual ranks, options); weights at the usual
# 1/sqrt(fan-in) scale, Zipf-like skew from the drawn logits.
MODEL_SHAPES = [
    ("deepseek_v3_rank", 7168, 2048, 32, 8, 1024, None, {"fused_backward": 1}),
    ("kimi_k2_3_ranks", 7168, 2048, 48, 8, 777, 3, {}),
    ("qwen3_30b_4_ranks", 2048, 768, 128, 8, 2048, 4, {"fused_backward": 1}),
    ("qwen3_30b_rank_x_rows_copied", 2048, 768, 128, 8, 1501, None, {"fused_backward": 1, "keep_x_rows": 0}),
    ("mixtral_2_ranks", 4096, 14336, 8, 2, 513, 2, {"fused_backward": 1}),
]


@pytest.mark.parametrize("shape", MODEL_SHAPES, ids=lambda s: s[0])
def test_model_shape_matches_the_eager_reference(shape):
    name, H, I, E, k, T, P, options = shape
    g = torch.Generator().manual_seed(len(name))
    moe = pounce.MoE(H, I, E, k, virtual_ranks=P, device="cuda", options=options)
    with torch.no_grad():
        moe.w13.copy_(torch.randn(moe.w13.shape, generator=g) / H**0.5)
        moe.w2.copy_(torch.randn(moe.w2.shape, generator=g) / I**0.5)
    x = torch.randn(T, H, generator=g).bfloat16().cuda().requires_grad_()
    logits = torch.randn(T, E, generator=g) + torch.linspace(2, -2, E)  # some experts busier than others
    ids = logits.topk(k, dim=-1).indices.to(torch.int32).cuda()
    weights = torch.rand(T, k, generator=g).cuda().requires_grad_()
    y = moe(x, ids, weights)
    dy = torch.randn(y.shape, generator=g).to(y)
    y.backward(dy)
    expect_matches_reference(moe, x, ids, weights, y, dy)
    moe.check_device_errors()

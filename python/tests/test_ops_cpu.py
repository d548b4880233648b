"""What runs without a GPU: the PyTorch backward op (pounce::moe_backward) against autograd through the
eager reference, the inputs the forward op rejects by name, and errors from libpounce's C ABI arriving as
pounce.Error with the library's message."""

import ctypes
import gc
import sys

import pytest
from support import library_skip_reason, pounce, random_routing, reference_moe, relative_error, torch


def problem(T, H, I, E, k, pattern, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).bfloat16()
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.1).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g) * 0.1).bfloat16()
    ids, weights = random_routing(T, E, k, pattern=pattern, generator=g)
    return x, ids, weights, w13, w2


@pytest.mark.parametrize(
    "T, H, I, E, k, pattern",
    [
        (40, 64, 64, 8, 2, "uniform"),
        (33, 128, 64, 16, 4, "skewed"),
        (20, 64, 128, 4, 3, "zero-weights"),
        (50, 64, 64, 16, 3, "zipf"),
        (0, 64, 64, 4, 1, "uniform"),
    ],
)
def test_backward_op_matches_autograd_of_the_reference(T, H, I, E, k, pattern):
    x, ids, weights, w13, w2 = problem(T, H, I, E, k, pattern)
    layer = pounce.Layer(H, I, E, k)
    dy = torch.randn(T, H).bfloat16()
    dx, dweights, dw13, dw2 = torch.ops.pounce.moe_backward(dy, x, ids, weights, w13, w2, layer.key)
    assert (dx.dtype, dweights.dtype, dw13.dtype, dw2.dtype) == (torch.bfloat16, torch.float32) + (torch.bfloat16,) * 2
    if T == 0:  # no tokens: nothing flows anywhere
        assert dx.shape == (0, H) and dweights.shape == (0, k) and dw13.abs().sum() == 0 and dw2.abs().sum() == 0
        return

    leaves = [t.float().requires_grad_() for t in (x, weights, w13, w2)]
    reference_moe(leaves[0], ids, *leaves[1:]).backward(dy.float())
    for name, got, leaf in zip(("dx", "d_topk_weights", "dw13", "dw2"), (dx, dweights, dw13, dw2), leaves):
        if leaf.grad.abs().sum() > 0:
            assert relative_error(got, leaf.grad) < 1e-2, name
        else:
            assert got.abs().sum() == 0, name
    if pattern == "skewed":  # the empty experts get exactly zero gradients
        assert dw13[E // 2 :].abs().sum() == 0 and dw2[E // 2 :].abs().sum() == 0


@pytest.mark.parametrize("pattern", ["uniform", "zipf", "skewed", "zero-weights", "hot"])
def test_random_routing_gives_distinct_experts_in_the_named_shape(pattern):
    T, E, k = 4096, 32, 4
    ids, weights = random_routing(T, E, k, pattern=pattern, generator=torch.Generator().manual_seed(3))
    assert ids.shape == (T, k) and ids.dtype == torch.int32 and weights.shape == (T, k)
    assert ((ids >= 0) & (ids < E)).all()
    assert (ids.sort(dim=-1).values.diff(dim=-1) > 0).all(), "a token's experts must be distinct"
    load = torch.bincount(ids.flatten().long(), minlength=E)
    share = T * k / E
    if pattern == "zipf":
        assert load.max() > 3 * share, "zipf: the hottest expert should draw several times its share"
    elif pattern == "hot":
        assert (load > 0).sum() == k
    elif pattern == "skewed":
        assert load[E // 2 :].sum() == 0
    else:
        assert load.max() < 1.5 * share
    with pytest.raises(ValueError, match="unknown pattern"):
        random_routing(T, E, k, pattern="zipfian")


def inputs(T=8, H=64, I=64, E=4, k=2):
    x, ids, weights, w13, w2 = problem(T, H, I, E, k, "uniform")
    return dict(x=x, topk_ids=ids, topk_weights=weights, w13=w13, w2=w2), pounce.Layer(H, I, E, k)


@pytest.mark.parametrize(
    "change, needle",
    [
        (lambda a: a.update(x=a["x"].float()), "x has dtype torch.float32, expected torch.bfloat16"),
        (lambda a: a.update(x=a["x"][:, :32]), "x has shape (8, 32), expected [tokens, hidden = 64]"),
        (lambda a: a.update(topk_ids=a["topk_ids"].long()), "topk_ids has dtype torch.int64, expected torch.int32"),
        (lambda a: a.update(topk_ids=a["topk_ids"][:4]), "topk_ids has shape (4, 2), expected [8, 2]"),
        (lambda a: a.update(topk_weights=a["topk_weights"].bfloat16()), "topk_weights has dtype torch.bfloat16"),
        (lambda a: a.update(topk_weights=a["topk_weights"].t().contiguous().t()), "topk_weights is not contiguous"),
        (lambda a: a.update(w13=a["w13"][:, :64]), "w13 has shape (4, 64, 64), expected [4, 128, 64]"),
        (lambda a: a.update(w2=a["w2"].transpose(1, 2).contiguous().transpose(1, 2)), "w2 is not contiguous"),
        (lambda a: a.update(x=torch.empty(8 * 64 + 1, dtype=torch.bfloat16)[1:].view(8, 64)), "x at 0x"),
        (lambda a: None, "x is on cpu, expected a CUDA device"),
    ],
)
def test_forward_names_bad_inputs(change, needle):
    args, layer = inputs()
    change(args)
    with pytest.raises(pounce.Error) as raised:
        torch.ops.pounce.moe_forward(*args.values(), layer.key)
    assert needle in str(raised.value)
    if needle == "x at 0x":
        assert "is not 16-byte aligned" in str(raised.value)


def test_module_names_its_problems():
    with pytest.raises(pounce.Error, match="runs bf16 only"):
        pounce.MoE(64, 64, 4, 2, dtype=torch.float32)
    with pytest.raises(pounce.Error, match="experts = 6 must be divisible by the 4 ranks"):
        pounce.MoE(64, 64, 6, 2, virtual_ranks=4)
    moe = pounce.MoE(64, 64, 4, 2)
    with pytest.raises(pounce.Error, match=r"down has shape \(4, 64, 32\)"):
        moe.load_experts(torch.zeros(4, 64, 64), torch.zeros(4, 64, 64), torch.zeros(4, 64, 32))


def test_load_experts_interleaves_gate_and_up():
    moe = pounce.MoE(64, 32, 2, 1)
    gate, up, down = torch.randn(2, 32, 64), torch.randn(2, 32, 64), torch.randn(2, 64, 32)
    moe.load_experts(gate, up, down)
    assert torch.equal(moe.w13, pounce.interleave_w13(gate, up).bfloat16())
    assert torch.equal(moe.w2, down.bfloat16())
    bound = 1 / 64**0.5  # the default initialisation: nn.Linear's bound
    assert pounce.MoE(64, 32, 2, 1).w13.abs().max() <= bound


@pytest.mark.skipif(library_skip_reason() is not None, reason=str(library_skip_reason()))
def test_c_errors_arrive_as_pounce_error_with_the_library_message():
    layer = pounce.Layer(100, 64, 8, 2)  # hidden not a multiple of 64
    with pytest.raises(pounce.Error, match="EP config: hidden = 100 is not supported"):
        layer._create(16, torch.device("cpu"))
    assert issubclass(pounce.Error, RuntimeError)
    lib = pounce._lib.library()
    with pytest.raises(pounce.Error, match="layer is NULL"):
        pounce._lib.check(lib.pounce_moe_forward(None, 0, None, 0, None))
    with pytest.raises(pounce.Error, match="out is NULL"):
        pounce._lib.check(lib.pounce_moe_get_info(ctypes.c_void_p(), None))
    assert pounce._lib.default_options().wait_timeout_ns == 5_000_000_000
    assert pounce._lib.default_options().fused_backward == 0  # on one GPU the chain of kernels by default
    assert pounce._lib.default_options().keep_x_rows == 1  # a training forward in place keeps its x rows
    with pytest.raises(pounce.Error, match="unknown option 'ring'"):
        pounce.Layer(64, 64, 8, 2, options={"ring": 1})._options()


def test_a_rejected_layer_is_collected_without_an_error(monkeypatch):
    """A Layer whose arguments were rejected in its constructor is garbage collected quietly (its __del__
    must not read attributes the constructor never set)."""
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    for bad in ({"capacity_factor": 0}, {"virtual_ranks": 3}):  # 3 ranks do not divide 4 experts
        with pytest.raises(pounce.Error):
            pounce.Layer(64, 64, 4, 2, **bad)
        gc.collect()
    assert not unraisable, [str(u.exc_value) for u in unraisable]

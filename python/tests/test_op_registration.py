"""The ops' registration (schema, fake implementation, autograd) under torch.library.opcheck and
torch.compile(fullgraph=True), without a GPU: the fused kernel is replaced by the eager reference and
the CUDA-device check is dropped (on CPU tensors the backward op is the PyTorch one), everything else is
pounce's own. The GPU tests repeat this with the
kernel."""

import re

import pytest
from support import (
    expect_checkpointing_gives_the_plain_bits,
    pounce,
    random_routing,
    reference_moe,
    relative_error,
    torch,
)

from pounce import _ops


@pytest.fixture
def kernel_on_cpu(monkeypatch):
    check = _ops.check_inputs

    def check_but_device(*args, **kwargs):
        try:
            check(*args, **kwargs)
        except pounce.Error as e:
            if "expected a CUDA device" not in str(e):
                raise

    monkeypatch.setattr(_ops, "check_inputs", check_but_device)
    def forward(self, x, ids, w, w13, w2, keep=False):
        with torch.autocast("cpu", enabled=False):  # as the kernel, which autocast does not reach
            return reference_moe(x, ids, w, w13, w2).to(x.dtype)

    monkeypatch.setattr(pounce.Layer, "forward", forward)


def make(T=24, H=64, I=64, E=4, k=2):
    g = torch.Generator().manual_seed(3)
    moe = pounce.MoE(H, I, E, k)
    x = torch.randn(T, H, generator=g).bfloat16().requires_grad_()
    ids, weights = random_routing(T, E, k, generator=g)
    return moe, x, ids, weights.requires_grad_()


def test_opcheck(kernel_on_cpu):
    moe, x, ids, weights = make()
    torch.library.opcheck(torch.ops.pounce.moe_forward.default, (x, ids, weights, moe.w13, moe.w2, moe.layer.key))


def test_compile_fullgraph_forward_and_backward(kernel_on_cpu):
    moe, x, ids, weights = make()
    compiled = torch.compile(lambda x, ids, w: moe(x, ids, w) * 2, fullgraph=True, backend="aot_eager")
    y = compiled(x, ids, weights)
    y.float().square().sum().backward()
    got = x.grad, weights.grad, moe.w13.grad
    x.grad = weights.grad = moe.w13.grad = None
    want = moe(x, ids, weights) * 2
    want.float().square().sum().backward()
    assert torch.equal(y, want)
    for name, a, b in zip(("dx", "d_topk_weights", "dw13"), got, (x.grad, weights.grad, moe.w13.grad)):
        assert relative_error(a, b) < 1e-6, name


def make_main_grad_module(T=24, H=64, I=64, E=4, k=2):
    moe, x, ids, weights = make(T, H, I, E, k)
    main = pounce.MoE(H, I, E, k, main_grad=True)
    main.load_state_dict(moe.state_dict())
    return main, moe, x, ids, weights


def test_opcheck_with_main_grads(kernel_on_cpu):
    moe, x, ids, weights = make()
    mains = (torch.zeros(moe.w13.shape), torch.zeros(moe.w2.shape))
    forward = torch.ops.pounce.moe_forward.default
    torch.library.opcheck(forward, (x, ids, weights, moe.w13, moe.w2, moe.layer.key, True, *mains))
    dy = torch.randn(x.shape).to(x)
    inputs = [t.detach() for t in (x, weights, moe.w13, moe.w2)]  # the backward op has no backward
    backward = torch.ops.pounce.moe_backward_into_main_grads.default
    torch.library.opcheck(backward, (dy, inputs[0], ids, *inputs[1:], *mains, moe.layer.key))


def test_main_grads_accumulate_micro_batches_and_leave_no_weight_grad(kernel_on_cpu):
    """main_grad=True: each backward adds its fp32 weight gradients to w13.main_grad and w2.main_grad (made
    as zeros on the first forward), the sum of the micro-batches' gradients, and w13.grad stays None;
    dx and the router weights' gradient are those of the layer without main grads."""
    main, plain, x, ids, weights = make_main_grad_module()
    steps = [(x, ids, weights), (x.detach().flip(0).requires_grad_(), ids.flip(0), weights.detach().flip(0))]
    want13, want2 = torch.zeros(plain.w13.shape), torch.zeros(plain.w2.shape)
    for x_, ids_, w_ in steps:
        xa, xb = x_.detach().requires_grad_(), x_.detach().requires_grad_()
        wa, wb = w_.detach().requires_grad_(), w_.detach().requires_grad_()
        main(xa, ids_, wa).float().square().sum().backward()
        plain.w13.grad = plain.w2.grad = None
        leaves = [t.detach().float().requires_grad_() for t in (xb, wb, plain.w13, plain.w2)]
        reference_moe(leaves[0], ids_, *leaves[1:]).to(xb.dtype).float().square().sum().backward()
        plain(xb, ids_, wb).float().square().sum().backward()
        want13 += leaves[2].grad
        want2 += leaves[3].grad
        assert torch.equal(xa.grad, xb.grad) and torch.equal(wa.grad, wb.grad)
    assert main.w13.grad is None and main.w2.grad is None
    assert main.w13.main_grad.dtype == torch.float32
    assert relative_error(main.w13.main_grad, want13) < 1e-2 and relative_error(main.w2.main_grad, want2) < 1e-2


def test_compile_fullgraph_with_main_grads(kernel_on_cpu):
    main, _, x, ids, weights = make_main_grad_module()
    main(x, ids, weights)  # makes the main grads, outside the compiled region
    main.w13.main_grad.zero_()
    main.w2.main_grad.zero_()
    compiled = torch.compile(lambda x, ids, w: main(x, ids, w) * 2, fullgraph=True, backend="aot_eager")
    compiled(x, ids, weights).float().square().sum().backward()
    got = main.w13.main_grad.clone(), main.w2.main_grad.clone()
    main.w13.main_grad.zero_()
    main.w2.main_grad.zero_()
    (main(x, ids, weights) * 2).float().square().sum().backward()
    assert main.w13.grad is None
    for a, b in zip(got, (main.w13.main_grad, main.w2.main_grad)):
        assert relative_error(a, b) < 1e-6


def test_main_grads_of_the_wrong_dtype_or_shape_are_rejected_by_name(kernel_on_cpu):
    moe, x, ids, weights = make()
    wrong_dtype, wrong_shape = torch.zeros(moe.w13.shape, dtype=torch.bfloat16), torch.zeros(moe.w13.shape[1:])
    for bad, what in ((wrong_dtype, "main_w13 is torch.bfloat16"), (wrong_shape, "main_w13 is torch.float32 (")):
        with pytest.raises(pounce.Error, match=re.escape(what)):
            pounce.moe(x, ids, weights, moe.w13, moe.w2, layer=moe.layer, main_grads=(bad, torch.zeros(moe.w2.shape)))
    with pytest.raises(pounce.Error, match="both w13 and w2"):
        torch.ops.pounce.moe_forward(x, ids, weights, moe.w13, moe.w2, moe.layer.key, False, torch.zeros(moe.w13.shape))


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_activation_checkpointing_gives_the_bits_of_a_plain_step(kernel_on_cpu, reentrant):
    """torch.utils.checkpoint around two layers with residuals (the forwards run again in the backward):
    output, dx and the weight gradients of the plain step, bit for bit."""
    T, H, I, E, k = 64, 64, 64, 8, 2
    g = torch.Generator().manual_seed(21)
    layers = [pounce.MoE(H, I, E, k) for _ in range(2)]
    routings = [random_routing(T, E, k, pattern="zipf", generator=g) for _ in layers]
    x, dy = (torch.randn(T, H, generator=g).bfloat16() for _ in range(2))
    expect_checkpointing_gives_the_plain_bits(layers, routings, x, dy, reentrant)


def test_main_grads_in_one_buffer_with_forwards_in_flight(kernel_on_cpu):
    """Two layers whose main grads are views of one fp32 buffer (as Megatron keeps them), the second one
    called twice, and two micro-batches' forwards before their backwards: each backward adds its weight
    gradients, so the buffer ends as the sum over every call, as separate plain layers' fp32 gradients."""
    T, H, I, E, k = 24, 64, 64, 4, 2
    mains = [pounce.MoE(H, I, E, k, main_grad=True) for _ in range(2)]
    plains = [pounce.MoE(H, I, E, k) for _ in range(2)]
    for m, p in zip(mains, plains):
        p.load_state_dict(m.state_dict())
    weights = [w for m in mains for w in (m.w13, m.w2)]
    buffer = torch.zeros(sum(w.numel() for w in weights))
    offset = 0
    for w in weights:
        w.main_grad = buffer[offset : offset + w.numel()].view(w.shape)
        offset += w.numel()
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randn(T, H, generator=g).bfloat16(), *random_routing(T, E, k, generator=g)) for _ in range(2)]

    def net(layers, x, ids, weights):
        return layers[1](layers[1](layers[0](x, ids, weights), ids, weights), ids, weights)

    ys = [net(mains, *batch) for batch in batches]  # both forwards first, then both backwards
    for y in ys:
        y.float().square().sum().backward()
    want = [torch.zeros(w.shape) for w in weights]
    for batch in batches:
        for p in plains:
            p.w13.grad = p.w2.grad = None
        leaves = [w.detach().float().requires_grad_() for p in plains for w in (p.w13, p.w2)]
        x, ids, weights_ = batch
        h = x
        for layer in (0, 1, 1):
            h = reference_moe(h, ids, weights_, *leaves[2 * layer : 2 * layer + 2]).to(x.dtype)
        h.float().square().sum().backward()
        for total, leaf in zip(want, leaves):
            total += leaf.grad
    assert all(w.grad is None for w in weights)
    for w, total in zip(weights, want):
        assert relative_error(w.main_grad, total) < 2e-2


def test_main_grads_are_left_alone_without_gradients(kernel_on_cpu):
    """Under torch.no_grad no main grads are made; with the experts frozen the backward adds nothing."""
    main, _, x, ids, weights = make_main_grad_module()
    with torch.no_grad():
        main(x, ids, weights)
    assert getattr(main.w13, "main_grad", None) is None
    main.w13.requires_grad_(False)
    main.w2.requires_grad_(False)
    main(x, ids, weights).float().sum().backward()
    assert main.w13.main_grad.abs().sum() == 0 and main.w2.main_grad.abs().sum() == 0
    assert x.grad is not None and weights.grad is not None


def test_main_grads_cannot_be_made_inside_torch_compile(kernel_on_cpu):
    main, _, x, ids, weights = make_main_grad_module()
    compiled = torch.compile(lambda x, ids, w: main(x, ids, w), fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match=re.escape("run one forward outside torch.compile first")):
        compiled(x, ids, weights)


@pytest.mark.parametrize("zero_out_wgrad", [False, True], ids=["placeholder", "zero_out_wgrad"])
@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
def test_main_grads_follow_megatrons_protocol_for_flagged_weights(kernel_on_cpu, checkpointed, zero_out_wgrad):
    """A weight flagged grad_added_to_main_grad (as Megatron's data-parallel wrapper flags them) gets a
    placeholder gradient, so its gradient hook runs, and the flag is set, so the hook does not add the
    placeholder; marked zero_out_wgrad, the placeholder is zeros, which the hook adds. Either way the main
    grad holds the gradient once, also under activation checkpointing (whose saved weights are copies)."""
    main, plain, x, ids, weights = make_main_grad_module()
    hooked = []

    def megatron_like_hook(w):  # what Megatron's backward hook does with overlapped reduction
        assert w.grad is not None, "a weight's gradient must arrive for the hook to run"
        if not w.grad_added_to_main_grad or w.zero_out_wgrad:
            w.main_grad.add_(w.grad)
        w.grad = None
        hooked.append(w)

    for w in (main.w13, main.w2):
        w.grad_added_to_main_grad = False
        w.zero_out_wgrad = zero_out_wgrad
        w.register_post_accumulate_grad_hook(megatron_like_hook)
    if checkpointed:
        y = torch.utils.checkpoint.checkpoint(main, x, ids, weights, use_reentrant=False)
    else:
        y = main(x, ids, weights)
    y.float().square().sum().backward()
    plain(x.detach().requires_grad_(), ids, weights.detach()).float().square().sum().backward()
    assert len(hooked) == 2 and all(w.grad_added_to_main_grad for w in (main.w13, main.w2))
    assert main.w13.grad is None and main.w2.grad is None
    assert relative_error(main.w13.main_grad, plain.w13.grad.float()) < 1e-2
    assert relative_error(main.w2.main_grad, plain.w2.grad.float()) < 1e-2


def test_routing_shaped_unlike_x_is_named(kernel_on_cpu):
    moe, x, ids, weights = make(T=24)
    with pytest.raises(pounce.Error, match=re.escape("topk_ids must be [2, 12, 'k'] or [24, 'k']")):
        moe(x.reshape(2, 12, -1), ids.reshape(12, 2, -1), weights.reshape(2, 12, -1))


def test_leading_dimensions_are_flattened_into_tokens(kernel_on_cpu):
    """x [batch, seq, H] with the routing [batch, seq, k] or [batch * seq, k]: y [batch, seq, H], the
    values and gradients of the flattened call."""
    moe, x, ids, weights = make(T=24)
    y = moe(x, ids, weights)
    y.float().square().sum().backward()
    want_dx = x.grad
    for routing_shape in ((2, 12, -1), (24, -1)):
        x3 = x.detach().reshape(2, 12, -1).requires_grad_()
        y3 = moe(x3, ids.reshape(routing_shape), weights.detach().reshape(routing_shape))
        assert y3.shape == (2, 12, x.shape[1]) and torch.equal(y3.reshape(y.shape), y)
        y3.float().square().sum().backward()
        assert torch.equal(x3.grad.reshape(want_dx.shape), want_dx)


def test_autocast_to_bf16_casts_x_and_takes_the_router_weights_in_fp32(kernel_on_cpu):
    """Under torch.autocast(dtype=torch.bfloat16) an fp32 x (a residual stream kept in fp32) and bf16
    router weights are taken as bf16 and fp32: y is the bf16 call's, and x's gradient arrives in fp32;
    outside autocast the same inputs are rejected by name."""
    moe, x, ids, weights = make()
    want = moe(x, ids, weights)
    x32 = x.detach().float().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = moe(x32, ids, weights.detach().bfloat16())
    assert y.dtype == torch.bfloat16
    assert relative_error(y, want) < 1e-2  # the router weights rounded to bf16 by the caller
    y.float().sum().backward()
    assert x32.grad.dtype == torch.float32
    with pytest.raises(pounce.Error, match="x has dtype torch.float32"):
        moe(x32, ids, weights)

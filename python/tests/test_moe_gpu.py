"""The fused forward and the PyTorch backward on a Hopper GPU against an eager fp32 MoE, through the
module, the function, torch.library.opcheck, torch.compile(fullgraph=True), CUDA graphs and activation
checkpointing; weight gradients accumulated into fp32 main grads; bad inputs and device errors named.
Skipped without a Hopper GPU."""

import pytest
from support import (
    expect_checkpointing_gives_the_plain_bits,
    expect_close,
    expect_matches_reference,
    needs_hopper,
    pounce,
    random_routing,
    reference_moe,
    torch,
)

pytestmark = needs_hopper

# T, H, I, E, k, routing, virtual ranks
CASES = [
    (256, 256, 128, 8, 2, "uniform", None),
    (300, 512, 256, 16, 4, "skewed", None),  # half the experts get no token
    (97, 256, 128, 8, 2, "zero-weights", None),  # a third of the weights exactly 0, token 0 all zero
    (301, 256, 128, 8, 2, "uniform", 2),
    (500, 512, 128, 16, 6, "skewed", 4),
    (1, 128, 64, 4, 4, "uniform", None),  # k = E
]


def case_id(case):
    T, H, I, E, k, routing, P = case
    return f"T{T}_H{H}_I{I}_E{E}_k{k}_{routing}" + (f"_P{P}" if P else "")


def make(case, seed=0):
    T, H, I, E, k, routing, P = case
    g = torch.Generator().manual_seed(seed)
    moe = pounce.MoE(H, I, E, k, virtual_ranks=P, device="cuda")
    with torch.no_grad():  # larger than the default initialisation, so y is well above bf16 noise
        moe.w13.copy_(torch.randn(moe.w13.shape, generator=g) * 0.1)
        moe.w2.copy_(torch.randn(moe.w2.shape, generator=g) * 0.1)
    x = torch.randn(T, H, generator=g).bfloat16().cuda()
    ids, weights = random_routing(T, E, k, pattern=routing, generator=g, device="cuda")
    return moe, x, ids, weights


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_forward_and_gradients_match_the_eager_reference(case):
    moe, x, ids, weights = make(case)
    x.requires_grad_()
    weights.requires_grad_()
    y = moe(x, ids, weights)
    dy = torch.randn_like(y)
    y.backward(dy)
    expect_matches_reference(moe, x, ids, weights, y, dy)
    with torch.no_grad():
        assert torch.equal(moe(x, ids, weights), y), "forwards repeat bitwise"
    if case[5] == "zero-weights":
        assert y[0].abs().sum() == 0
    moe.check_device_errors()


def test_backward_uses_the_kept_forward_and_replays_an_earlier_one():
    """Two micro-batches, forwards first: the backward of the latest forward starts from the rows it kept,
    the other one replays its forward; both match the eager reference."""
    moe, x, ids, weights = make(CASES[1])
    x2 = torch.randn_like(x)
    xs = [t.clone().requires_grad_() for t in (x, x2)]
    ys = [moe(t, ids, weights) for t in xs]
    dys = [torch.randn_like(y) for y in ys]
    ys[1].backward(dys[1])
    assert moe.layer.info()["last_backward_replayed"] is False
    ys[0].backward(dys[0])
    assert moe.layer.info()["last_backward_replayed"] is True
    for t, dy in zip(xs, dys):
        leaf = t.detach().float().requires_grad_()
        reference_moe(leaf, ids, weights, moe.w13.detach(), moe.w2.detach()).backward(dy.float())
        expect_close("dx", t.grad, leaf.grad)


def test_layers_of_one_shape_share_the_backwards_rows():
    """Two MoE layers of one shape, as in a model: both forwards, then both backwards in reverse order;
    they hold one set of the backward's route rows, and each layer's gradients match the eager reference."""
    layers = [make(CASES[1], seed=seed) for seed in (0, 1)]
    inputs, outputs = [], []
    for moe, x, ids, weights in layers:
        x.requires_grad_()
        weights.requires_grad_()
        inputs.append((x, ids, weights))
        outputs.append(moe(x, ids, weights))
    dys = [torch.randn_like(y) for y in outputs]
    for y, dy in reversed(list(zip(outputs, dys))):
        y.backward(dy)
    infos = [moe.layer.info() for moe, *_ in layers]
    assert infos[0]["shared_id"] == infos[1]["shared_id"] and infos[0]["shared_bytes"] > 0
    assert infos[0]["device_bytes"] == infos[1]["device_bytes"] > infos[0]["shared_bytes"]
    for (moe, *_), (x, ids, weights), y, dy in zip(layers, inputs, outputs, dys):
        assert moe.layer.info()["last_backward_replayed"] is False
        expect_matches_reference(moe, x, ids, weights, y, dy)
    other, x, ids, weights = make((CASES[1][0] + 4,) + CASES[1][1:])  # sized for more tokens: another shape
    other(x, ids, weights)
    assert other.layer.info()["shared_id"] != infos[0]["shared_id"]


def fp8_layers(H, I, E, k, virtual_ranks, option, generator):
    """A layer with `option` (its E4M3 weight copies) on random weights, and a bf16 one of the same shape."""
    moe = pounce.MoE(H, I, E, k, virtual_ranks=virtual_ranks, device="cuda", options={option: 1})
    with torch.no_grad():
        moe.w13.copy_(torch.randn(moe.w13.shape, generator=generator) * 0.1)
        moe.w2.copy_(torch.randn(moe.w2.shape, generator=generator) * 0.1)
    return moe, pounce.MoE(H, I, E, k, virtual_ranks=virtual_ranks, device="cuda")


def weight_updates(moe):
    """Three steps for a layer with E4M3 weight copies: the weights as made, after an optimizer-like update
    in place (the tensors' versions bump; stale copies would be 4x off), and after a write the versions do
    not show followed by the explicit refresh. Clears the weights' gradients before each."""
    for step in range(3):
        if step == 1:
            with torch.no_grad():
                moe.w13.mul_(2.0)
                moe.w2.mul_(2.0)
        if step == 2:
            moe.w13.data.mul_(0.5)
            moe.w2.data.mul_(0.5)
            moe.refresh_fp8_weights()
        moe.w13.grad = moe.w2.grad = None
        yield step


@pytest.mark.parametrize("virtual_ranks", [None, 3])
def test_fp8_data_gradients_follow_the_weights_within_fp8_error(virtual_ranks):
    """options={"fp8_data_gradients": 1}: the backward's data gradients in FP8, within FP8's band of the
    eager reference, after the weights change in place (the copies follow the tensors' versions);
    dw2 reads no FP8 operand and matches as tightly as the bf16 layer's."""
    T, H, I, E, k = 200, 256, 128, 12, 4
    g = torch.Generator().manual_seed(3)
    moe, bf16 = fp8_layers(H, I, E, k, virtual_ranks, "fp8_data_gradients", g)
    ids, weights = random_routing(T, E, k, pattern="uniform", generator=g, device="cuda")
    for _ in weight_updates(moe):
        x = torch.randn(T, H, generator=g).bfloat16().cuda().requires_grad_()
        y = moe(x, ids, weights)
        dy = torch.randn_like(y)
        y.backward(dy)
        leaves = [t.detach().float().requires_grad_() for t in (x, moe.w13, moe.w2)]
        reference_moe(leaves[0], ids, weights, leaves[1], leaves[2]).backward(dy.float())
        expect_close("dx", x.grad, leaves[0].grad, tolerance=0.1)
        bf16.load_state_dict(moe.state_dict())
        x_bf16 = x.detach().clone().requires_grad_()
        bf16(x_bf16, ids, weights).backward(dy)
        assert not torch.equal(x.grad, x_bf16.grad), "the data gradients did not run in FP8"
        expect_close("dw13", moe.w13.grad, leaves[1].grad, tolerance=0.1)
        expect_close("dw2", moe.w2.grad, leaves[2].grad)
    moe.check_device_errors()


@pytest.mark.parametrize("virtual_ranks", [1, 3])
def test_fp8_forward_follows_the_weights_within_fp8_error(virtual_ranks):
    """options={"fp8_forward": 1}: the forward in E4M3, within FP8's band of the eager reference and not
    the bf16 layer's bits, after the weights change in place (the copies follow the tensors' versions) and
    after a write the versions do not show (the explicit refresh); its backward runs from the kept rows."""
    T, H, I, E, k = 200, 256, 128, 12, 4
    g = torch.Generator().manual_seed(5)
    moe, bf16 = fp8_layers(H, I, E, k, virtual_ranks, "fp8_forward", g)
    ids, weights = random_routing(T, E, k, pattern="zipf", generator=g, device="cuda")
    for _ in weight_updates(moe):
        x = torch.randn(T, H, generator=g).bfloat16().cuda().requires_grad_()
        y = moe(x, ids, weights)
        leaves = [t.detach().float().requires_grad_() for t in (x, moe.w13, moe.w2)]
        want = reference_moe(leaves[0], ids, weights, leaves[1], leaves[2])
        expect_close("y", y, want, tolerance=0.1)
        bf16.load_state_dict(moe.state_dict())
        assert not torch.equal(y, bf16(x.detach(), ids, weights)), "the forward did not run in FP8"
        dy = torch.randn_like(y)
        y.backward(dy)
        want.backward(dy.float())
        expect_close("dx", x.grad, leaves[0].grad, tolerance=0.1)
        expect_close("dw13", moe.w13.grad, leaves[1].grad, tolerance=0.1)
        expect_close("dw2", moe.w2.grad, leaves[2].grad, tolerance=0.1)
    moe.check_device_errors()


def test_function_form_and_int64_ids_match_the_module():
    moe, x, ids, weights = make(CASES[0])
    y = moe(x, ids, weights)
    assert torch.equal(pounce.moe(x, ids.long(), weights, moe.w13, moe.w2), y)
    assert torch.equal(pounce.moe(x, ids, weights, moe.w13, moe.w2, layer=moe.layer), y)


def test_layer_is_made_on_first_use_and_grows():
    moe, x, ids, weights = make((600, 256, 128, 8, 2, "uniform", 2))
    assert moe.layer.info() is None
    y_small = moe(x[:100], ids[:100], weights[:100])
    assert moe.layer.info()["max_tokens_per_rank"] == 52  # 100 tokens over 2 ranks, a multiple of 4
    y = moe(x, ids, weights)
    info = moe.layer.info()
    assert info["max_tokens_per_rank"] == 300 and info["ranks_on_this_gpu"] == 2 and info["device_bytes"] > 0
    expect_close("y[:100]", y[:100], y_small, 1e-3)  # the same tokens, split over the ranks differently
    expect_close("y", y, reference_moe(x, ids, weights, moe.w13, moe.w2))
    assert moe(x[:0], ids[:0], weights[:0]).shape == (0, 256)


@pytest.mark.parametrize(
    "virtual_ranks, options", [(None, {}), (None, {"fused_backward": 1}), (3, {})], ids=["chain", "fused", "P3"]
)
def test_main_grads_accumulate_micro_batches_in_fp32(virtual_ranks, options):
    """main_grad=True: each backward adds its fp32 weight gradients to w13.main_grad and w2.main_grad. One
    micro-batch's alone round to the bf16 layer's gradients bit for bit; two accumulate to the fp32 sum of
    each one's alone; the weights' .grad stays None; dx and the router weights' gradient are the bf16
    layer's bits."""
    T, H, I, E, k = 300, 256, 128, 12, 4
    g = torch.Generator().manual_seed(11)

    def layer(main_grad):
        return pounce.MoE(H, I, E, k, virtual_ranks=virtual_ranks, device="cuda", main_grad=main_grad, options=options)

    main, plain, alone = layer(True), layer(False), layer(True)
    with torch.no_grad():
        main.w13.copy_(torch.randn(main.w13.shape, generator=g) * 0.1)
        main.w2.copy_(torch.randn(main.w2.shape, generator=g) * 0.1)
    plain.load_state_dict(main.state_dict())
    alone.load_state_dict(main.state_dict())
    each = []
    for step, pattern in enumerate(("skewed", "zipf")):
        x = torch.randn(T, H, generator=g).bfloat16().cuda()
        ids, weights = random_routing(T, E, k, pattern=pattern, generator=g, device="cuda")
        dy = torch.randn(T, H, generator=g).bfloat16().cuda()
        xs = [x.clone().requires_grad_() for _ in range(3)]
        ws = [weights.clone().requires_grad_() for _ in range(3)]
        for w in (alone.w13, alone.w2):
            if getattr(w, "main_grad", None) is not None:
                w.main_grad.zero_()
        plain.w13.grad = plain.w2.grad = None
        for moe, x_, w_ in zip((main, plain, alone), xs, ws):
            moe(x_, ids, w_).backward(dy)
        each.append((alone.w13.main_grad.clone(), alone.w2.main_grad.clone()))
        where = f"step {step}"
        assert torch.equal(xs[0].grad, xs[1].grad) and torch.equal(ws[0].grad, ws[1].grad), where
        assert torch.equal(each[-1][0].bfloat16(), plain.w13.grad), f"{where}: dw13"
        assert torch.equal(each[-1][1].bfloat16(), plain.w2.grad), f"{where}: dw2"
    assert main.w13.grad is None and main.w2.grad is None
    assert torch.equal(main.w13.main_grad, each[0][0] + each[1][0])
    assert torch.equal(main.w2.main_grad, each[0][1] + each[1][1])
    for moe in (main, plain, alone):
        moe.check_device_errors()


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_activation_checkpointing_gives_the_bits_of_a_plain_step(reentrant):
    """torch.utils.checkpoint around two MoE layers with residuals: their forwards run again in the
    backward, and each layer's backward starts from the rows its recomputed forward kept. Output, dx and
    the weight gradients are those of the same step without checkpointing, bit for bit."""
    T, H, I, E, k = 256, 256, 128, 8, 2
    g = torch.Generator().manual_seed(21)
    layers = [pounce.MoE(H, I, E, k, device="cuda") for _ in range(2)]
    with torch.no_grad():
        for moe in layers:
            moe.w13.copy_(torch.randn(moe.w13.shape, generator=g) * 0.1)
            moe.w2.copy_(torch.randn(moe.w2.shape, generator=g) * 0.1)
    routings = [random_routing(T, E, k, pattern="zipf", generator=g, device="cuda") for _ in layers]
    x, dy = (torch.randn(T, H, generator=g).bfloat16().cuda() for _ in range(2))
    expect_checkpointing_gives_the_plain_bits(layers, routings, x, dy, reentrant)
    for moe in layers:
        moe.check_device_errors()


def test_opcheck():
    moe, x, ids, weights = make(CASES[0])
    args = (x.requires_grad_(), ids, weights.requires_grad_(), moe.w13, moe.w2, moe.layer.key)
    torch.library.opcheck(torch.ops.pounce.moe_forward.default, args)
    dy = torch.randn_like(x)
    torch.library.opcheck(torch.ops.pounce.moe_backward.default, (dy,) + tuple(a.detach() for a in args[:5]) + args[5:])


def test_torch_compile_fullgraph():
    moe, x, ids, weights = make(CASES[1])

    def block(x, ids, weights):  # the MoE with some PyTorch around it
        return moe(torch.nn.functional.layer_norm(x, x.shape[1:]), ids, weights * 2) + x

    compiled = torch.compile(block, fullgraph=True)
    x.requires_grad_()
    y = compiled(x, ids, weights)
    y.sum().backward()
    grads = x.grad.clone(), moe.w13.grad.clone()
    x.grad = moe.w13.grad = None
    eager = block(x, ids, weights)
    eager.sum().backward()
    expect_close("y", y, eager, 1e-3)  # the compiled layer norm may round differently
    expect_close("dx", grads[0], x.grad)
    expect_close("dw13", grads[1], moe.w13.grad)


@pytest.mark.parametrize("virtual_ranks", [None, 2])
def test_cuda_graph_capture_and_replay(virtual_ranks):
    case = (256, 256, 128, 8, 2, "uniform", virtual_ranks)
    moe, x, ids, weights = make(case)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(stream):
        moe(x, ids, weights)  # warm-up: makes the layer, which capture cannot
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        y = moe(x, ids, weights)
    for seed in range(1, 4):
        _, new_x, new_ids, new_weights = make(case, seed)
        x.copy_(new_x), ids.copy_(new_ids), weights.copy_(new_weights)
        graph.replay()
        torch.cuda.synchronize()
        moe.check_device_errors()
        with torch.no_grad():
            assert torch.equal(y, moe(x, ids, weights)), f"replay {seed} differs from an eager forward"
        expect_close("y", y, reference_moe(x, ids, weights, moe.w13, moe.w2))


def test_capture_before_the_layer_exists_is_named():
    moe, x, ids, weights = make(CASES[0])
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(pounce.Error, match="cannot happen during CUDA graph capture"):
        with torch.no_grad(), torch.cuda.graph(graph):
            moe(x, ids, weights)


def test_bad_gpu_inputs_are_named():
    moe, x, ids, weights = make(CASES[0])
    misaligned = torch.empty(x.numel() + 1, dtype=torch.bfloat16, device="cuda")[1:].view_as(x)
    with pytest.raises(pounce.Error, match="x at 0x[0-9a-f]+ is not 16-byte aligned"):
        moe(misaligned, ids, weights)
    with pytest.raises(pounce.Error, match="topk_weights is on cpu, expected a CUDA device"):
        moe(x, ids, weights.cpu())
    with pytest.raises(pounce.Error, match="topk_ids is not contiguous"):
        moe(x, ids.t().contiguous().t(), weights)


@pytest.mark.parametrize(
    "bad, needle", [(lambda ids: ids.__setitem__((5, 1), 99), "out of range"), (lambda ids: ids.__setitem__((7, 1), int(ids[7, 0])), "twice")]
)
def test_bad_routing_is_raised_after_the_forward_and_the_layer_recovers(bad, needle):
    moe, x, ids, weights = make(CASES[0])
    good = moe(x, ids, weights)
    broken = ids.clone()
    bad(broken)
    moe(x, broken, weights)  # enqueued; only the GPU sees the ids
    with pytest.raises(pounce.Error, match=needle):
        moe.check_device_errors()
    assert torch.equal(moe(x, ids, weights), good)

    moe(x, broken, weights)  # not collected: the next forward raises it before it runs
    with pytest.raises(pounce.Error, match=needle):
        torch.cuda.synchronize()
        moe(x, ids, weights)
    assert torch.equal(moe(x, ids, weights), good)


def test_capacity_factor_sizes_the_rows_and_a_routing_past_it_is_raised():
    T, H, I, E, k, P = 512, 256, 128, 16, 2, 4
    g = torch.Generator().manual_seed(3)
    x = torch.randn(T, H, generator=g).bfloat16().cuda().requires_grad_()
    ids, weights = random_routing(T, E, k, pattern="uniform", generator=g, device="cuda")
    weights.requires_grad_()
    worst = pounce.MoE(H, I, E, k, virtual_ranks=P, device="cuda")
    moe = pounce.MoE(H, I, E, k, virtual_ranks=P, device="cuda", capacity_factor=2.0)
    with torch.no_grad():
        moe.w13.copy_(torch.randn(moe.w13.shape, generator=g) * 0.1)
        moe.w2.copy_(torch.randn(moe.w2.shape, generator=g) * 0.1)
        worst.w13.copy_(moe.w13)
        worst.w2.copy_(moe.w2)
    # Uniform routing within twice the balanced load: the same bits as the layer sized for the worst case.
    with torch.no_grad():
        y_plain = moe(x, ids, weights)
    y = moe(x, ids, weights)
    dy = torch.randn(y.shape, generator=g).to(y)
    y.backward(dy)
    expect_matches_reference(moe, x, ids, weights, y, dy)
    assert torch.equal(y, worst(x, ids, weights))
    info, worst_info = moe.layer.info(), worst.layer.info()
    assert info["max_routes_per_rank"] == 2 * (T // P) * k and worst_info["max_routes_per_rank"] == 0
    assert info["device_bytes"] < worst_info["device_bytes"]

    # Every token's first choice on expert 0: rank 0 receives T + its share of the rest, past the capacity.
    hot = ids.clone()
    hot[:, 0] = 0
    hot[:, 1] = torch.where(ids[:, 1] == 0, ids[:, 0].clamp(min=1), ids[:, 1])
    with torch.no_grad():
        moe(x, hot, weights)
    with pytest.raises(pounce.Error, match=r"the routing sends rank 0 \d+ routes, more than the 512"):
        moe.check_device_errors()
    with torch.no_grad():
        assert torch.equal(moe(x, ids, weights), y_plain)  # and the layer runs on
    with pytest.raises(pounce.Error, match="capacity_factor"):
        pounce.MoE(H, I, E, k, capacity_factor=0)

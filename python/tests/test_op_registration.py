"""The ops' registration (schema, fake implementation, autograd) under torch.library.opcheck and
torch.compile(fullgraph=True), without a GPU: the fused kernel is replaced by the eager reference and
the CUDA-device check is dropped (on CPU tensors the backward op is the PyTorch one), everything else is
pounce's own. The GPU tests repeat this with the
kernel."""

import pytest
from support import pounce, random_routing, reference_moe, relative_error, torch

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
    monkeypatch.setattr(
        pounce.Layer, "forward", lambda self, x, ids, w, w13, w2, keep=False: reference_moe(x, ids, w, w13, w2).to(x.dtype)
    )


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

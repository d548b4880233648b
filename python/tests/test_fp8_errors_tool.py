"""tools/fp8_errors.py on the CPU: its SwiGLU backward against autograd, its block quantizer (power-of-two
scales, every block within E4M3's range, values on the E4M3 grid), and both studies' ordering of errors
on small layers (bf16 rows near bf16 rounding, E4M3 rows at E4M3's; fp32 scales no worse than powers of
two)."""

import importlib.util
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("fp8_errors", ROOT / "tools" / "fp8_errors.py")
study = importlib.util.module_from_spec(spec)
spec.loader.exec_module(study)


def test_swiglu_backward_matches_autograd():
    g = torch.Generator().manual_seed(1)
    rows, inter = 5, 32
    h13 = torch.randn(rows, 2 * inter, generator=g, dtype=torch.float64, requires_grad=True)
    d_a = torch.randn(rows, inter, generator=g, dtype=torch.float64)
    w = torch.rand(rows, generator=g, dtype=torch.float64)
    pairs = h13.reshape(rows, inter // 8, 2, 8)
    a = torch.nn.functional.silu(pairs[:, :, 0].reshape(rows, -1)) * pairs[:, :, 1].reshape(rows, -1)
    (w[:, None] * d_a * a).sum().backward()
    dots, dgu, wa = study.swiglu_backward(h13.detach(), d_a, w)
    torch.testing.assert_close(dgu, h13.grad)
    torch.testing.assert_close(dots, (d_a * a.detach()).sum(-1))
    torch.testing.assert_close(wa, w[:, None] * a.detach())


def test_block_quantizer_stays_in_range_on_the_e4m3_grid():
    g = torch.Generator().manual_seed(2)
    t = torch.randn(4, 256, generator=g, dtype=torch.float64) * torch.logspace(-3, 3, 4, dtype=torch.float64)[:, None]
    t[1, :128] = 0  # an all-zero block stays zero
    q = study.e4m3_blocks(t, 1, 128)
    blocks, q_blocks = t.reshape(4, 2, 128), q.reshape(4, 2, 128)
    scale = study.power_of_two_scales(blocks.abs().amax(-1, keepdim=True))
    assert torch.equal(torch.log2(scale), torch.log2(scale).round())
    assert (blocks.abs().amax(-1, keepdim=True) <= study.E4M3_MAX * scale).all()
    on_grid = q_blocks / scale
    assert torch.equal(on_grid, on_grid.to(torch.float8_e4m3fn).double())
    assert (q[1, :128] == 0).all()
    assert ((q - t).abs() <= 2.0**-4 * t.abs() + 2.0**-9 * scale.expand(-1, -1, 128).reshape(4, 256)).all()


def test_study_orders_the_errors():
    out = study.kept_rows_study(hidden=256, intermediate=128, experts=4, topk=2, tokens=64, seed=3)
    for name in study.GRADIENTS:
        bf16, e4m3 = out["bf16"][name]["relative_l2"], out["e4m3"][name]["relative_l2"]
        assert 0 < bf16 < 1e-2, (name, bf16)
        assert 5e-3 < e4m3 < 0.1 and e4m3 > 3 * bf16, (name, e4m3, bf16)
    # The E4M3 data gradients leave dW2 alone (dy rows and w a stay bf16 there).
    assert out["bf16 rows, E4M3 data gradients"]["dw2"] == out["bf16"]["dw2"]


def test_scales_study_fp32_scales_are_no_worse():
    out = study.scales_study(hidden=512, intermediate=256, tokens=64, seed=4)
    for what in ("activations", "gemm1"):
        pow2, fp32 = out["power of two"][what], out["fp32"][what]
        assert 1e-2 < fp32 <= pow2 < 0.1, (what, pow2, fp32)

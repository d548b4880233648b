"""pounce.train on the CPU: the data (the standard library's sources as bytes, deterministic), the eager
MoE against the eager fp32 reference (torch._grouped_mm and the per-expert loop), the loss comparison,
and short --tiny runs that write the JSON: the eager MoE alone, and both models with pounce.MoE's forward
replaced by the eager one (pounce itself runs on a Hopper GPU only: the last test, skipped elsewhere)."""

import json
import os
from pathlib import Path

import pytest
from support import needs_hopper, pounce, random_routing, reference_moe, relative_error, torch

from pounce import train


def test_text_is_the_standard_library_as_bytes_in_a_fixed_order():
    files = train.stdlib_sources()
    assert files and all(f.suffix == ".py" and "site-packages" not in f.parts for f in files)
    assert any(f.name == "os.py" and f.parent == Path(os.__file__).parent for f in files)
    train_bytes, val_bytes = train.load_text(0.05)
    again = train.load_text(0.05)
    assert torch.equal(train_bytes, again[0]) and torch.equal(val_bytes, again[1])
    assert train_bytes.dtype == torch.uint8
    whole = b"".join(f.read_bytes() for f in files)
    assert bytes(train_bytes[:10_000].tolist()) == whole[:10_000]
    assert bytes(val_bytes[-10_000:].tolist()) == whole[-10_000:]
    assert len(train_bytes) + len(val_bytes) == len(whole)
    assert abs(len(val_bytes) / len(whole) - 0.05) < 1e-6


def test_batches_are_shifted_windows_repeated_by_the_seed():
    text = torch.arange(1000, dtype=torch.int64) % 256
    first, again = train.training_batches(text, 4, 16, seed=1), train.training_batches(text, 4, 16, seed=1)
    for _ in range(3):
        (inputs, targets), (inputs2, targets2) = next(first), next(again)
        assert inputs.shape == targets.shape == (4, 16) and inputs.dtype == torch.int64
        assert torch.equal(inputs, inputs2) and torch.equal(targets, targets2)
        assert torch.equal(inputs[:, 1:], targets[:, :-1])
        assert torch.equal(targets, (inputs + 1) % 256)  # the text counts up: the next byte follows
    val = train.validation_batches(text.to(torch.uint8), 4, 16, count=3)
    assert len(val) == 3 and torch.equal(val[1][0][0], text[64:80])  # consecutive windows


@pytest.mark.parametrize("grouped_mm", [True, False], ids=["grouped_mm", "loop"])
@pytest.mark.parametrize("pattern", ["uniform", "skewed"])  # skewed: half the experts get no route
def test_eager_moe_matches_the_reference(monkeypatch, grouped_mm, pattern):
    if grouped_mm and not train.has_grouped_mm(torch.device("cpu")):
        pytest.skip("torch._grouped_mm does not run on this PyTorch's CPU")
    monkeypatch.setattr(train, "has_grouped_mm", lambda device: grouped_mm)
    T, H, I, E, k = 50, 64, 32, 8, 3
    g = torch.Generator().manual_seed(0)
    moe = train.EagerMoE(H, I, E, k)
    x = torch.randn(T, H, generator=g).bfloat16().requires_grad_()
    ids, weights = random_routing(T, E, k, pattern=pattern, generator=g)
    weights.requires_grad_()
    y = moe(x, ids, weights)
    dy = torch.randn(T, H, generator=g).bfloat16()
    y.backward(dy)

    leaves = [t.detach().float().requires_grad_() for t in (x, weights, moe.w13, moe.w2)]
    want = reference_moe(leaves[0], ids, *leaves[1:])
    want.backward(dy.float())
    assert y.dtype == torch.bfloat16 and relative_error(y, want) < 1e-2
    for name, got, leaf in zip(("dx", "d_topk_weights", "dw13", "dw2"), (x, weights, moe.w13, moe.w2), leaves):
        assert relative_error(got.grad, leaf.grad) < 1e-2, name


def test_eager_moe_has_pounce_moes_parameters():
    H, I = 128, 64
    eager, fused = train.EagerMoE(H, I, 4, 2), pounce.MoE(H, I, 4, 2)
    assert {n: (t.shape, t.dtype) for n, t in eager.state_dict().items()} == {
        n: (t.shape, t.dtype) for n, t in fused.state_dict().items()
    }
    for weight, fan_in in ((eager.w13, H), (eager.w2, I)):  # nn.Linear's bound, as pounce.MoE's
        assert 0.9 / fan_in**0.5 < weight.float().abs().max() <= 1 / fan_in**0.5


def test_loss_comparison():
    curve = [5.0 - 0.01 * i for i in range(100)]
    same = train.compare_losses(curve, curve, 3.0, 3.0)
    assert same["ok"] and same["max_smoothed_difference"] == 0 and same["final_relative_difference"] == 0
    near = train.compare_losses([v * 1.01 for v in curve], curve, 3.0, 3.0)
    assert near["ok"] and near["final_relative_difference"] == pytest.approx(0.01)
    far = train.compare_losses(curve, curve, 3.2, 3.0)
    assert not far["ok"] and far["band"] == train.LOSS_BAND


def test_flags_become_pounce_moe_options():
    def options(*flags):
        return train.pounce_options(train.parse_args(["--tiny", "--device", "cpu", *flags]))

    assert options() == {"fused_backward": 1}  # the persistent kernel by default
    assert options("--backward", "chain") == {}
    assert options("--fp8-weight-gradients") == {"fused_backward": 1, "fp8_weight_gradients": 1}
    assert options("--no-keep-x-rows") == {"fused_backward": 1, "keep_x_rows": 0}
    # The E4M3 forward and FP8 data gradients run with the chain only: it becomes the default there ...
    assert options("--fp8-forward", "--fp8-data-gradients") == {"fp8_forward": 1, "fp8_data_gradients": 1}
    # ... and asking for both is passed on, for pounce.MoE to refuse by name.
    assert options("--fp8-data-gradients", "--backward", "fused") == {"fused_backward": 1, "fp8_data_gradients": 1}
    assert train.parse_args(["--tiny", "--device", "cpu"]).backward == "fused"


TINY_CPU = ["--tiny", "--device", "cpu", "--steps", "3", "--warmup-steps", "1"]


def test_tiny_run_on_the_cpu_writes_the_report(tmp_path):
    assert train.main(TINY_CPU + ["--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "train.json").read_text())
    assert list(report["models"]) == ["eager"]  # pounce needs a Hopper GPU
    eager = report["models"]["eager"]
    assert len(eager["loss"]) == 4 and all(0 < loss < 6 for loss in eager["loss"])
    assert 0 < eager["validation_loss"] < 6 and eager["tokens_per_s"] > 0
    assert report["config"]["hidden"] == train.TINY["hidden"] and report["tokens_per_step"] == 8 * 64


def test_tiny_run_of_both_models_with_a_stand_in_for_pounce(monkeypatch, tmp_path):
    """The comparison's path on the CPU: pounce.MoE computes with EagerMoE's forward, so the two models
    train alike to the bit, and everything around them (one initial state, steps taken in turns, the
    report, the layers alone) runs as on a GPU."""
    monkeypatch.setattr(pounce.MoE, "forward", train.EagerMoE.forward)
    monkeypatch.setattr(train, "pounce_unavailable", lambda device: None)
    monkeypatch.setattr(pounce._lib, "library", lambda: None)
    assert train.main(TINY_CPU + ["--moe-warmup", "1", "--moe-reps", "2", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "train.json").read_text())
    eager, fused = report["models"]["eager"], report["models"]["pounce"]
    assert eager["loss"] == fused["loss"] and eager["validation_loss"] == fused["validation_loss"]
    assert report["loss_agreement"]["ok"] and report["loss_agreement"]["max_smoothed_difference"] == 0
    assert report["step_speedup"] > 0 and report["moe_alone"]["ok"] and report["moe_alone"]["tokens"] == 8 * 64
    assert all(error == 0 for error in report["moe_alone"]["relative_l2_pounce_vs_eager"].values())


@needs_hopper
def test_tiny_run_on_hopper_trains_pounce_like_the_eager_moe(tmp_path):
    status = train.main(["--tiny", "--steps", "20", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "train.json").read_text())
    assert list(report["models"]) == ["eager", "pounce"]
    assert report["moe_alone"]["ok"], report["moe_alone"]["relative_l2_pounce_vs_eager"]
    assert report["loss_agreement"]["ok"], report["loss_agreement"]
    assert all(m["memory"]["peak_bytes"] > 0 for m in report["models"].values())
    assert report["models"]["pounce"]["memory"]["pounce_layer_bytes"] > 0
    assert status == 0

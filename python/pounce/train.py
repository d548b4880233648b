"""Trains a small byte-level MoE language model twice from the same weights on the same batches: once with
pounce's fused layer (pounce.MoE) as its experts, once with an eager PyTorch MoE written the way users
write one (argsort permute, torch._grouped_mm, SwiGLU, weighted index_add_). Reports both loss curves
(which must agree), the step time, tokens/s and peak memory of each, and the MoE layers alone.

    python -m pounce.train           # one Hopper GPU: both models, results in results/train/
    python -m pounce.train --tiny    # a quick check; without a GPU: on the CPU, the eager MoE only

The text is the Python standard library's own .py files, read as bytes: real text on every machine,
without downloads. `python -m pounce.train --help` lists the options.
"""

import argparse
import contextlib
import functools
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import pounce

VOCAB = 256  # bytes

# --tiny: seconds on a CPU. Hidden and intermediate stay multiples of 64, so pounce can run it on a GPU too.
TINY = dict(layers=2, hidden=64, heads=4, experts=8, topk=2, intermediate=64, seq=64, batch=8, steps=20,
            warmup_steps=2, val_batches=2)

# The band the final losses of the two models must agree within (relative). Both start from the same
# bf16 weights and see the same batches; they differ only in rounding: the GEMMs sum in other orders
# (fp32 accumulators, outputs rounded to bf16, whose unit roundoff is 2^-8 = 0.4%), pounce's backward
# starts from the gate/up rows its forward kept in bf16, the eager MoE adds routes back with atomics. That is ~1e-3 relative per
# step and it does not die out: AdamW normalizes every update, and a route whose top-k scores are nearly
# tied flips to another expert, so the two runs drift apart as runs from nearby seeds do. The loss survives
# the drift: it is a mean over 10^4 to 10^5 tokens of how well the model fits the text, and runs of one
# model and data order from different seeds typically end a short run within about 1% of each other;
# identical starts are closer still. A defect costs more: a wrong gradient, or routes dropped or sent to
# the wrong expert, slows learning by several percent within tens of steps. 2% lies between the two.
LOSS_BAND = 0.02

# The MoE layers alone: pounce's and the eager outputs and gradients on the same inputs must agree to
# this relative L2 error. Each is bf16 with fp32 accumulation: rounding to bf16 alone is up to 2^-8 per
# element, ~2e-3 relative L2, and the package's GPU tests hold pounce to 1e-2 against fp32. 2e-2 covers two
# such errors with room, and is still far below what a wrong route or gradient gives (order 1).
MOE_TOLERANCE = 2e-2
# With --fp8-data-gradients, the gradients that pass through an FP8 GEMM (dx, the router weights' and
# dW13; with --fp8-weight-gradients dW13 and dW2): E4M3 keeps 3 mantissa bits, so each quantized operand
# carries up to 2^-4 relative error per element, a few percent in norm (the package's tests measure ~5%
# on dx); the others keep MOE_TOLERANCE.
FP8_MOE_TOLERANCE = 0.1
FP8_GRADIENTS = ("dx", "d_topk_weights", "dw13")


# ---- data ------------------------------------------------------------------------------------------------


def stdlib_sources() -> list:
    """The standard library's .py files (the folder of os.py, without installed packages), in sorted order
    of their paths below it: the same list, in the same order, every time on one machine."""
    root = Path(os.path.dirname(os.__file__))
    files = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [s for s in subfolders if s not in ("site-packages", "dist-packages", "__pycache__")]
        files += [Path(folder, name) for name in names if name.endswith(".py")]
    return sorted(files, key=lambda path: path.relative_to(root).as_posix())


def load_text(val_fraction: float):
    """(train, validation): the sources concatenated as bytes, uint8 tensors (one byte, one token); the
    last val_fraction of the bytes is held out."""
    data = b"".join(path.read_bytes() for path in stdlib_sources())
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    split = int(len(tokens) * (1 - val_fraction))
    return tokens[:split], tokens[split:]


def training_batches(tokens: Tensor, batch: int, seq: int, seed: int):
    """Endless (inputs, targets) [batch, seq] int64: windows at random offsets, the targets shifted by one.
    The same seed gives the same batches."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(len(tokens) - seq, (batch, 1), generator=generator)
        windows = tokens[starts + torch.arange(seq + 1)].long()
        yield windows[:, :-1], windows[:, 1:]


def validation_batches(tokens: Tensor, batch: int, seq: int, count: int) -> list:
    """Up to count batches of consecutive windows from the start of the validation text."""
    windows = tokens.unfold(0, seq + 1, seq)[: count * batch].long()
    return [(w[:, :-1], w[:, 1:]) for w in windows.split(batch)]


# ---- the eager MoE ---------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def has_grouped_mm(device: torch.device) -> bool:
    """Whether torch._grouped_mm runs on this device (it needs a recent PyTorch, and a recent GPU)."""
    try:
        a = torch.ones(16, 16, dtype=torch.bfloat16, device=device)
        torch._grouped_mm(a, a.view(1, 16, 16), offs=torch.tensor([16], dtype=torch.int32, device=device))
        return True
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def grouped_linear(rows: Tensor, weight: Tensor, ends: Tensor) -> Tensor:
    """rows [R, K], grouped by expert (expert e's rows end at ends[e], int32), times weight[e].T for
    weight [E, N, K]: [R, N]."""
    if has_grouped_mm(rows.device):
        return torch._grouped_mm(rows, weight.transpose(1, 2), offs=ends)
    # Without _grouped_mm: one matmul per expert (the loop needs the offsets on the host).
    bounds = [0] + ends.tolist()
    return torch.cat([rows[bounds[e] : bounds[e + 1]] @ weight[e].T for e in range(weight.shape[0])])


class EagerMoE(nn.Module):
    """The routed experts as PyTorch users write them: permute the routes by expert (argsort), the gate/up
    and down GEMMs of all experts with torch._grouped_mm (a per-expert loop where it is missing), SwiGLU,
    and the weighted sum back into each token's row with index_add_.

    The parameters, their layout and initialisation are pounce.MoE's: w13 [E, 2I, H] (gate and up rows
    interleaved in groups of 8) and w2 [E, H, I], bf16; so both load the same state dict. The constructor
    is pounce.MoE's too (topk is not needed here).
    forward(x [T, H], topk_ids [T, k], topk_weights [T, k] fp32) -> [T, H] in x's dtype."""

    def __init__(self, hidden: int, intermediate: int, experts: int, topk: int):
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(experts, 2 * intermediate, hidden, dtype=torch.bfloat16))
        self.w2 = nn.Parameter(torch.empty(experts, hidden, intermediate, dtype=torch.bfloat16))
        with torch.no_grad():
            self.w13.uniform_(-1 / math.sqrt(hidden), 1 / math.sqrt(hidden))
            self.w2.uniform_(-1 / math.sqrt(intermediate), 1 / math.sqrt(intermediate))

    def forward(self, x: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> Tensor:
        T, k = topk_ids.shape
        E, I, H = self.w2.shape[0], self.w2.shape[2], self.w2.shape[1]
        experts = topk_ids.reshape(-1)
        order = torch.argsort(experts, stable=True)  # the routes, grouped by expert
        token = order // k  # each sorted route's token
        # Each expert's last row + 1, computed on the GPU. histc rather than bincount: bincount reads the
        # largest id on the host to size its output, a synchronization in every layer.
        counts = torch.histc(experts.float(), bins=E, min=0, max=E)
        ends = torch.cumsum(counts, 0, dtype=torch.int32)
        gate_up = grouped_linear(x[token], self.w13, ends)
        gate, up = gate_up.view(-1, I // 8, 2, 8).unbind(2)  # w13's interleaved rows, as columns here
        out = grouped_linear((F.silu(gate) * up).reshape(-1, I), self.w2, ends)
        # The weighted sum in fp32, as pounce sums: the comparison is then of implementations, not precisions.
        y = torch.zeros(T, H, dtype=torch.float32, device=x.device)
        y.index_add_(0, token, out * topk_weights.reshape(-1)[order, None])
        return y.to(x.dtype)


# ---- the model -------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:  # in fp32: a bf16 mean of squares loses precision
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.out = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        B, S, H = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.heads, H // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(B, S, H))


def balance_loss(logits: Tensor, topk_ids: Tensor) -> Tensor:
    """The Switch Transformer's load-balancing loss, E * sum_e (share of routes to e) * (mean router
    probability of e): 1 when the routes spread evenly. The counts by histc: no host synchronization."""
    E = logits.shape[1]
    share = torch.histc(topk_ids.float(), bins=E, min=0, max=E) / topk_ids.numel()
    return E * (share * logits.softmax(-1).mean(0)).sum()


class MoEFeedForward(nn.Module):
    """Router (fp32 logits), pounce.route (softmax, normalized top-k), then the experts: pounce.MoE or
    EagerMoE, which have the same parameters."""

    def __init__(self, hidden: int, intermediate: int, experts: int, topk: int, moe: str, options=None):
        super().__init__()
        self.topk = topk
        self.router = nn.Linear(hidden, experts, bias=False)
        if moe == "pounce":
            self.experts = pounce.MoE(hidden, intermediate, experts, topk, options=options)
        else:
            self.experts = EagerMoE(hidden, intermediate, experts, topk)

    def forward(self, x: Tensor):
        """x [T, H] -> (y [T, H], load-balancing loss)."""
        logits = F.linear(x.float(), self.router.weight.float())
        topk_ids, topk_weights = pounce.route(logits, self.topk)
        return self.experts(x, topk_ids, topk_weights), balance_loss(logits, topk_ids)


class Block(nn.Module):
    def __init__(self, args, moe: str):
        super().__init__()
        self.attention_norm = RMSNorm(args.hidden)
        self.attention = Attention(args.hidden, args.heads)
        self.ffn_norm = RMSNorm(args.hidden)
        self.ffn = MoEFeedForward(args.hidden, args.intermediate, args.experts, args.topk, moe, pounce_options(args))

    def forward(self, x: Tensor):
        x = x + self.attention(self.attention_norm(x))
        y, balance = self.ffn(self.ffn_norm(x).view(-1, x.shape[-1]))
        return x + y.view_as(x), balance


class LanguageModel(nn.Module):
    """A decoder-only byte-level language model: token and learned position embeddings, blocks of
    [RMSNorm, causal self-attention, RMSNorm, MoE feed-forward], a final RMSNorm and an untied head.
    moe: "pounce" (pounce.MoE) or "eager" (EagerMoE); the parameters are the same either way."""

    def __init__(self, args, moe: str):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, args.hidden)
        self.position = nn.Embedding(args.seq, args.hidden)
        self.blocks = nn.ModuleList(Block(args, moe) for _ in range(args.layers))
        self.norm = RMSNorm(args.hidden)
        self.head = nn.Linear(args.hidden, VOCAB, bias=False)

    def forward(self, tokens: Tensor):
        """tokens [B, S] -> (logits [B, S, VOCAB], the load-balancing losses summed over the layers)."""
        x = self.embed(tokens) + self.position.weight[: tokens.shape[1]]
        balance = 0
        for block in self.blocks:
            x, layer_balance = block(x)
            balance = balance + layer_balance
        return self.head(self.norm(x)), balance


def build_models(args, moes: list, device: torch.device) -> dict:
    """One model per MoE implementation, all with the same weights: the first is initialised from the seed
    (on the CPU, so the weights do not depend on the device), the others load its state."""
    models = {}
    for moe in moes:
        torch.manual_seed(args.seed)
        model = LanguageModel(args, moe)
        if models:
            model.load_state_dict(next(iter(models.values())).state_dict())
        models[moe] = model.to(device=device, dtype=torch.bfloat16)
    return models


# ---- training --------------------------------------------------------------------------------------------


def train_step(model, optimizer, inputs: Tensor, targets: Tensor, balance_weight: float) -> Tensor:
    """One AdamW step; returns the language-model loss (fp32, without the balancing term)."""
    logits, balance = model(inputs)
    loss = F.cross_entropy(logits.float().view(-1, VOCAB), targets.reshape(-1))
    (loss + balance_weight * balance).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


@torch.no_grad()
def validation_loss(model, batches: list, device: torch.device) -> float:
    """Mean cross-entropy over every token of the validation batches."""
    total, count = 0.0, 0
    for inputs, targets in batches:
        logits, _ = model(inputs.to(device))
        total += F.cross_entropy(logits.float().view(-1, VOCAB), targets.to(device).reshape(-1), reduction="sum").item()
        count += targets.numel()
    return total / count


class Timer:
    """Times code blocks in milliseconds: CUDA events on a GPU (read after the run), else the wall clock."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks = []

    @contextlib.contextmanager
    def __call__(self):
        if self.cuda:
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            stop.record()
            self.marks.append((start, stop))
        else:
            start = time.perf_counter()
            yield
            self.marks.append(1e3 * (time.perf_counter() - start))

    def milliseconds(self) -> list:
        if self.cuda:
            torch.cuda.synchronize()
            return [start.elapsed_time(stop) for start, stop in self.marks]
        return list(self.marks)


class Progress:
    """A tqdm bar when tqdm is installed, else a line every tenth of the run."""

    def __init__(self, total: int):
        try:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="step")
        except ImportError:
            self.bar = None
        self.total, self.done = total, 0

    def update(self, losses: dict) -> None:
        self.done += 1
        text = ", ".join(f"{name} {loss:.3f}" for name, loss in losses.items())
        if self.bar is not None:
            self.bar.set_postfix_str(text)
            self.bar.update()
        elif self.done % max(1, self.total // 10) == 0 or self.done == self.total:
            print(f"step {self.done}/{self.total}: loss {text}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def step_memory(model, optimizer, inputs, targets, balance_weight) -> dict:
    """Peak memory of one training step of this model alone, in bytes. The other model's tensors stay
    allocated, so the peak is taken over what was allocated before the step, and this model's own
    parameters and optimizer state are added back. pounce's layers allocate their buffers outside PyTorch's
    allocator: counted from the layers themselves."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    train_step(model, optimizer, inputs, targets, balance_weight)
    torch.cuda.synchronize()
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    resident = tensor_bytes(model.parameters()) + tensor_bytes(state)
    # Each layer's own buffers, and once each set of buffers that layers share.
    infos = [m.layer.info() for m in model.modules() if isinstance(m, pounce.MoE)]
    shared = {info["shared_id"]: info["shared_bytes"] for info in infos}
    layers = sum(info["device_bytes"] - info["shared_bytes"] for info in infos) + sum(shared.values())
    pytorch = resident + torch.cuda.max_memory_allocated() - before
    return {"peak_bytes": pytorch + layers, "pytorch_peak_bytes": pytorch, "pounce_layer_bytes": layers,
            "parameters_and_optimizer_bytes": resident}


def time_moe_alone(args, device: torch.device) -> dict:
    """pounce.MoE and EagerMoE on the model's MoE shape (batch x seq tokens) with the same weights and
    inputs (router logits drawn at random): forward + backward (gradients of x, the router weights, w13
    and w2), median of interleaved repetitions after warm-up. Also how far their outputs and gradients
    are apart."""
    H, I, E, k, T = args.hidden, args.intermediate, args.experts, args.topk, args.batch * args.seq
    torch.manual_seed(args.seed)
    eager = EagerMoE(H, I, E, k).to(device)
    fused = pounce.MoE(H, I, E, k, device=device, options=pounce_options(args))
    fused.load_state_dict(eager.state_dict())
    x = torch.randn(T, H, dtype=torch.bfloat16, device=device, requires_grad=True)
    topk_ids, topk_weights = pounce.route(torch.randn(T, E, device=device), k)
    topk_weights.requires_grad_()
    dy = torch.randn(T, H, dtype=torch.bfloat16, device=device)

    def forward_backward(moe):
        y = moe(x, topk_ids, topk_weights)
        return (y,) + torch.autograd.grad(y, (x, topk_weights, moe.w13, moe.w2), dy)

    names = ("y", "dx", "d_topk_weights", "dw13", "dw2")
    errors = {
        name: ((got.double() - want.double()).norm() / want.double().norm()).item()
        for name, got, want in zip(names, forward_backward(fused), forward_backward(eager))
    }
    # Back to back, without synchronizing: the events time the GPU's work.
    timers = {"pounce": Timer(device), "eager": Timer(device)}
    for rep in range(args.moe_warmup + args.moe_reps):
        for name, moe in (("pounce", fused), ("eager", eager)):
            with timers[name]() if rep >= args.moe_warmup else contextlib.nullcontext():
                forward_backward(moe)
    fused.check_device_errors()
    ms = {name: statistics.median(timer.milliseconds()) for name, timer in timers.items()}
    fp8 = set(names if args.fp8_forward else ())  # the E4M3 forward's rounding reaches every output
    fp8 |= set(FP8_GRADIENTS if args.fp8_data_gradients else ())
    fp8 |= {"dw13", "dw2"} if args.fp8_weight_gradients else set()
    tolerance = {name: FP8_MOE_TOLERANCE if name in fp8 else MOE_TOLERANCE for name in names}
    return {"tokens": T, "pounce_ms": ms["pounce"], "eager_ms": ms["eager"], "speedup": ms["eager"] / ms["pounce"],
            "relative_l2_pounce_vs_eager": errors, "tolerance": tolerance,
            "ok": all(errors[name] <= tolerance[name] for name in names)}


# ---- the comparison and the report -----------------------------------------------------------------------


def smooth(values: list, window: int = 10) -> list:
    """Trailing mean over up to `window` values."""
    return [statistics.fmean(values[max(0, i + 1 - window) : i + 1]) for i in range(len(values))]


def compare_losses(a: list, b: list, val_a: float, val_b: float, band: float = LOSS_BAND) -> dict:
    """How far two loss curves are apart: the largest difference of the smoothed curves, and the relative
    difference of the final losses (the smoothed training loss at the last step, and the validation loss),
    which must lie within band."""
    sa, sb = smooth(a), smooth(b)
    final = max(abs(sa[-1] - sb[-1]) / sb[-1], abs(val_a - val_b) / val_b)
    return {"max_smoothed_difference": max(abs(x - y) for x, y in zip(sa, sb)),
            "final_relative_difference": final, "band": band, "ok": final <= band}


def git_commit() -> str:
    if os.environ.get("POUNCE_COMMIT"):
        return os.environ["POUNCE_COMMIT"]
    try:
        run = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True)
    except OSError:
        return "unknown"
    return run.stdout.strip() if run.returncode == 0 else "unknown"


def plot(curves: dict, path: Path) -> bool:
    """Both loss curves and their smoothed versions as a PNG; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, axes = plt.subplots(figsize=(8, 5))
    for name, losses in curves.items():
        line, = axes.plot(losses, alpha=0.3, linewidth=0.8)
        axes.plot(smooth(losses), color=line.get_color(), label=f"{name} (mean of 10 steps)")
    axes.set_xlabel("step")
    axes.set_ylabel("training loss (nats per byte)")
    axes.set_title("byte-level MoE language model on the Python standard library")
    axes.legend()
    figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(figure)
    return True


def print_table(report: dict) -> None:
    models = report["models"]
    names = list(models)
    rows = [
        ("step time, median (ms)", lambda m: f"{m['step_ms_median']:.2f}"),
        ("tokens/s", lambda m: f"{m['tokens_per_s']:,.0f}"),
        ("peak memory (GiB)", lambda m: "-" if m["memory"] is None else f"{m['memory']['peak_bytes'] / 2**30:.2f}"),
        ("final training loss (mean of 10)", lambda m: f"{smooth(m['loss'])[-1]:.4f}"),
        ("validation loss", lambda m: f"{m['validation_loss']:.4f}"),
    ]
    print()
    print(f"{'':34s}" + "".join(f"{name:>14s}" for name in names))
    for label, cell in rows:
        print(f"{label:34s}" + "".join(f"{cell(models[name]):>14s}" for name in names))
    layers = [m["memory"]["pounce_layer_bytes"] for m in models.values() if m["memory"]]
    if any(layers):
        print(f"(peak memory: one step of each model alone, with its parameters and optimizer state; pounce's "
              f"includes its layers' own buffers, {max(layers) / 2**30:.2f} GiB, allocated outside PyTorch)")
    if "step_speedup" in report:
        print(f"\nwhole training step: pounce {report['step_speedup']:.2f}x the eager MoE's speed")
    alone = report.get("moe_alone")
    if alone:
        errors, tolerance = alone["relative_l2_pounce_vs_eager"], alone["tolerance"]
        worst = max(errors, key=lambda name: errors[name] / tolerance[name])
        print(f"MoE layer alone, forward + backward on {alone['tokens']} tokens: pounce {alone['pounce_ms']:.3f} ms, "
              f"eager {alone['eager_ms']:.3f} ms ({alone['speedup']:.2f}x); outputs and gradients "
              f"{'within' if alone['ok'] else 'ABOVE'} their tolerances (closest: {worst} "
              f"{errors[worst]:.1e} relative L2 against {tolerance[worst]:.0e})")
    agreement = report.get("loss_agreement")
    if agreement:
        print(f"loss curves: largest difference of the smoothed curves {agreement['max_smoothed_difference']:.4f}; "
              f"final losses {100 * agreement['final_relative_difference']:.2f}% apart "
              f"({'within' if agreement['ok'] else 'OUTSIDE'} the {100 * agreement['band']:.0f}% band)")


# ---- main ------------------------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pounce.train", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--tiny", action="store_true", help=f"a small model and run for quick checks: {TINY}")
    p.add_argument("--moe", choices=("both", "pounce", "eager"), default="both", help="the MoE implementation(s)")
    p.add_argument("--device", help="default: cuda when a GPU is present, else the CPU with --tiny")
    p.add_argument("--layers", type=int, default=4, help="decoder blocks")
    p.add_argument("--hidden", type=int, default=1024, help="the model's width")
    p.add_argument("--heads", type=int, default=16, help="attention heads")
    p.add_argument("--experts", type=int, default=32, help="experts per MoE layer")
    p.add_argument("--topk", type=int, default=8, help="experts per token")
    p.add_argument("--intermediate", type=int, default=512, help="each expert's intermediate size")
    p.add_argument("--seq", type=int, default=512, help="sequence length")
    p.add_argument("--batch", type=int, default=32, help="sequences per step")
    p.add_argument("--steps", type=int, default=150, help="timed steps")
    p.add_argument("--warmup-steps", type=int, default=10, help="training steps before the timed ones")
    p.add_argument("--lr", type=float, default=6e-4, help="AdamW's learning rate, after a linear ramp")
    p.add_argument("--lr-ramp", type=int, default=10, help="steps of the learning rate's linear ramp")
    p.add_argument("--balance-weight", type=float, default=0.01, help="weight of the load-balancing loss")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights and of the batches")
    p.add_argument("--val-fraction", type=float, default=0.03, help="share of the text held out")
    p.add_argument("--val-batches", type=int, default=8, help="batches of validation windows")
    p.add_argument("--moe-warmup", type=int, default=5, help="warm-up repetitions of the MoE layers alone")
    p.add_argument("--moe-reps", type=int, default=30, help="timed repetitions of the MoE layers alone")
    p.add_argument("--backward", choices=("fused", "chain"),
                   help="pounce's backward from the rows its forward kept: one persistent kernel "
                        "(FusedMoeOptions::fused_backward) or the chain of kernels; default: fused, the chain "
                        "with --fp8-forward or --fp8-data-gradients (which run only there)")
    p.add_argument("--fp8-forward", action="store_true",
                   help="the fused forward in E4M3 (FusedMoeOptions::fp8_forward)")
    p.add_argument("--fp8-data-gradients", action="store_true",
                   help="the backward's data-gradient GEMMs in FP8 (FusedMoeOptions::fp8_data_gradients)")
    p.add_argument("--fp8-weight-gradients", action="store_true",
                   help="the backward's weight-gradient GEMMs in FP8 (FusedMoeOptions::fp8_weight_gradients)")
    p.add_argument("--no-keep-x-rows", action="store_true",
                   help="training forwards keep only their gate/up rows; the backward copies the x rows again "
                        "(FusedMoeOptions::keep_x_rows = false: less memory per layer)")
    p.add_argument("--out", default="results/train", help="folder for train.json and loss.png")
    return p


def backward_kind(args) -> str:
    """"fused" or "chain": --backward, else the persistent kernel unless an FP8 option needs the chain."""
    if args.backward:
        return args.backward
    return "chain" if args.fp8_forward or args.fp8_data_gradients else "fused"


def pounce_options(args) -> dict:
    """pounce.MoE's options for this run: the fused backward kernel (by default), the E4M3 forward, FP8
    gradients, x rows not kept, when asked for."""
    options = {}
    if backward_kind(args) == "fused":
        options["fused_backward"] = 1
    if args.fp8_forward:
        options["fp8_forward"] = 1
    if args.fp8_data_gradients:
        options["fp8_data_gradients"] = 1
    if args.fp8_weight_gradients:
        options["fp8_weight_gradients"] = 1
    if args.no_keep_x_rows:
        options["keep_x_rows"] = 0
    return options


def parse_args(argv=None):
    """The options; --tiny (or no GPU) changes the defaults, options given explicitly still win."""
    p = parser()
    args = p.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.device is None and device == "cpu":
        print("no CUDA GPU here: running --tiny on the CPU")
        args.tiny = True
    if args.tiny:
        p.set_defaults(**TINY)
        args = p.parse_args(argv)
        args.tiny = True
    args.device = device
    args.backward = backward_kind(args)
    return args


def pounce_unavailable(device: torch.device):
    """Why pounce cannot run on this device, or None."""
    if device.type != "cuda":
        return f"pounce needs a Hopper GPU (the device is {device})"
    if torch.cuda.get_device_capability(device) != (9, 0):
        return f"pounce needs a Hopper GPU (sm_90), this is {torch.cuda.get_device_name(device)}"
    return None


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def train(args, models: dict, text: Tensor, device: torch.device):
    """Trains the models side by side with AdamW. Returns, per model, the loss curve and the times of the
    timed steps (ms) and the optimizer; and the last batch."""
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=args.lr, betas=(0.9, 0.95)) for name, m in models.items()}
    timers = {name: Timer(device) for name in models}
    losses = {name: [] for name in models}
    # The models take turns, step by step, on the same batches, the first one first on even steps and last
    # on odd ones: changes of the GPU's clocks hit both alike. Every step ends by reading its loss (as a
    # loop that logs each step does), so each starts on an idle GPU and both pay the same launch latency.
    total = args.warmup_steps + args.steps
    batches = training_batches(text, args.batch, args.seq, args.seed)
    progress = Progress(total)
    for step in range(total):
        inputs, targets = (t.to(device) for t in next(batches))
        for name, model in list(models.items())[:: 1 if step % 2 == 0 else -1]:
            for group in optimizers[name].param_groups:
                group["lr"] = args.lr * min(1.0, (step + 1) / args.lr_ramp)
            with timers[name]() if step >= args.warmup_steps else contextlib.nullcontext():
                loss = train_step(model, optimizers[name], inputs, targets, args.balance_weight)
            losses[name].append(loss.item())
        progress.update({name: curve[-1] for name, curve in losses.items()})
    progress.close()
    return losses, {name: timer.milliseconds() for name, timer in timers.items()}, optimizers, (inputs, targets)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    moes = ["eager", "pounce"] if args.moe == "both" else [args.moe]
    reason = pounce_unavailable(device)
    if reason and "pounce" in moes:
        if args.moe == "pounce":
            print(f"error: {reason}", file=sys.stderr)
            return 2
        print(f"{reason}: the eager MoE only")
        moes = ["eager"]
    if "pounce" in moes:
        pounce._lib.library()  # a missing or mismatched libpounce.so is named now, not after the eager steps

    train_text, val_text = load_text(args.val_fraction)
    print(f"text: {len(train_text) + len(val_text):,} bytes of the Python standard library "
          f"({len(val_text):,} held out); device: {device_name(device)}")
    models = build_models(args, moes, device)
    parameters = sum(p.numel() for p in next(iter(models.values())).parameters())
    print(f"model: {args.layers} layers, hidden {args.hidden}, {args.experts} experts (top-{args.topk}, "
          f"intermediate {args.intermediate}), {parameters / 1e6:.1f}M parameters; "
          f"{args.batch} x {args.seq} tokens per step; pounce's backward: {args.backward}")
    losses, step_ms, optimizers, last_batch = train(args, models, train_text, device)

    val = validation_batches(val_text, args.batch, args.seq, args.val_batches)
    tokens = args.batch * args.seq
    report = {"config": vars(args), "gpu": device_name(device) if device.type == "cuda" else None,
              "torch": torch.__version__, "git_commit": git_commit(), "tokens_per_step": tokens,
              "validation_tokens": sum(t.numel() for _, t in val), "models": {}}
    for name, model in models.items():
        ms = statistics.median(step_ms[name])
        report["models"][name] = {"loss": losses[name], "validation_loss": validation_loss(model, val, device),
                                  "step_ms_median": ms, "tokens_per_s": tokens / (ms / 1e3), "memory": None}
    if device.type == "cuda":  # one more step per model, after its training and validation
        for name, model in models.items():
            report["models"][name]["memory"] = step_memory(model, optimizers[name], *last_batch, args.balance_weight)
    ok = True
    if len(models) == 2:
        eager, fused = report["models"]["eager"], report["models"]["pounce"]
        report["step_speedup"] = eager["step_ms_median"] / fused["step_ms_median"]
        report["loss_agreement"] = compare_losses(
            fused["loss"], eager["loss"], fused["validation_loss"], eager["validation_loss"]
        )
        report["moe_alone"] = time_moe_alone(args, device)
        ok = report["loss_agreement"]["ok"] and report["moe_alone"]["ok"]

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train.json").write_text(json.dumps(report, indent=2) + "\n")
    plotted = plot({name: m["loss"] for name, m in report["models"].items()}, out / "loss.png")
    print_table(report)
    print(f"\nwrote {out / 'train.json'}" + (f" and {out / 'loss.png'}" if plotted else " (no plot: no matplotlib)"))
    if not ok:
        print("FAILED: pounce and the eager MoE disagree beyond the stated tolerances", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

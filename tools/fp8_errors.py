#!/usr/bin/env python3
"""FP8 choices that are not built, measured on the CPU in fp64 before building them.

kept-rows: what keeping the training forward's gate/up rows in E4M3 would cost the backward. A training
forward keeps each route's pre-SwiGLU gate/up row (2I values) for the backward, in bf16 today. Kept in
E4M3 with a power-of-two scale per 128 values (the 1 x 128 blocks of pounce's FP8 rows) they would take
half the memory and half the bytes the backward's SwiGLU pass reads. The study runs the layer's backward
from the exact gate/up rows, from their bf16 rounding (what pounce keeps now) and from their E4M3
quantization, and prints each gradient's error against the exact one: relative L2 over the tensor and the
worst row's relative error (a token's row of dx or of the router-weight gradients, an expert's row of
dW13 / dW2). For scale it also gives the error of pounce's E4M3 data gradients (dy and d(gate, up)
quantized 1 x 128, both weights 128 x 128) from the bf16 rows.

scales: what fp32 block scales (amax / 448) would gain over the power-of-two ones pounce uses (the
smallest 2^e with amax <= 448 * 2^e, exact to apply and E8M0-representable): the error of the E4M3
activations (1 x 128) and of a GEMM with them and E4M3 weights (128 x 128), both ways.

Inputs are drawn like a trained layer's: x, dy ~ N(0, 1) (x with a log-normal spread of token norms in
the scales study), weights ~ N(0, 1 / fan-in), uniform routing, softmax router weights; every tensor
rounded to bf16 first. The gate/up layout is pounce's (groups of 8 gate and 8 up columns), so a 1 x 128
block of a kept row holds 64 gate and 64 up values.

usage: tools/fp8_errors.py [kept-rows | scales] [--shapes NAME ...] [--tokens T] [--experts E] [--topk K]
                           [--seed S] [--json FILE]
"""
import argparse
import json
import subprocess

import torch

SHAPES = {"qwen3_30b": (2048, 768), "deepseek_v3": (7168, 2048), "mixtral_8x7b": (4096, 14336)}
E4M3_MAX = 448.0
GRADIENTS = ("dx", "d_topk_weights", "dw13", "dw2")


def bf16(t):
    return t.to(torch.bfloat16).double()


def power_of_two_scales(amax):
    """The smallest 2^e with amax <= 448 * 2^e (1 where a block is all zeros)."""
    e = torch.ceil(torch.log2(amax.clamp_min(1e-300) / E4M3_MAX))
    return torch.where(amax > 0, torch.exp2(e), torch.ones_like(amax))


def fp32_scales(amax):
    """amax / 448 (1 where a block is all zeros): the block's largest magnitude lands on E4M3's largest."""
    return torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))


def e4m3_blocks(t, rows, cols, scales=power_of_two_scales):
    """t quantized to E4M3 in blocks of rows x cols, one scale per block, returned dequantized."""
    *lead, m, n = t.shape
    blocks = t.reshape(*lead, m // rows, rows, n // cols, cols)
    scale = scales(blocks.abs().amax(dim=(-3, -1), keepdim=True))
    return ((blocks / scale).to(torch.float8_e4m3fn).double() * scale).reshape(t.shape)


def swiglu_backward(h13, d_a, w):
    """From kept rows h13 [R, 2I] (interleaved) and d_a [R, I]: the route dots <d_a, a>, d(gate, up) [R, 2I]
    (interleaved, scaled by the router weights w [R]) and w a [R, I]."""
    r, two_i = h13.shape
    pairs = h13.reshape(r, two_i // 16, 2, 8)
    g, u = pairs[:, :, 0].reshape(r, -1), pairs[:, :, 1].reshape(r, -1)
    s = torch.sigmoid(g)
    a = g * s * u
    dots = (d_a * a).sum(-1)
    wd = w[:, None] * d_a
    dg = wd * u * s * (1 + g * (1 - s))
    du = wd * g * s
    dgu = torch.stack((dg.reshape(r, -1, 8), du.reshape(r, -1, 8)), dim=2).reshape(r, two_i)
    return dots, dgu, w[:, None] * a


def backward(problem, kept, fp8_data_gradients=False):
    """The layer's four gradients, fp64, from kept gate/up rows kept[e] [R_e, 2I] of each expert."""
    x, dy, ids, weights, w13, w2 = (problem[k] for k in ("x", "dy", "ids", "weights", "w13", "w2"))
    dx, d_weights = torch.zeros_like(x), torch.zeros_like(weights)
    dw13, dw2 = torch.zeros_like(w13), torch.zeros_like(w2)
    for e in range(w13.shape[0]):
        tokens, slot = (ids == e).nonzero(as_tuple=True)
        if tokens.numel() == 0:
            continue
        dy_rows, w = dy[tokens], weights[tokens, slot]
        a_w2, a_w13 = w2[e], w13[e]
        if fp8_data_gradients:  # the dgrad GEMMs' operands as pounce's FP8 data gradients quantize them
            pad = (-dy_rows.shape[0]) % 128
            dy_rows_q = e4m3_blocks(torch.nn.functional.pad(dy_rows, (0, 0, 0, pad)), 1, 128)[: dy_rows.shape[0]]
            a_w2, a_w13 = e4m3_blocks(w2[e], 128, 128), e4m3_blocks(w13[e], 128, 128)
            d_a = dy_rows_q @ a_w2
        else:
            d_a = dy_rows @ a_w2
        dots, dgu, wa = swiglu_backward(kept[e], d_a, w)
        dgu_gemm = e4m3_blocks(dgu, 1, 128) if fp8_data_gradients else dgu
        dx.index_add_(0, tokens, dgu_gemm @ a_w13)
        d_weights[tokens, slot] = dots
        dw13[e] = dgu.T @ x[tokens]
        dw2[e] = dy_rows.T @ wa
    return {"dx": dx, "d_topk_weights": d_weights, "dw13": dw13, "dw2": dw2}


def draw(hidden, intermediate, experts, topk, tokens, seed):
    g = torch.Generator().manual_seed(seed)

    def normal(*shape, std=1.0):
        return bf16(torch.randn(*shape, generator=g, dtype=torch.float64) * std)

    ids = torch.rand(tokens, experts, generator=g).topk(topk, dim=-1).indices
    return {"x": normal(tokens, hidden), "dy": normal(tokens, hidden), "ids": ids,
            "weights": torch.softmax(torch.randn(tokens, topk, generator=g, dtype=torch.float64), -1),
            "w13": normal(experts, 2 * intermediate, hidden, std=hidden**-0.5),
            "w2": normal(experts, hidden, intermediate, std=intermediate**-0.5)}


def errors(got, want):
    """Relative L2 over the tensor, and the worst row's: rows of the last dimension (dx and the router-weight
    gradients: a token's; dW13, dW2: an expert's row)."""
    rows = want.reshape(-1, want.shape[-1]) if want.dim() > 2 else want.reshape(want.shape[0], -1)
    diff = (got - want).reshape(rows.shape)
    row_norms = rows.norm(dim=-1)
    live = row_norms > 0
    worst = (diff.norm(dim=-1)[live] / row_norms[live]).max().item() if live.any() else 0.0
    return {"relative_l2": ((got - want).norm() / want.norm()).item(), "worst_row": worst}


def kept_rows_study(hidden, intermediate, experts, topk, tokens, seed):
    p = draw(hidden, intermediate, experts, topk, tokens, seed)
    exact = {}
    for e in range(experts):
        tokens_e, _ = (p["ids"] == e).nonzero(as_tuple=True)
        exact[e] = p["x"][tokens_e] @ p["w13"][e].T
    kept = {
        "bf16": {e: bf16(h) for e, h in exact.items()},
        "e4m3": {e: e4m3_blocks(h, 1, 128) for e, h in exact.items()},
    }
    want = backward(p, exact)
    out = {name: {k: errors(v, want[k]) for k, v in backward(p, rows).items()} for name, rows in kept.items()}
    out["bf16 rows, E4M3 data gradients"] = {
        k: errors(v, want[k]) for k, v in backward(p, kept["bf16"], fp8_data_gradients=True).items()}
    return out


def scales_study(hidden, intermediate, tokens, seed):
    """Relative L2 of the E4M3 activations and of GEMM1 (x W13^T) with power-of-two and with fp32 scales."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g, dtype=torch.float64)
    x = bf16(x * torch.exp(torch.randn(tokens, 1, generator=g, dtype=torch.float64)))
    w = bf16(torch.randn(2 * intermediate, hidden, generator=g, dtype=torch.float64) * hidden**-0.5)
    y = x @ w.T
    out = {}
    for name, scales in (("power of two", power_of_two_scales), ("fp32", fp32_scales)):
        xq = e4m3_blocks(x, 1, 128, scales)
        yq = xq @ e4m3_blocks(w, 128, 128, scales).T
        out[name] = {"activations": ((xq - x).norm() / x.norm()).item(), "gemm1": ((yq - y).norm() / y.norm()).item()}
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("study", nargs="?", default="kept-rows", choices=["kept-rows", "scales"])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the errors here")
    args = parser.parse_args()
    results = {}
    for name in args.shapes:
        hidden, intermediate = SHAPES[name]
        if args.study == "scales":
            results[name] = r = scales_study(hidden, intermediate, args.tokens, args.seed)
            print(f"{name}: E4M3 with power-of-two scales: activations {r['power of two']['activations']:.3e}, "
                  f"GEMM1 {r['power of two']['gemm1']:.3e}; with fp32 scales: {r['fp32']['activations']:.3e}, "
                  f"{r['fp32']['gemm1']:.3e} (relative L2, {args.tokens} tokens)")
            continue
        results[name] = kept_rows_study(hidden, intermediate, args.experts, args.topk, args.tokens, args.seed)
        print(f"\n{name}: H {hidden}, I {intermediate}, {args.experts} experts, top-{args.topk}, {args.tokens} tokens; "
              "relative L2 (worst row) against the backward from exact gate/up rows\n")
        print("| gradient | " + " | ".join(results[name]) + " |")
        print("|---|" + "---:|" * len(results[name]))
        for g in GRADIENTS:
            cells = [f"{r[g]['relative_l2']:.2e} ({r[g]['worst_row']:.2e})" for r in results[name].values()]
            print(f"| {g} | " + " | ".join(cells) + " |")
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        with open(args.json, "w") as f:
            json.dump({"study": args.study, "device": "cpu (fp64)", "torch": torch.__version__,
                       "git_commit": commit or None, "tokens": args.tokens, "experts": args.experts,
                       "topk": args.topk, "seed": args.seed, "shapes": results}, f, indent=1)


if __name__ == "__main__":
    main()

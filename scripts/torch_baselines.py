#!/usr/bin/env python3
"""PyTorch baselines on the GPU machine, for the same shapes (and expert sizes) pounce_bench ran:
  - torch._grouped_mm alone for GEMM1 (gate/up, no SwiGLU) and GEMM2 (down) on the padded expert
    layout pounce's grouped GEMM computes (same group sizes, read from pounce_bench's JSON);
  - an eager PyTorch MoE forward: router output in, argsort permute, torch._grouped_mm, SwiGLU,
    weighted index_add_;
  - a loop of per-expert torch.mm (cuBLAS) for each GEMM: the same loop pounce_bench times as
    "cublas_loop", so pounce / torch._grouped_mm can be read through a reference that does the same work,
    each ratio measured interleaved in its own process;
  - torch._scaled_grouped_mm for both GEMMs in E4M3 with rowwise scales and fast accumulation, on the
    same groups, interleaved with torch._scaled_mm's 8192^3 E4M3 dense GEMM (rowwise, fast
    accumulation), the FP8 ceiling pounce_bench times beside its own FP8 GEMMs;
  - torch.matmul 8192^3 bf16 as this process's dense ceiling;
  - when the pounce package imports (from python/ over build/bin/libpounce.so, or installed), pounce's
    layer (pounce.moe) forward and forward + backward against the eager MoE's, in this same process and
    interleaved: the same-process speed-ups.
CUDA events, warm-up, median of repetitions, as pounce_bench does. Under sustained load the H200 sits at
its power cap and lowers its clocks, so each shape's measurements are interleaved with the dense GEMM
(as pounce_bench interleaves its own): compare fractions of the interleaved dense rate across the two.

usage: torch_baselines.py --bench-json BENCH.json --out TORCH.json [--reps N] [--warmup N]
"""
import argparse
import json

from torch_bench import interleaved_times, pounce, summarize  # first: multicast off, this checkout's pounce

import torch
import torch.nn.functional as F

BLOCK_M = 128


def time_interleaved(fns, warmup, reps):
    """Median times of several functions, repetitions interleaved so clock drift hits all alike."""
    return [summarize(list(times)) for times in zip(*interleaved_times(fns, warmup, reps))]


def eager_moe(x, topk_ids, topk_weights, w13, w2, intermediate):
    """The unfused MoE forward of a PyTorch training stack (W13 gate/up interleaved in groups of 8)."""
    experts = w13.shape[0]
    k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    offs = torch.cumsum(torch.bincount(flat, minlength=experts), 0, dtype=torch.int32)
    token = order // k
    h = torch._grouped_mm(x.index_select(0, token), w13.transpose(-2, -1), offs=offs)
    h = h.view(-1, intermediate // 8, 2, 8)
    a = (F.silu(h[:, :, 0, :]) * h[:, :, 1, :]).reshape(-1, intermediate)
    o = torch._grouped_mm(a, w2.transpose(-2, -1), offs=offs)
    o = o * topk_weights.reshape(-1)[order].unsqueeze(1).to(o.dtype)
    return torch.zeros_like(x).index_add_(0, token, o)


def check_eager_moe():
    """The eager baseline must compute the layer: compare with a per-route loop in float32."""
    torch.manual_seed(0)
    T, H, I, E, k = 64, 128, 64, 8, 2
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    w13 = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) / H ** 0.5
    w2 = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) / I ** 0.5
    ids = torch.stack([torch.randperm(E, device="cuda")[:k] for _ in range(T)]).int()
    w = torch.softmax(torch.randn(T, k, device="cuda"), -1)
    y = eager_moe(x, ids, w, w13, w2, I).float()
    ref = torch.zeros(T, H, device="cuda")
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j])
            h = (w13[e].float() @ x[t].float()).view(I // 8, 2, 8)
            a = (F.silu(h[:, 0]) * h[:, 1]).reshape(I)
            ref[t] += w[t, j] * (w2[e].float() @ a)
    err = ((y - ref).norm() / ref.norm()).item()
    assert err < 2e-2, f"eager MoE baseline disagrees with the loop reference: relative L2 {err}"
    return err


def rowwise_fp8(t):
    """t (bf16, [..., K]) in E4M3 with one fp32 scale per row (its amax over 448), as rowwise scaled GEMMs take it."""
    scale = t.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / 448.0
    return (t.float() / scale).to(torch.float8_e4m3fn), scale.squeeze(-1)


def scaled_grouped_mm(pool, hidden, w13, w2, offs, routes, args):
    """GEMM1 and GEMM2 by torch._scaled_grouped_mm (E4M3, rowwise scales, fast accumulation) on the padded
    groups, interleaved with torch._scaled_mm's 8192^3 E4M3 dense GEMM; GEMM1's output is checked against
    torch._grouped_mm in bf16 (E4M3 rounding of both operands: a few percent)."""
    E, N1, H = w13.shape
    I = w2.shape[2]
    a1, sa1 = rowwise_fp8(pool)
    b1, sb1 = rowwise_fp8(w13)
    a2, sa2 = rowwise_fp8(hidden)
    b2, sb2 = rowwise_fp8(w2)
    d = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    da, sda = rowwise_fp8(d)
    db, sdb = rowwise_fp8(d.t().contiguous())

    def gemm1():
        return torch._scaled_grouped_mm(a1, b1.transpose(-2, -1), sa1, sb1, offs=offs, out_dtype=torch.bfloat16,
                                        use_fast_accum=True)

    def gemm2():
        return torch._scaled_grouped_mm(a2, b2.transpose(-2, -1), sa2, sb2, offs=offs, out_dtype=torch.bfloat16,
                                        use_fast_accum=True)

    def dense():
        return torch._scaled_mm(da, db.t(), sda.unsqueeze(1), sdb.unsqueeze(0), out_dtype=torch.bfloat16,
                                use_fast_accum=True)

    want = torch._grouped_mm(pool, w13.transpose(-2, -1), offs=offs).float()
    err = ((gemm1().float() - want).norm() / want.norm()).item()
    assert err < 0.1, f"torch._scaled_grouped_mm GEMM1 strays from the bf16 GEMM: relative L2 {err}"
    g1, g2, dn = time_interleaved([gemm1, gemm2, dense], args.warmup, args.reps)
    dense_rate = 2 * 8192 ** 3 / (dn["median_ms"] * 1e-3) / 1e12
    for t, flops in ((g1, 2 * routes * N1 * H), (g2, 2 * routes * H * I)):
        t["tflops"] = flops / (t["median_ms"] * 1e-3) / 1e12
        t["fraction_of_interleaved_fp8_dense"] = t["tflops"] / dense_rate
    print(f"  torch._scaled_grouped_mm (E4M3 rowwise, fast accumulation): GEMM1 {g1['median_ms']:.3f} ms "
          f"({g1['fraction_of_interleaved_fp8_dense']:.3f} of FP8 dense), GEMM2 {g2['median_ms']:.3f} ms "
          f"({g2['fraction_of_interleaved_fp8_dense']:.3f}); FP8 dense interleaved {dense_rate:.1f} TFLOP/s; "
          f"GEMM1 relative L2 against bf16 {err:.3f}", flush=True)
    return {"gemm1_gate_up": g1, "gemm2_down": g2, "interleaved_fp8_dense_tflops": dense_rate,
            "gemm1_relative_l2_vs_bf16": err}


def same_process(x, ids, w, w13, w2, I, dense, args):
    """pounce.moe and the eager MoE, forward and forward + backward (gradients of x, the router weights,
    w13 and w2), interleaved with each other and the dense GEMM in this process. FLOPs: 6 routes H I
    forward, 12 routes H I backward."""
    layer = pounce.Layer(x.shape[1], I, w13.shape[0], ids.shape[1])
    dy = torch.randn_like(x)
    leaves = [t.detach().requires_grad_() for t in (x, w, w13, w2)]

    def pounce_forward():
        return pounce.moe(x, ids, w, w13, w2, layer=layer)

    def eager_forward():
        return eager_moe(x, ids, w, w13, w2, I)

    def pounce_train():
        for t in leaves:
            t.grad = None  # fresh gradients each time: no accumulation pass timed
        xx, ww, a, b = leaves
        pounce.moe(xx, ids, ww, a, b, layer=layer).backward(dy)

    def eager_train():
        for t in leaves:
            t.grad = None
        xx, ww, a, b = leaves
        eager_moe(xx, ids, ww, a, b, I).backward(dy)

    with torch.no_grad():
        err = (pounce_forward().float() - eager_forward().float()).norm() / eager_forward().float().norm()
    pf, ef, pt, et, dn = time_interleaved([pounce_forward, eager_forward, pounce_train, eager_train, dense],
                                          args.warmup, args.reps)
    layer.check_device_errors()
    flops = 6 * x.shape[0] * ids.shape[1] * x.shape[1] * I
    for t, f in ((pf, flops), (ef, flops), (pt, 3 * flops), (et, 3 * flops)):
        t["tflops"] = f / (t["median_ms"] * 1e-3) / 1e12
    out = {"pounce_forward": pf, "eager_forward": ef, "pounce_forward_backward": pt, "eager_forward_backward": et,
           "forward_speedup": ef["median_ms"] / pf["median_ms"],
           "forward_backward_speedup": et["median_ms"] / pt["median_ms"],
           "y_relative_l2_pounce_vs_eager": float(err), "dense_ms": dn["median_ms"]}
    print(f"  same process: pounce forward {pf['median_ms']:.3f} ms, eager {ef['median_ms']:.3f} ms "
          f"({out['forward_speedup']:.2f}x); forward + backward pounce {pt['median_ms']:.3f} ms, eager "
          f"{et['median_ms']:.3f} ms ({out['forward_backward_speedup']:.2f}x); y relative L2 {err:.2e}", flush=True)
    layer.close()
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--bench-json", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    bench = json.load(open(args.bench_json))
    dev = torch.device("cuda")

    result = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
              "git_commit": bench["environment"]["git_commit"], "eager_check_relative_l2": check_eager_moe()}
    dense_a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    dense_b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    dense_flops = 2 * 8192 ** 3

    def dense():
        return dense_a @ dense_b.t()

    t, = time_interleaved([dense], args.warmup, args.reps)
    result["dense_bf16_8192_tflops"] = dense_flops / (t["median_ms"] * 1e-3) / 1e12
    print(f"torch {torch.__version__}, dense 8192^3 bf16 (alone, at the start): "
          f"{result['dense_bf16_8192_tflops']:.1f} TFLOP/s")

    shapes = []
    for s in bench["shapes"]:
        H, I, E, T, k = s["hidden"], s["intermediate"], s["local_experts"], s["tokens"], s["topk"]
        routes = sum(s["expert_routes"])
        padded = [(r + BLOCK_M - 1) // BLOCK_M * BLOCK_M for r in s["expert_routes"]]
        offs = torch.tensor(padded, device=dev, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        rows = int(offs[-1])
        torch.manual_seed(1)
        w13 = torch.randn(E, 2 * I, H, device=dev, dtype=torch.bfloat16) / H ** 0.5
        w2 = torch.randn(E, H, I, device=dev, dtype=torch.bfloat16) / H ** 0.5
        pool = torch.randn(rows, H, device=dev, dtype=torch.bfloat16)
        hidden = torch.randn(rows, I, device=dev, dtype=torch.bfloat16)
        x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
        ids = torch.rand(T, E, device=dev).topk(k, dim=-1).indices.int()  # uniform routing, like pounce_bench's
        w = torch.softmax(torch.randn(T, k, device=dev), -1)
        starts = [sum(padded[:e]) for e in range(E)]

        def loop(a, weights):  # one cuBLAS GEMM per non-empty expert, like pounce_bench's cublas_loop
            for e, r in enumerate(s["expert_routes"]):
                if r:
                    torch.mm(a[starts[e]:starts[e] + r], weights[e].t())

        g1, g2, l1, l2, fwd, dn = time_interleaved([
            lambda: torch._grouped_mm(pool, w13.transpose(-2, -1), offs=offs),
            lambda: torch._grouped_mm(hidden, w2.transpose(-2, -1), offs=offs),
            lambda: loop(pool, w13),
            lambda: loop(hidden, w2),
            lambda: eager_moe(x, ids, w, w13, w2, I),
            dense], args.warmup, args.reps)
        dense_rate = dense_flops / (dn["median_ms"] * 1e-3) / 1e12
        for t, flops in ((g1, 2 * routes * 2 * I * H), (g2, 2 * routes * H * I), (l1, 2 * routes * 2 * I * H),
                         (l2, 2 * routes * H * I), (fwd, 6 * T * k * H * I)):
            t["tflops"] = flops / (t["median_ms"] * 1e-3) / 1e12
            t["fraction_of_interleaved_dense"] = t["tflops"] / dense_rate
        g1["speedup_over_cublas_loop"] = l1["median_ms"] / g1["median_ms"]
        g2["speedup_over_cublas_loop"] = l2["median_ms"] / g2["median_ms"]
        entry = {"shape": s["shape"], "grouped_mm_gemm1_gate_up": g1, "grouped_mm_gemm2_down": g2,
                 "cublas_loop_gemm1_gate_up": l1, "cublas_loop_gemm2_down": l2,
                 "eager_forward": fwd, "interleaved_dense_tflops": dense_rate}
        print(f"{s['shape']:18s} _grouped_mm GEMM1 {g1['median_ms']:7.3f} ms {g1['tflops']:6.1f} TFLOP/s "
              f"({g1['fraction_of_interleaved_dense']:.3f} of dense, {g1['speedup_over_cublas_loop']:.3f}x cuBLAS loop) | "
              f"GEMM2 {g2['median_ms']:7.3f} ms {g2['tflops']:6.1f} ({g2['fraction_of_interleaved_dense']:.3f}, "
              f"{g2['speedup_over_cublas_loop']:.3f}x) | eager forward "
              f"{fwd['median_ms']:7.3f} ms {fwd['tflops']:6.1f} | dense interleaved {dense_rate:6.1f}", flush=True)
        if H % 16 == 0 and I % 16 == 0:  # rowwise E4M3 GEMMs need K and N multiples of 16
            try:
                entry["scaled_grouped_mm_fp8"] = scaled_grouped_mm(pool, hidden, w13, w2, offs, routes, args)
            except (RuntimeError, AttributeError, TypeError, AssertionError) as error:
                # An older PyTorch, a GPU it has no kernel for, or its check failed: recorded, not fatal.
                entry["scaled_grouped_mm_fp8"] = {"error": str(error)}
                print(f"  torch._scaled_grouped_mm: not run ({error})", flush=True)
        del pool, hidden
        if pounce is not None:
            entry["same_process"] = same_process(x, ids, w, w13, w2, I, dense, args)
        shapes.append(entry)
        del w13, w2, x
        torch.cuda.empty_cache()
    result["shapes"] = shapes
    json.dump(result, open(args.out, "w"), indent=2)


if __name__ == "__main__":
    main()

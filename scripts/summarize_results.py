#!/usr/bin/env python3
"""Markdown tables from one gpu_check run's JSON (pounce_bench, and torch_baselines when given).

usage: summarize_results.py BENCH.json [TORCH.json]

Each rate is also given as a fraction of the cuBLAS 8192^3 BF16 GEMM timed interleaved with the same
comparison ("of dense"): under sustained load the H200 runs at its power cap with lowered clocks, so a
ceiling measured on a cool GPU at the start of the run overstates what any kernel can sustain.
PyTorch's numbers come from a later phase of the same run. Two bridges compare them with
pounce's without comparing raw TFLOP/s across phases: each process's fraction of its own interleaved
dense GEMM, and each process's speedup over the same per-expert cuBLAS loop timed interleaved with it.
"""
import json
import sys

DENSE = "cublas dense 8192^3"


def rows(entries):
    return {e["impl"]: e for e in entries}


def main():
    bench = json.load(open(sys.argv[1]))
    torch = {s["shape"]: s for s in json.load(open(sys.argv[2]))["shapes"]} if len(sys.argv) > 2 else {}
    env, ceil = bench["environment"], bench["ceilings"]
    print(f"{env['gpu']}, commit {env['git_commit'][:10]}, {env['date']}, routing {bench['shapes'][0]['routing']}. "
          f"Cold-start ceilings: cuBLAS 8192^3 BF16 {ceil['dense_bf16_8192_tflops']:.0f} TFLOP/s, "
          f"FP8 {ceil['dense_fp8_8192_tflops']:.0f} (fast accumulation {ceil['dense_fp8_fast_accum_8192_tflops']:.0f}), "
          f"HBM copy {ceil['hbm_copy_4GiB_gbps']:.0f} GB/s.\n")
    for failure in bench.get("check_failures", []):  # absent from results older than the checks
        print(f"**OUTPUT CHECK FAILED, these timings are of wrong results:** {failure}\n")
    steps = (("forward", "forward", "eager_forward", "pounce_unfused"),
             ("GEMM1 gate/up (+SwiGLU)", "gemm1_gate_up", "grouped_mm_gemm1_gate_up", "pounce (SwiGLU fused)"),
             ("GEMM2 down", "gemm2_down", "grouped_mm_gemm2_down", "pounce"))
    print("| shape | step | pounce TFLOP/s | of dense | cuBLAS loop | cuBLAS grouped | pounce / best cuBLAS | "
          "PyTorch of its dense | pounce vs PyTorch, via dense | via cuBLAS loop |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for s in bench["shapes"]:
        for title, key, torch_key, ours in steps:
            if key != "forward" and "grouped_gemms" not in s:
                continue
            r = rows(s["forward"] if key == "forward" else s["grouped_gemms"][key])
            dense = r[DENSE]["tflops"]
            p = r[ours]["tflops"]
            loop, grouped = r["cublas_loop"]["tflops"], r["cublas_grouped_batched"]["tflops"]
            t = torch.get(s["shape"], {}).get(torch_key)
            tcol = f"{t['fraction_of_interleaved_dense']:.3f} ({t['tflops']:.0f})" if t else "-"
            rel = f"{(p / dense) / t['fraction_of_interleaved_dense']:.2f}x" if t else "-"
            via_loop = (f"{(p / loop) / t['speedup_over_cublas_loop']:.2f}x"
                        if t and "speedup_over_cublas_loop" in t else "-")
            print(f"| {s['shape']} | {title} | {p:.0f} | {p / dense:.3f} | {loop:.0f} | {grouped:.0f} | "
                  f"{p / max(loop, grouped):.2f}x | {tcol} | {rel} | {via_loop} |")

    rows_bf16_fp8 = gemm_fractions(bench)
    if rows_bf16_fp8:
        print("\nEach grouped GEMM alone over the dense GEMM timed beside it: BF16 over cuBLAS's BF16 GEMM, E4M3 over "
              "cuBLASLt's FP8 GEMM (fast accumulation); padding rows: rows of the experts' m-blocks that hold no route:\n")
        print("| shape | GEMM | padding rows | BF16 TFLOP/s | of dense | E4M3 TFLOP/s | of FP8 dense |")
        print("|---|---|---:|---:|---:|---:|---:|")
        for r in rows_bf16_fp8:
            e4m3 = (f"{r['e4m3_tflops']:.0f} | {r['e4m3_of_dense']:.3f}" if r["e4m3_tflops"] is not None else "- | -")
            print(f"| {r['shape']} | {r['gemm']} | {r['padding_rows']} | {r['bf16_tflops']:.0f} | "
                  f"{r['bf16_of_dense']:.3f} | {e4m3} |")

    print("\nFused layer (one launch: plan, dispatch, GEMM1+SwiGLU, GEMM2, combine, weighted sum), forward. "
          "Unfused: host schedule (free, outside the timing) / device schedule (the chain from device routing, "
          "as the fused layer runs):\n")
    print("| shape | fused ms | TFLOP/s | of dense | unfused ms, host / device schedule | fused vs unfused, "
          "host / device schedule | unfused GEMMs alone ms | fused vs best cuBLAS | vs PyTorch eager, via dense | "
          "via cuBLAS loop | rel. L2 vs cuBLAS y |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for s in bench["shapes"]:
        r = rows(s["forward"])
        if "pounce_fused" not in r:
            continue
        f, u, dense = r["pounce_fused"], r["pounce_unfused"], r[DENSE]["tflops"]
        ud = r.get("pounce_unfused, device schedule")
        loop, grouped = r["cublas_loop"], r["cublas_grouped_batched"]
        best = min(loop["timing"]["median_ms"], grouped["timing"]["median_ms"])
        t = torch.get(s["shape"], {}).get("eager_forward")
        via_dense = f"{(f['tflops'] / dense) / t['fraction_of_interleaved_dense']:.2f}x" if t else "-"
        via_loop = (f"{(f['tflops'] / loop['tflops']) / t['speedup_over_cublas_loop']:.2f}x"
                    if t and "speedup_over_cublas_loop" in t else "-")
        fm, um = f["timing"]["median_ms"], u["timing"]["median_ms"]
        udm = ud["timing"]["median_ms"] if ud else float("nan")
        gemms = r.get("pounce GEMM1 + GEMM2 alone")
        gemms_ms = f"{gemms['timing']['median_ms']:.3f}" if gemms else "-"
        l2 = s["relative_l2_difference"].get("y_pounce_fused_vs_cublas")  # null when the output had a NaN
        l2 = float("nan") if l2 is None else l2
        print(f"| {s['shape']} | {fm:.3f} | {f['tflops']:.0f} | {f['tflops'] / dense:.3f} | {um:.3f} / {udm:.3f} | "
              f"{um / fm:.2f}x / {udm / fm:.2f}x | {gemms_ms} | {best / fm:.2f}x | "
              f"{via_dense} | {via_loop} | {l2:.1e} |")

    backward_table(bench, torch)

    for s in bench["shapes"]:
        if "fused_sweeps" not in s:
            continue
        print(f"\nFused layer sweeps, {s['shape']} (each group timed interleaved with pounce_unfused and the dense "
              "GEMM):\n")
        print("| sweep | setting | ms | TFLOP/s | of dense | unfused / this |")
        print("|---|---|---:|---:|---:|---:|")
        groups = dict(s["fused_sweeps"])
        ranks = groups.pop("virtual_ranks", {})
        for name, g in list(groups.items()) + [(f"virtual ranks {k}", v) for k, v in ranks.items()]:
            r = rows(g["timings"])
            u, dense = r["pounce_unfused"]["timing"]["median_ms"], r[DENSE]["tflops"]
            for e in g["timings"]:
                if e["impl"] in ("pounce_unfused", DENSE):
                    continue
                ms = e["timing"]["median_ms"]
                print(f"| {name} | {e['impl']} | {ms:.3f} | {e['tflops']:.0f} | {e['tflops'] / dense:.3f} | {u / ms:.2f}x |")


def gemm_fractions(bench):
    """Per shape and GEMM of the forward: pounce's BF16 grouped GEMM over the BF16 dense GEMM of its comparison,
    and its E4M3 one over the FP8 dense GEMM of its own (None where the shape ran no E4M3 GEMMs)."""
    out = []
    for s in bench["shapes"]:
        if "grouped_gemms" not in s:
            continue
        for key, name, ours in (("gemm1_gate_up", "GEMM1", "pounce (SwiGLU fused)"), ("gemm2_down", "GEMM2", "pounce")):
            r = rows(s["grouped_gemms"][key])
            row = {"shape": s["shape"], "gemm": name, "padding_rows": s["padded_rows"] - s["routes"],
                   "bf16_tflops": r[ours]["tflops"], "bf16_of_dense": r[ours]["tflops"] / r[DENSE]["tflops"],
                   "e4m3_tflops": None, "e4m3_of_dense": None}
            fp8 = s.get("grouped_gemms_fp8", {}).get(key)
            if fp8:
                f = rows(fp8["rows"])
                dense_fp8 = next(e for impl, e in f.items() if impl.startswith("cublasLt dense fp8"))
                row["e4m3_tflops"] = f["pounce fp8"]["tflops"]
                row["e4m3_of_dense"] = f["pounce fp8"]["tflops"] / dense_fp8["tflops"]
            out.append(row)
    return out


def backward_table(bench, torch):
    """The backward on one GPU, from a kept forward and replayed, beside the forward; its GEMMs beside a
    per-expert cuBLAS loop and the dense GEMM timed with them; the same-process comparison with PyTorch
    when torch_baselines ran it."""
    shapes = [s for s in bench["shapes"] if "backward" in s]
    if not shapes:
        return
    kept_name, replay_name = "pounce backward, from the kept forward", "pounce backward, replay (plans, recomputes GEMM1)"
    print("\nBackward on one GPU (FLOPs 12 routes H I; a replay's GEMM1 not counted). From the kept forward: after "
          "a training forward, which keeps its gate/up rows; replay: plans again and recomputes GEMM1. Forward + "
          "backward: the fused forward and the layer's backward, both ways, in one comparison:\n")
    print("| shape | kept ms | TFLOP/s | of dense | replay ms | kept / replay | training forward ms | its cost | "
          "forward + backward ms, kept / replay | backward rate / forward rate | kept bytes per token |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for s in shapes:
        b, t, fb = rows(s["backward"]), rows(s["training_forward"]), rows(s["forward_backward"])
        kept, replay, dense = b[kept_name], b[replay_name], b[DENSE]["tflops"]
        km, rm = kept["timing"]["median_ms"], replay["timing"]["median_ms"]
        plain, training = t["pounce fused forward"], t["pounce fused training forward (keeps gate/up)"]
        fk = fb["pounce fused training forward + backward from it"]["timing"]["median_ms"]
        fr = fb["pounce fused forward + backward replay"]["timing"]["median_ms"]
        print(f"| {s['shape']} | {km:.3f} | {kept['tflops']:.0f} | {kept['tflops'] / dense:.3f} | {rm:.3f} | "
              f"{rm / km:.2f}x | {training['timing']['median_ms']:.3f} | "
              f"{training['timing']['median_ms'] / plain['timing']['median_ms'] - 1:+.1%} | {fk:.3f} / {fr:.3f} | "
              f"{kept['tflops'] / training['tflops']:.2f} | {s['backward_memory']['kept_bytes_per_token']:.0f} |")
    print("\nThe backward's GEMMs alone: TFLOP/s (fraction of the dense GEMM timed beside them), pounce / cuBLAS "
          "per-expert loop:\n")
    names = (("gemm1_again", "GEMM1 again"), ("dgrad_down", "dgrad down"), ("dgrad_gate_up", "dgrad gate/up"),
             ("wgrad_down", "wgrad down"), ("wgrad_gate_up", "wgrad gate/up"))
    print("| shape | " + " | ".join(n for _, n in names) + " |")
    print("|---|" + "---:|" * len(names))
    for s in shapes:
        cells = []
        for key, _ in names:
            g = rows(s["backward_gemms"][key])
            p, d = g["pounce"]["tflops"], g[DENSE]["tflops"]
            c = g.get("cublas_loop")
            cell = f"{p:.0f} ({p / d:.2f})" + (f", {p / c['tflops']:.2f}x" if c else "")
            outputs = [(g[impl]["tflops"] / d, label) for impl, label in
                       (("pounce bf16 out", "bf16 out"), ("pounce fp32 accumulated", "accumulated")) if impl in g]
            cells.append(cell + "".join(f"; {label} {r:.2f}" for r, label in outputs))
        print(f"| {s['shape']} | " + " | ".join(cells) + " |")
    same = [(s["shape"], torch[s["shape"]]["same_process"]) for s in bench["shapes"]
            if "same_process" in torch.get(s["shape"], {})]
    if same:
        print("\npounce.moe against the eager PyTorch MoE in one process (torch_baselines.py, interleaved):\n")
        print("| shape | pounce forward ms | eager forward ms | speed-up | pounce forward + backward ms | "
              "eager forward + backward ms | speed-up |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for shape, p in same:
            print(f"| {shape} | {p['pounce_forward']['median_ms']:.3f} | {p['eager_forward']['median_ms']:.3f} | "
                  f"{p['forward_speedup']:.2f}x | {p['pounce_forward_backward']['median_ms']:.3f} | "
                  f"{p['eager_forward_backward']['median_ms']:.3f} | {p['forward_backward_speedup']:.2f}x |")


if __name__ == "__main__":
    main()

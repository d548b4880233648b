#!/usr/bin/env python3
"""The expert-parallel (EP) PyTorch MoE as users write it, against pounce's layer; torchrun, one rank per GPU:
  - eager EP: per-expert route counts on the GPU, exchanged with all_to_all_single, split sizes to the
    host (.tolist(), the one host synchronization), token rows sent to their experts' ranks with
    all_to_all_single, regrouped by expert (argsort), torch._grouped_mm, SwiGLU, torch._grouped_mm,
    rows sent back, weighted index_add_; differentiable through torch.distributed.nn.functional;
  - when the pounce package imports (from python/ over build/bin/libpounce.so, or installed): pounce.MoE
    over the default process group (no group on one rank) on the same weights, forward and forward +
    backward (across GPUs pounce's persistent backward kernel from the rows the training forward kept; see
    pounce.MoE), interleaved with the eager EP
    MoE in these same processes.
Each rank holds E/P of a catalogue shape's E experts and the shape's tokens per rank, routed uniformly or
zipf-skewed. Before timing: the eager y, dx and router-weight gradient against an fp32 reference of each
rank's first 256 tokens, and pounce's y and dx against the eager ones; every check goes into the JSON, and
a failed one makes the exit status non-zero. Timing: CUDA events, warm-up, each repetition's time the
slowest rank's, median of repetitions. TFLOP/s per GPU from the average routes per rank (6 routes H I
forward, 18 forward + backward). NVLink GB/s per rank: the token rows it sends to and receives from other
ranks in the two all-to-alls (H bf16 each), each way, over the forward time; pounce moves the same rows.
Ratios are pounce's milliseconds over the eager's (below 1: pounce is faster).

usage: torchrun --nproc_per_node=N scripts/torch_ep_baseline.py --shapes deepseek_v3 --json OUT.json
options: --shapes NAME,NAME or all (default deepseek_v3), --routing uniform|zipf, --reps N, --warmup N
"""

import argparse
import datetime
import functools
import json
import math
import os
import statistics
import subprocess
import sys

from torch_bench import ROOT, interleaved_times, pounce, summarize  # first: multicast off, this checkout's pounce

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn.functional as F

# The catalogue of src/bench/shapes.cpp: hidden, intermediate, the model's experts, top-k, tokens per rank.
SHAPES = {
    "deepseek_v3": (7168, 2048, 256, 8, 8192),
    "kimi_k2": (7168, 2048, 384, 8, 8192),
    "deepseek_v4_pro": (7168, 3072, 384, 6, 8192),
    "deepseek_v4_flash": (4096, 2048, 256, 6, 8192),
    "qwen3_235b": (4096, 1536, 128, 8, 8192),
    "qwen3_30b": (2048, 768, 128, 8, 16384),
    "mixtral_8x7b": (4096, 14336, 8, 2, 8192),
}
ZIPF_EXPONENT = 1.2  # expert popularity ~ 1 / rank^1.2, as src/reference/synthetic_routing.cpp draws it
CHECK_TOKENS = 256  # tokens per rank checked against the fp32 reference


def routing(tokens, experts, topk, pattern, seed, device):
    """topk_ids [T, k] int32 (k distinct experts per token) and topk_weights [T, k] fp32 (softmax of normal
    logits). uniform: k experts at random. zipf: k draws without replacement with probability
    ~ 1 / popularity_rank^ZIPF_EXPONENT (top-k of log weight + Gumbel noise); the popularity ranking is
    the same on every rank (same hot experts everywhere), the draws are `seed`'s."""
    g = torch.Generator(device=device).manual_seed(seed)
    scores = torch.rand(tokens, experts, generator=g, device=device)
    if pattern == "zipf":
        ranking = torch.randperm(experts, generator=torch.Generator().manual_seed(0))
        log_weight = torch.empty(experts)
        log_weight[ranking] = -ZIPF_EXPONENT * torch.arange(1, experts + 1).float().log()
        scores = log_weight.to(device) - (-scores.clamp_min(1e-30).log()).log()
    ids = scores.topk(topk, dim=-1).indices.to(torch.int32)
    return ids, torch.softmax(torch.randn(tokens, topk, generator=g, device=device), -1)


def swiglu(h):
    """silu(gate) * up of [n, 2I] rows laid out like w13's: gate and up columns interleaved in groups of 8
    (pounce.interleave_w13)."""
    h = h.view(h.shape[0], -1, 2, 8)
    return (F.silu(h[:, :, 0]) * h[:, :, 1]).reshape(h.shape[0], -1)


def eager_ep_moe(x, topk_ids, topk_weights, w13, w2, group=None):
    """y [T, H] of this rank's tokens: x [T, H] bf16, topk_ids [T, k] (global experts), topk_weights [T, k]
    fp32, this rank's experts w13 [E/P, 2I, H] and w2 [E/P, H, I] bf16 (pounce.MoE's layout): rank r holds
    experts [r E/P, (r+1) E/P). Differentiable in x, topk_weights, w13 and w2."""
    P, local = dist.get_world_size(group), w13.shape[0]
    k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1).long()
    # Sorting by global expert sorts by (destination rank, its local expert): rank = expert // local.
    order = torch.argsort(flat, stable=True)
    token = order // k
    # Routes per (destination, expert), counted with histc as torchtitan does (bincount syncs for its max).
    send_counts = torch.histc(flat.float(), bins=P * local, min=0, max=P * local).long()
    recv_counts = torch.empty_like(send_counts)  # per (source, my expert)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    splits = torch.stack((send_counts.view(P, local).sum(1), recv_counts.view(P, local).sum(1)))
    send_splits, recv_splits = splits.tolist()  # all_to_all_single takes its split sizes on the host
    rows = x.index_select(0, token)
    recv = dist_nn.all_to_all_single(
        rows.new_empty(sum(recv_splits), x.shape[1]), rows, recv_splits, send_splits, group
    )
    # Rows arrive by source rank, each source's by expert: regroup them by expert for the grouped GEMMs.
    expert = torch.arange(local, device=x.device).repeat(P).repeat_interleave(recv_counts, output_size=recv.shape[0])
    by_expert = torch.argsort(expert, stable=True)
    offs = torch.cumsum(recv_counts.view(P, local).sum(0), 0, dtype=torch.int32)
    h = torch._grouped_mm(recv[by_expert], w13.transpose(-2, -1), offs=offs)
    o = torch._grouped_mm(swiglu(h), w2.transpose(-2, -1), offs=offs)
    out = torch.empty_like(o)
    out[by_expert] = o  # back to arrival order, the order the sources expect
    back = dist_nn.all_to_all_single(torch.empty_like(rows), out, send_splits, recv_splits, group)
    # Weighted as torchtitan's MoE does it: the product in fp32, cast to bf16, summed into a bf16 y.
    back = (back.float() * topk_weights.reshape(-1)[order].unsqueeze(1)).to(x.dtype)
    return torch.zeros_like(x).index_add_(0, token, back)


def reference_share(x, topk_ids, topk_weights, dy, w13, w2, first_expert):
    """fp32 (y, dx, d_topk_weights) of the routes to experts first_expert .. + len(w13) only, for
    loss = <y, dy>, one expert at a time, each expert's graph freed before the next (a rank may hold
    hundreds of experts). Summed over the ranks' shares: the layer's."""
    x, topk_weights = x.float().requires_grad_(), topk_weights.float().requires_grad_()
    x.grad, topk_weights.grad = torch.zeros_like(x), torch.zeros_like(topk_weights)  # backward adds to them
    y = torch.zeros_like(x)
    for e in range(len(w13)):
        tokens, slot = (topk_ids == first_expert + e).nonzero(as_tuple=True)
        if tokens.numel():
            o = swiglu(x[tokens] @ w13[e].float().T) @ w2[e].float().T
            share = topk_weights[tokens, slot, None] * o
            share.backward(dy[tokens].float())
            y.index_add_(0, tokens, share.detach())
    return y, x.grad, topk_weights.grad


def reference(x, topk_ids, topk_weights, dy, w13, w2, group=None):
    """(y, dx, d_topk_weights) in fp32 of this rank's tokens (x [n, H] and the rest: its first n), by
    reference_share: every rank's tokens gathered to every rank, each rank computes its experts' share,
    the shares summed with all_reduce (no rank needs another's weights)."""
    P, rank, n = dist.get_world_size(group), dist.get_rank(group), x.shape[0]

    def gather(t):
        out = t.new_empty((P * n,) + tuple(t.shape[1:]))
        dist.all_gather_into_tensor(out, t.contiguous(), group=group)
        return out

    shares = reference_share(*map(gather, (x, topk_ids, topk_weights, dy)), w13.detach(), w2.detach(), rank * len(w13))
    total = torch.cat(shares, 1)
    dist.all_reduce(total, group=group)
    H = x.shape[1]
    return total[rank * n : (rank + 1) * n].split([H, H, topk_weights.shape[1]], 1)


def relative_l2(got, want):
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def time_interleaved(fns, warmup, reps):
    """Median times of several functions, repetitions interleaved so clock drift hits all alike; each
    repetition's time is the slowest rank's."""
    ms = torch.tensor(interleaved_times(fns, warmup, reps), device="cuda")
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    return [summarize(ms[:, i].tolist()) for i in range(len(fns))]


def run_shape(name, args):
    """Checks and times one catalogue shape on every rank (all call it together); returns its JSON entry."""
    H, I, E, k, T = SHAPES[name]
    P, rank, dev = dist.get_world_size(), dist.get_rank(), torch.device("cuda")
    if E % P:
        return {"shape": name, "skipped": f"{E} experts do not split over {P} ranks"}
    local = E // P
    g = torch.Generator(device=dev).manual_seed(1000 + rank)  # each rank its own experts
    w13 = torch.nn.Parameter(torch.randn(local, 2 * I, H, generator=g, device=dev, dtype=torch.bfloat16) / H**0.5)
    w2 = torch.nn.Parameter(torch.randn(local, H, I, generator=g, device=dev, dtype=torch.bfloat16) / I**0.5)
    x = torch.randn(T, H, generator=g, device=dev, dtype=torch.bfloat16)
    dy = torch.randn(T, H, generator=g, device=dev, dtype=torch.bfloat16)
    ids, weights = routing(T, E, k, args.routing, 100 + rank, dev)
    xl, wl = x.clone().requires_grad_(), weights.clone().requires_grad_()  # the training forwards' leaves

    eager = functools.partial(eager_ep_moe, w13=w13, w2=w2)

    def train(forward):
        xl.grad = wl.grad = w13.grad = w2.grad = None  # fresh gradients: no accumulation timed
        forward(xl, ids, wl).backward(dy)

    checks = {}

    def check(key, got, want, limit):
        checks[key] = {"value": relative_l2(got, want), "limit": limit}

    n = min(CHECK_TOKENS, T)
    ref_y, ref_dx, ref_dw = reference(x[:n], ids[:n], weights[:n], dy[:n], w13, w2)
    with torch.no_grad():
        y_eager = eager(x, ids, weights)
    train(eager)
    dx_eager = xl.grad
    check("eager_y_vs_fp32_reference", y_eager[:n], ref_y, 1e-2)
    check("eager_dx_vs_fp32_reference", dx_eager[:n], ref_dx, 2e-2)
    check("eager_dtopk_weights_vs_fp32_reference", wl.grad[:n], ref_dw, 2e-2)

    moe, pounce_error = None, "pounce does not import" if pounce is None else None
    if pounce is not None:
        try:
            # One rank needs no communicator: the layer on its own GPU.
            moe = pounce.MoE(H, I, E, k, dist.group.WORLD if P > 1 else None, max_tokens=T, device="meta")
            moe.w13, moe.w2 = w13, w2  # the eager's tensors: one copy of the weights feeds both
            with torch.no_grad():
                check("pounce_y_vs_eager", moe(x, ids, weights), y_eager, 1e-2)
            train(moe)
            moe.check_device_errors()
            check("pounce_dx_vs_eager", xl.grad, dx_eager, 2e-2)
        except Exception as e:  # noqa: BLE001  (recorded; the eager baseline still runs)
            pounce_error = f"{type(e).__name__}: {e}"
        ok = torch.tensor([pounce_error is None], device=dev, dtype=torch.int32)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if not ok.item():  # every rank drops pounce when one failed, so all call the same collectives
            moe, pounce_error = None, pounce_error or "failed on another rank"
            checks = {key: c for key, c in checks.items() if not key.startswith("pounce")}
    del y_eager, dx_eager
    values = torch.tensor([c["value"] for c in checks.values()], device=dev, dtype=torch.float64)
    dist.all_reduce(torch.nan_to_num_(values, nan=math.inf), op=dist.ReduceOp.MAX)  # the worst rank's
    for c, v in zip(checks.values(), values.tolist()):
        c.update(value=v, passed=v < c["limit"])

    fns = {"eager_forward": torch.no_grad()(lambda: eager(x, ids, weights))}
    if moe is not None:
        fns["pounce_forward"] = torch.no_grad()(lambda: moe(x, ids, weights))
    fns["eager_forward_backward"] = lambda: train(eager)
    if moe is not None:
        fns["pounce_forward_backward"] = lambda: train(moe)
    times = dict(zip(fns, time_interleaved(list(fns.values()), args.warmup, args.reps)))

    # routes[s][d]: routes from rank s's tokens to rank d's experts. A rank sends the rows of its routes
    # to other ranks and receives them back, and receives the other ranks' rows and sends them back.
    routes = torch.empty(P * P, dtype=torch.int64, device=dev)
    dist.all_gather_into_tensor(routes, torch.bincount(ids.view(-1).long() // local, minlength=P))
    routes = routes.view(P, P).tolist()
    routes_in = [sum(row[d] for row in routes) for d in range(P)]
    bytes_each_way = [2 * H * (sum(routes[r]) + routes_in[r] - 2 * routes[r][r]) for r in range(P)]
    for key, t in times.items():
        flops = (6 if key.endswith("forward") else 18) * T * k * H * I  # the average rank's routes
        t["tflops_per_gpu"] = flops / (t["median_ms"] * 1e-3) / 1e12
        if key.endswith("forward"):
            t["nvlink_gbps_each_way_per_rank"] = [b / (t["median_ms"] * 1e-3) / 1e9 for b in bytes_each_way]
    entry = {
        "shape": name,
        "hidden": H,
        "intermediate": I,
        "experts": E,
        "experts_per_rank": local,
        "topk": k,
        "tokens_per_rank": T,
        "routes_received_per_rank": routes_in,
        "nvlink_bytes_each_way_per_rank": bytes_each_way,
        **times,
        "pounce_error": pounce_error,
        "checks": checks,
    }
    if moe is not None:
        for key in ("forward", "forward_backward"):
            entry[f"{key}_ratio_pounce_over_eager"] = (
                times[f"pounce_{key}"]["median_ms"] / times[f"eager_{key}"]["median_ms"]
            )
        moe.check_device_errors()
        moe.close()  # collective: every rank, same order
    return entry


TABLE_HEADER = (
    f"{'':18s} {'forward ms':^25s} | {'forward + backward ms':^25s} | {'TFLOP/s/GPU':^13s} | {'NVLink GB/s':^15s} |\n"
    f"{'shape':18s} {'eager':>9s} {'pounce':>9s} {'p/e':>5s} | {'eager':>9s} {'pounce':>9s} {'p/e':>5s} | "
    f"{'eager':>6s} {'pounce':>6s} | {'eager':>7s} {'pounce':>7s} | checks"
)


def print_row(e):
    """A row of TABLE_HEADER's table: median milliseconds, pounce's over the eager's, forward TFLOP/s per
    GPU, forward NVLink GB/s each way (mean over ranks); '-' where pounce did not run."""
    if "skipped" in e:
        print(f"{e['shape']:18s} skipped: {e['skipped']}", flush=True)
        return

    def col(key, fmt, field="median_ms"):
        if key not in e:
            return "-".rjust(len(format(0.0, fmt)))
        value = e[key] if field is None else e[key][field]
        return format(statistics.mean(value) if isinstance(value, list) else value, fmt)

    failed = [key for key, c in e["checks"].items() if not c["passed"]]
    gbps = "nvlink_gbps_each_way_per_rank"
    cells = [
        f"{e['shape']:18s}",
        *(col(f"{who}_forward", "9.3f") for who in ("eager", "pounce")),
        col("forward_ratio_pounce_over_eager", "5.2f", None),
        "|",
        *(col(f"{who}_forward_backward", "9.3f") for who in ("eager", "pounce")),
        col("forward_backward_ratio_pounce_over_eager", "5.2f", None),
        "|",
        *(col(f"{who}_forward", "6.1f", "tflops_per_gpu") for who in ("eager", "pounce")),
        "|",
        *(col(f"{who}_forward", "7.1f", gbps) for who in ("eager", "pounce")),
        "|",
        "FAILED: " + ", ".join(failed) if failed else "ok",
    ]
    print(" ".join(cells), flush=True)
    if e["pounce_error"]:
        print(f"{'':18s} pounce: {e['pounce_error']}", flush=True)


def environment(P):
    commit = os.environ.get("POUNCE_COMMIT")
    if not commit:
        try:
            git = ["git", "rev-parse", "--short", "HEAD"]
            commit = subprocess.run(git, cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown"
    return {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "world_size": P,
        "git_commit": commit,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "pounce_group": "the default process group" if P > 1 else "none (one rank)",
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="deepseek_v3", help=f"comma list of {', '.join(SHAPES)}, or all")
    parser.add_argument("--routing", choices=("uniform", "zipf"), default="uniform")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--json", help="write the results to this file (rank 0)")
    args = parser.parse_args()
    names = list(SHAPES) if args.shapes == "all" else args.shapes.split(",")
    unknown = [name for name in names if name not in SHAPES]
    if unknown:
        parser.error(f"unknown shapes {unknown}; known: {', '.join(SHAPES)} (or all)")

    local_rank = int(os.environ["LOCAL_RANK"])  # torchrun's; one GPU per rank
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    P, rank = dist.get_world_size(), dist.get_rank()
    result = {
        "environment": environment(P),
        "routing": args.routing,
        "reps": args.reps,
        "warmup": args.warmup,
        "shapes": [],
    }
    if rank == 0:
        print(
            f"{P} ranks, {args.routing} routing, {torch.cuda.get_device_name()}, torch {torch.__version__}; "
            f"pounce {'imported' if pounce else 'not importable'}"
        )
        print(TABLE_HEADER, flush=True)
    for name in names:
        result["shapes"].append(run_shape(name, args))
        torch.cuda.empty_cache()
        if rank == 0:
            print_row(result["shapes"][-1])
            if args.json:  # after every shape: a run cut short keeps what it measured
                with open(args.json, "w") as f:
                    json.dump(result, f, indent=2)
    failed = [
        f"{e['shape']}: {key}" for e in result["shapes"] for key, c in e.get("checks", {}).items() if not c["passed"]
    ]
    # pounce not compared is a failure too: the run would otherwise pass without measuring it.
    failed += [f"{e['shape']}: pounce ({e['pounce_error']})" for e in result["shapes"] if e.get("pounce_error")]
    if rank == 0 and failed:
        print("FAILED checks: " + "; ".join(failed), flush=True)
    dist.destroy_process_group()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

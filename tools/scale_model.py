#!/usr/bin/env python3
"""Scale model: the fused MoE layer against an unfused expert-parallel chain, from measured rates.

Predicts, per rank, the forward time of pounce's fused layer and of an unfused expert-parallel chain
(permute, all-to-all dispatch, grouped GEMMs, all-to-all combine, weighted sum) at EP = 1, 2, 4, 8 inside
one NVLink node and 16, 32, 64 across nodes, for the catalogue's EP shapes: each model's full expert count
split over P GPUs, the slice's tokens on every rank (8192; Qwen3-30B's slice has 16384), top-k, uniform
routing (as `pounce_ep_bench` sets them up). Pure Python 3; matplotlib only for the optional plot.

Inputs. Every rate is read from the committed results, never typed in:
  results/archive/h200/2026-12-01-3fd1262-gpu-check.json (the last full check on one H200, with the fused
  layer's sweeps and the row movers): the grouped GEMMs alone (`grouped_gemms`) and the dense GEMM timed beside
  every group (the clock under the power cap), the HBM copy rate, the row movers' GB/s per CTA by row
  length (`copy`), the unfused chain with the routing planned on the host and on the GPU (their difference
  is the planning time), the fused layer and its sweeps, the dispatch-only probe on virtual ranks;
  results/archive/h200x2/2026-11-29-9718134-{ep,dispatch}.json (two H200s over NVLink): the fused layer at
  EP = 2, and dispatch alone over NCCL against the same on virtual ranks (a CTA's copy rate to a peer
  GPU relative to its own memory, and the latency of the first remote row).
What was not measured is a named parameter with a default, reported as assumed: the NVLink bandwidth per
GPU (only two GPUs were measured, and their communication CTAs, not the links, set the rate), the network
bandwidth and latency, GPUs per node.

Model, per rank (P ranks; uniform routing: a route's expert is on another rank with probability
(P - 1)/P; beyond one node, (P - gpus_per_node)/P of the routes cross the network):
  - GEMMs: FLOPs 6·H·I per padded row (each expert's rows padded to whole 128-row m-blocks), at
    rate = peak · r / (r + r0) of the dense GEMM timed beside, r = rows per expert; peak and r0 are fitted
    to the grouped GEMMs measured alone. A GEMM CTA runs at rate / SMs, so the communication CTAs take
    their share of the GPU from the GEMMs.
  - Communication: dispatch brings every route's row (H·2 bytes) into the expert rank's ring and combine
    pushes every output row back (local routes through HBM, remote ones over NVLink or the network). Time =
    bytes · the slowest of: the comm CTAs' copy rate (per-CTA rate by row length, measured alone, times a
    fitted factor for copying beside running GEMMs; a copy to a peer GPU runs at the measured NVLink factor
    of it; rows over the network move by the NIC, not by CTAs), the GPU's HBM (all virtual ranks share
    it), the NVLink bandwidth, the network bandwidth; plus a latency per phase.
  - Fused layer: planning + opening (the first minibatch pulled by every CTA of the rank) + max(GEMMs,
    communication + the last minibatch's GEMMs) + the last minibatch's combine + the weighted sums (an
    HBM pass: k rows read and one written per token, after the last GEMM tile) + one fitted overhead.
    At one rank the ring holds every row (in place): nothing is combined, and the communication CTAs take
    GEMM tiles once dispatch is done. The tool picks the comm-CTA count that minimizes the predicted
    time, and the minibatch from the wave model (planner/wave_model.h: two waves of GEMM1 tiles over the
    GEMM CTAs).
  - Unfused chain: planning + permute (an HBM pass: every routed row read, the padded layout written) +
    dispatch all-to-all + GEMMs on every SM + combine all-to-all + weighted sums + one fitted overhead.
    Each all-to-all is credited with the full link bandwidth and lands rows already grouped by expert,
    so the chain's predicted time is on its fast side and the fused layer's predicted lead is not
    flattered.
  - Backward (from the rows a training forward kept; a training step is the forward and it): the fused
    kernel moves the forward's bytes (dy rows pulled, dx rows pushed and summed unweighted), its GEMM CTAs
    run the data-gradient GEMMs (the forward's FLOPs, at the ratio of their measured rate to the forward
    GEMMs', each against the dense GEMM timed beside it) and the SwiGLU backward (12·I bytes per padded
    row through HBM); with more ranks the communication CTAs also pull every routed row's x again (the
    bounded ring kept none: an all-to-all's bytes more in the kernel's stream, beside its GEMMs); then the
    weight-gradient GEMMs run on every SM (their measured ratio too). The
    unfused chain's backward: dy permuted and sent, the data-gradient GEMMs and the SwiGLU backward pass,
    dx sent back and summed, the weight-gradient GEMMs (its forward kept the x rows it dispatched).
    Ratios from results/archive/h200/2026-12-01-8ddb9c5-gpu-check.json; one fitted overhead each.
  - Clocks: a prediction for a timed group uses the dense GEMM rate measured in that group; predictions
    for EP sizes use the median of the one-GPU forward groups' dense rates.

Calibration: the GEMM curve on the grouped GEMMs; the unfused overhead on the one-GPU unfused chains; the
copy factor beside GEMMs and the fused overhead on the one-GPU fused forwards and sweeps; the two backward
overheads on the one-GPU backwards (fused kernel and chain of kernels, every shape). Virtual ranks
P = 2, 4, 8 (their rows move through HBM: modelled with the HBM copy rates), the dispatch probe, and EP = 2
across two GPUs are not fitted: they check the model. The report states the error against every point.

Usage: tools/scale_model.py [--json PATH] [--png PATH] [--nvlink-gbps 450] [--net-gbps 50] ...
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The last full check on one H200 (with the sweeps and row-mover runs the model reads).
RESULTS = ROOT / "results" / "archive" / "h200" / "2026-12-01-3fd1262-gpu-check.json"
EP_RESULTS = ROOT / "results" / "archive" / "h200x2" / "2026-11-29-9718134-ep.json"
EP_DISPATCH = ROOT / "results" / "archive" / "h200x2" / "2026-11-29-9718134-dispatch.json"
# The backward on one H200: both backwards from kept rows (the fused kernel and the chain of kernels), and
# the forward's and the backward's grouped GEMMs alone, each timed beside the dense GEMM.
BACKWARD_RESULTS = ROOT / "results" / "archive" / "h200" / "2026-12-01-8ddb9c5-gpu-check.json"

BLOCK_M, BLOCK_N = 128, 256  # the GEMM tile and m-block (src/common/tiles.h)
EP_SIZES = (1, 2, 4, 8, 16, 32, 64)
HEADLINE = ("deepseek_v3", 8)
PROBE_CTAS = 12  # communication CTAs per rank of the copy and dispatch benchmarks

# What the model claims: every measured point of a group lies within this relative error of its
# prediction (python/tests/test_scale_model.py checks it; docs/scale_model.md quotes it).
STATED_ERROR = {
    "grouped GEMMs, one GPU": 0.07,
    "forward, one GPU": 0.07,
    "sweeps, one GPU": 0.11,
    "virtual ranks P = 2, 4, 8, one GPU": 0.07,
    "dispatch probe, virtual ranks, one GPU": 0.10,
    "EP = 2, two GPUs": 0.04,
    "backward, one GPU": 0.08,
}
OUTSIDE = "outside the model"  # measured settings the model does not describe (listed, not claimed)


# ----------------------------------------------------------------------------------------------------
# Inputs


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    intermediate: int
    model_experts: int
    topk: int
    slice_experts: int
    slice_tokens: int


@dataclass(frozen=True)
class Fabric:
    """Rates that were not measured: assumptions, reported as such."""

    nvlink_gbps: float = 450.0  # per GPU and direction: NVLink 4's 18 links of 25 GB/s (H200 SXM)
    net_gbps: float = 50.0  # per GPU and direction: one 400 Gb/s NIC per GPU
    net_latency_us: float = 20.0  # per communication phase across nodes
    gpus_per_node: int = 8


@dataclass(frozen=True)
class Fit:
    """The fitted constants (their defaults are placeholders until calibrate() runs)."""

    gemm_peak: float = 1.0  # GEMM rate on padded rows, as a fraction of the dense GEMM, many rows per expert
    gemm_r0: float = 0.0  # rows per expert at which the GEMM runs at half of gemm_peak
    comm_eff: float = 1.0  # a comm CTA's copy rate beside running GEMMs over its rate alone
    overhead_fused_ms: float = 0.0
    overhead_unfused_ms: float = 0.0
    overhead_backward_fused_ms: float = 0.0
    overhead_backward_unfused_ms: float = 0.0


def dense_tflops(timings: list[dict]) -> float:
    """The dense 8192^3 GEMM timed in a group: the group's clock."""
    row = next(t for t in timings if t["impl"] == "cublas dense 8192^3")
    return 2 * 8192**3 / (row["timing"]["median_ms"] * 1e-3) / 1e12


def median_ms(timings: list[dict], impl: str) -> float:
    return next(t for t in timings if t["impl"] == impl)["timing"]["median_ms"]


def interpolate(points: list[tuple[float, float]], x: float) -> float:
    """Linear in x between measured points, flat beyond them."""
    points = sorted(points)
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1]


class Measured:
    """Every measured input, read from the committed JSON, with where each came from."""

    def __init__(
        self,
        results: Path = RESULTS,
        ep: Path = EP_RESULTS,
        ep_dispatch: Path = EP_DISPATCH,
        backward: Path = BACKWARD_RESULTS,
    ):
        self.paths = {"one_gpu": results, "ep": ep, "ep_dispatch": ep_dispatch, "backward": backward}
        doc = json.loads(results.read_text())
        self.doc, self.ep = doc, json.loads(ep.read_text())
        self.ep_dispatch = json.loads(ep_dispatch.read_text())
        bench = doc["bench_uniform"]
        self.commit = doc["git_commit"]
        self.gpu = doc["gpu"]
        self.sms = bench["environment"]["multiprocessors"]
        self.hbm_gbps = bench["ceilings"]["hbm_copy_4GiB_gbps"]  # read + write bytes per second
        self.bench_shapes = {s["shape"]: s for s in bench["shapes"]}
        self.shapes = {
            s["shape"]: Shape(
                s["shape"],
                s["hidden"],
                s["intermediate"],
                s["model_experts"],
                s["topk"],
                s["local_experts"],
                s["tokens"],
            )
            for s in bench["shapes"]
        }
        forwards = [s["forward"] for s in bench["shapes"]]
        # Predictions outside any timed group run at the median clock of the one-GPU forward groups.
        self.dense_ref_tflops = statistics.median(dense_tflops(f) for f in forwards)
        # Planning on the GPU: the unfused chain with the device schedule against the host schedule,
        # median over the shapes (single differences are within run-to-run noise).
        self.plan_ms = max(
            0.0,
            statistics.median(
                median_ms(f, "pounce_unfused, device schedule") - median_ms(f, "pounce_unfused") for f in forwards
            ),
        )
        self.copy_runs = doc["copy"]["runs"]
        # NVLink against HBM for a comm CTA: dispatch alone with 12 CTAs per rank at P = 2, over NCCL (half
        # the rows from the peer GPU) against virtual ranks (every row from this GPU's memory).
        rows = self.ep_dispatch["rows"]
        pull = {r["transport"]: r for r in rows if r["mode"] == "pull" and r["ranks"] == 2}
        local = pull["virtual"]["gbps_per_gpu"] / pull["virtual"]["ranks"]  # per rank, on one GPU
        mixed = pull["nccl"]["gbps_per_gpu"]
        remote_share = pull["nccl"]["bytes_from_other_ranks"] / pull["nccl"]["bytes_moved"]
        remote = remote_share / (1 / mixed - (1 - remote_share) / local)
        self.nvlink_cta_factor = remote / local
        self.nvlink_latency_ms = (
            pull["nccl"]["first_tile_us_slowest_rank"] - pull["virtual"]["first_tile_us_slowest_rank"]
        ) * 1e-3
        # The backward: its GEMMs against the forward's, each GEMM's time over the dense GEMM timed beside
        # it (the clocks cancel). The data gradients have the forward's FLOPs, the weight gradients as many.
        bwd = json.loads(backward.read_text())
        self.backward_commit = bwd["git_commit"]
        self.backward_shapes = {s["shape"]: s for s in bwd["bench_uniform"]["shapes"]}
        self.dgrad_factor, self.wgrad_factor = {}, {}
        for name, s in self.backward_shapes.items():
            g, b = s["grouped_gemms"], s["backward_gemms"]

            def in_dense(rows: list[dict], impl: str = "pounce") -> float:
                return median_ms(rows, impl) / median_ms(rows, "cublas dense 8192^3")

            forward = in_dense(g["gemm1_gate_up"], "pounce (SwiGLU fused)") + in_dense(g["gemm2_down"])
            self.dgrad_factor[name] = (in_dense(b["dgrad_down"]) + in_dense(b["dgrad_gate_up"])) / forward
            self.wgrad_factor[name] = (in_dense(b["wgrad_down"]) + in_dense(b["wgrad_gate_up"])) / forward

    def cta_gbps(self, row_bytes: int, engine_rows: int, ctas: int = PROBE_CTAS) -> float:
        """GB/s one comm CTA moves (with `ctas` CTAs copying), by row length and bulk-engine rows."""
        by_row: dict[int, list[tuple[float, float]]] = {}
        for r in self.copy_runs:
            if r["ctas"] == ctas:
                by_row.setdefault(r["row_bytes"], []).append((r["engine_rows"], r["gbps"] / ctas))
        return interpolate([(rb, interpolate(pts, engine_rows)) for rb, pts in by_row.items()], row_bytes)

    def gpu_copy_gbps(self, row_bytes: int, engine_rows: int) -> float:
        """GB/s of rows every SM of the GPU moves together: what HBM allows row copies."""
        return self.cta_gbps(row_bytes, engine_rows, self.sms) * self.sms

    def inputs(self) -> dict:
        """The measured inputs as reported (name: value, source)."""
        first = f"{self.paths['one_gpu'].resolve().relative_to(ROOT)} ({self.gpu}, commit {self.commit})"
        backward = f"{self.paths['backward'].resolve().relative_to(ROOT)} (commit {self.backward_commit})"
        two = "results/archive/h200x2/2026-11-29-9718134-dispatch.json (two H200s, commit 9718134)"
        return {
            "sms": (self.sms, first + ": bench_uniform.environment.multiprocessors"),
            "dense_ref_tflops": (
                self.dense_ref_tflops,
                first + ": median of the dense GEMM timed in each shape's forward group",
            ),
            "hbm_copy_gbps": (self.hbm_gbps, first + ": bench_uniform.ceilings.hbm_copy_4GiB_gbps (read + write)"),
            "plan_ms": (self.plan_ms, first + ": median over shapes of unfused device-schedule minus host-schedule ms"),
            "cta_copy_gbps_4k_8k_14k": (
                [self.cta_gbps(rb, min(rb // 224, 128)) for rb in (4096, 8192, 14336)],
                first + ": copy.runs with 12 CTAs at the layer's engine rows (H*2/224), per CTA",
            ),
            "gpu_copy_gbps_4k_8k_14k": (
                [self.gpu_copy_gbps(rb, min(rb // 224, 128)) for rb in (4096, 8192, 14336)],
                first + ": copy.runs with every SM copying",
            ),
            "nvlink_cta_factor": (self.nvlink_cta_factor, two + ": pull over NCCL against virtual ranks at P = 2"),
            "nvlink_latency_ms": (
                self.nvlink_latency_ms,
                two + ": first tile over NCCL minus on virtual ranks at P = 2",
            ),
            "dgrad_over_forward_gemms": (
                [self.dgrad_factor[s] for s in sorted(self.dgrad_factor)],
                backward + ": backward_gemms dgrad / grouped_gemms, each over its dense GEMM, shapes by name",
            ),
            "wgrad_over_forward_gemms": (
                [self.wgrad_factor[s] for s in sorted(self.wgrad_factor)],
                backward + ": backward_gemms wgrad / grouped_gemms, each over its dense GEMM, shapes by name",
            ),
        }


# ----------------------------------------------------------------------------------------------------
# The model


def wave_minibatch_rows(gemm_ctas: int, intermediate: int, waves: int = 2) -> int:
    """planner/wave_model.h: enough rows for `waves` GEMM1 tiles per GEMM CTA, whole m-blocks."""
    tiles_per_block = -(-2 * intermediate // BLOCK_N)
    rows = -(-waves * gemm_ctas * BLOCK_M // tiles_per_block)
    return -(-rows // BLOCK_M) * BLOCK_M


@dataclass(frozen=True)
class Case:
    """One rank's forward: `ranks` ranks, each with `tokens` tokens, `experts` split over them."""

    shape: Shape
    ranks: int
    tokens: int
    experts: int
    virtual: bool = False  # every rank on one GPU (rows move through HBM) instead of one rank per GPU
    dense_tflops: float | None = None  # the timed group's clock; None: the reference clock
    comm_ctas: int | None = None  # None: the count that minimizes the predicted time
    minibatch_rows: int | None = None  # None: the wave model
    engine_rows: int | None = None  # None: the layer's default
    padded_rows: float | None = None  # per rank; None: half an m-block of padding per expert
    in_place: bool | None = None  # None: at one rank
    host_schedule: bool = False  # unfused chain: routing planned on the host, outside the timing

    @property
    def local_experts(self) -> int:
        return self.experts // self.ranks

    @property
    def routes(self) -> int:  # routed rows a rank receives (uniform routing), and its own routes
        return self.tokens * self.shape.topk

    @property
    def rows_per_expert(self) -> float:
        return self.routes / self.local_experts

    @property
    def padded(self) -> float:
        if self.padded_rows is not None:
            return self.padded_rows
        return self.local_experts * (self.rows_per_expert + BLOCK_M / 2)

    @property
    def row_bytes(self) -> int:
        return 2 * self.shape.hidden

    @property
    def flops_per_row(self) -> float:
        return 6.0 * self.shape.hidden * self.shape.intermediate

    @property
    def engine(self) -> int:
        return self.engine_rows if self.engine_rows is not None else min(self.row_bytes // 224, BLOCK_M)


class Model:
    def __init__(self, measured: Measured, fabric: Fabric = Fabric(), fit: Fit = Fit()):
        self.m, self.fabric, self.fit = measured, fabric, fit

    # -- pieces

    def ctas_per_rank(self, case: Case) -> int:
        return self.m.sms // case.ranks if case.virtual else self.m.sms

    def route_split(self, case: Case) -> tuple[float, float, float]:
        """Shares of a rank's routes whose rows stay on its GPU, cross NVLink, cross the network."""
        P, node = case.ranks, self.fabric.gpus_per_node
        if case.virtual:
            return 1.0, 0.0, 0.0
        if P <= node:
            return 1 / P, (P - 1) / P, 0.0
        return 1 / P, (node - 1) / P, (P - node) / P

    def latency_ms(self, case: Case) -> float:
        if case.virtual or case.ranks == 1:
            return 0.0
        if case.ranks <= self.fabric.gpus_per_node:
            return self.m.nvlink_latency_ms
        return self.fabric.net_latency_us * 1e-3

    def gemm_fraction(self, case: Case) -> float:
        r = case.rows_per_expert
        return self.fit.gemm_peak * r / (r + self.fit.gemm_r0)

    def gemm_ms(self, case: Case, rows: float, ctas: float) -> float:
        """`rows` padded rows on `ctas` GEMM CTAs: each CTA runs at 1/SMs of the GPU's GEMM rate."""
        dense = case.dense_tflops or self.m.dense_ref_tflops
        rate = self.gemm_fraction(case) * dense * 1e12 * ctas / self.m.sms
        return rows * case.flops_per_row / rate * 1e3

    def ms_per_byte(self, case: Case, ctas: int, eff: float) -> float:
        """Milliseconds per byte of rows a rank's `ctas` CTAs move: the slowest resource decides."""
        local, nvlink, network = self.route_split(case)
        per_cta = self.m.cta_gbps(case.row_bytes, case.engine) * 1e9 * eff
        # Rows over the network are moved by the NIC (GPU-initiated puts), not copied by the CTAs.
        limits = [(local + nvlink / self.m.nvlink_cta_factor) / (ctas * per_cta)]
        # Every virtual rank copies at once through the one GPU's memory.
        sharers = case.ranks if case.virtual else 1
        limits.append(sharers / (self.m.gpu_copy_gbps(case.row_bytes, case.engine) * 1e9))
        if nvlink:
            limits.append(nvlink / (self.fabric.nvlink_gbps * 1e9))
        if network:
            limits.append(network / (self.fabric.net_gbps * 1e9))
        return max(limits) * 1e3

    def sums_ms(self, case: Case) -> float:
        """Weighted sums: per token k rows read and one written, an HBM pass (all virtual ranks share it)."""
        tokens = case.tokens * (case.ranks if case.virtual else 1)
        return tokens * (case.shape.topk + 1) * case.row_bytes / (self.m.hbm_gbps * 1e9) * 1e3

    def swiglu_backward_ms(self, case: Case, ctas: float) -> float:
        """The SwiGLU backward of every padded row (da and the kept gate/up values read, dgu and w·a
        written: 12·I bytes) at the HBM rate of `ctas` SMs' share."""
        bytes_ = case.padded * 12 * case.shape.intermediate
        return bytes_ / (self.m.hbm_gbps * 1e9 * ctas / self.m.sms) * 1e3

    def alltoall_ms(self, case: Case) -> float:
        """One all-to-all of the unfused chain: every remote row at the full link rate, local rows in HBM."""
        local, nvlink, network = self.route_split(case)
        bytes_ = case.routes * case.row_bytes
        ms = [2 * local * bytes_ / (self.m.hbm_gbps * 1e9) * 1e3]
        if nvlink:
            ms.append(nvlink * bytes_ / (self.fabric.nvlink_gbps * 1e9) * 1e3)
        if network:
            ms.append(network * bytes_ / (self.fabric.net_gbps * 1e9) * 1e3)
        return max(ms) + self.latency_ms(case)

    # -- the two forwards, and their backwards from kept rows

    def fused(self, case: Case, backward: bool = False) -> dict:
        """The fused layer's predicted time and phases, at the case's comm CTAs or the best count.
        backward: its backward from kept rows instead. The same kernel with dy rows pulled in and dx rows
        pushed back (the forward's bytes), the data-gradient GEMMs (the forward's FLOPs, at the measured
        ratio of their rate to the forward GEMMs') and the SwiGLU-backward items on the GEMM CTAs, the sums
        unweighted, and with more ranks every routed row's x pulled again in the same stream (the ring
        did not keep them); then the weight gradients' GEMMs on every SM (at their measured ratio)."""
        if case.comm_ctas is None:
            # The fastest count; where the curve is flat (in place it nearly is), the fewest CTAs within
            # 0.2% of it: a prediction cannot separate them, and fewer leave the GEMMs more SMs.
            options = [
                self.fused(replace(case, comm_ctas=c), backward) for c in range(1, self.ctas_per_rank(case) // 2 + 1)
            ]
            fastest = min(o["ms"] for o in options)
            return next(o for o in options if o["ms"] <= fastest * 1.002)
        S, c = self.ctas_per_rank(case), case.comm_ctas
        g = S - c
        mb = case.minibatch_rows or wave_minibatch_rows(g, case.shape.intermediate)
        in_place = case.ranks == 1 if case.in_place is None else case.in_place
        row, routes = case.row_bytes, case.routes
        mb_rows = min(mb, routes)
        per_byte = self.ms_per_byte(case, c, self.fit.comm_eff)
        latency = self.latency_ms(case)
        plan = self.m.plan_ms
        # The opening: every CTA of the rank pulls the first minibatch before any GEMM runs.
        opening = latency + mb_rows * row * self.ms_per_byte(case, S, 1.0)
        gemm_cta_ms = self.gemm_ms(case, case.padded, 1)  # the rank's GEMM work in CTA-milliseconds
        dgrad = self.m.dgrad_factor[case.shape.name] if backward else 1.0
        if backward:
            gemm_cta_ms = gemm_cta_ms * dgrad + self.swiglu_backward_ms(case, 1)
        if in_place:
            comm = (routes - mb_rows) * row * per_byte
            # Once dispatch is done the comm CTAs take GEMM tiles too.
            gemm = gemm_cta_ms / g if comm * g >= gemm_cta_ms else (gemm_cta_ms + c * comm) / S
            last_combine = 0.0
        else:
            # Forward: every row pulled and pushed (the opening's pulled before). Backward: dy pulled, dx
            # pushed, and every row's x pulled for the weight gradients.
            rows_moved = 2 * (routes - mb_rows) + (routes if backward else 0)
            comm = rows_moved * row * per_byte
            gemm = gemm_cta_ms / g
            last_combine = mb_rows * row * per_byte + latency
        last_gemm = self.gemm_ms(case, mb, g) * dgrad  # the last minibatch, after its rows arrived
        main = max(gemm, comm + last_gemm)
        sums = self.sums_ms(case)
        wgrad = self.gemm_ms(case, case.padded, self.m.sms) * self.m.wgrad_factor[case.shape.name] if backward else 0.0
        overhead = self.fit.overhead_backward_fused_ms if backward else self.fit.overhead_fused_ms
        kernel = plan + opening + main + last_combine + sums
        total = kernel + wgrad + overhead
        t0 = plan + opening
        timeline = [
            ("plan (on the GPU)", 0.0, plan),
            ("opening: first minibatch pulled by every CTA", plan, t0),
            ("GEMMs (GEMM CTAs; the last minibatch after its rows)", t0, t0 + main),
            ("dispatch + combine stream (comm CTAs)" if not backward else "dy, x pulls + dx pushes (comm CTAs)",
             t0, t0 + comm),
            ("last minibatch's combine", t0 + main, t0 + main + last_combine),
            ("weighted sums" if not backward else "dx sums", t0 + main + last_combine, kernel),
        ]
        if backward:
            timeline.append(("weight-gradient GEMMs (every SM)", kernel, kernel + wgrad))
        timeline.append(("overhead (fitted)", total - overhead, total))
        return {
            "ms": total,
            "comm_ctas": c,
            "gemm_ctas": g,
            "minibatch_rows": mb,
            "in_place": in_place,
            "phases_ms": {
                "plan": plan,
                "opening": opening,
                "gemm": gemm,
                "comm": comm,
                "last_minibatch_gemm": last_gemm,
                "last_combine": last_combine,
                "sums": sums,
                "weight_gradients": wgrad,
                "overhead": overhead,
            },
            "bound": "communication" if comm + last_gemm > gemm else "GEMM",
            "timeline": timeline,
        }

    def unfused(self, case: Case, backward: bool = False) -> dict:
        """The unfused chain: every phase after the previous one, the GEMMs on every SM. backward: its
        backward from rows the forward kept (x rows and gate/up values, so no planning and no gather of
        x): dy permuted and sent to the experts' ranks, the data-gradient GEMMs with the SwiGLU backward
        between them, dx rows sent back and summed, then the weight-gradient GEMMs."""
        if case.virtual and case.ranks > 1:
            raise ValueError("the unfused chain is modelled one rank per GPU")
        plan = 0.0 if case.host_schedule or backward else self.m.plan_ms
        permute = (case.routes + case.padded) * case.row_bytes / (self.m.hbm_gbps * 1e9) * 1e3
        a2a = self.alltoall_ms(case) if case.ranks > 1 else 0.0
        gemm = self.gemm_ms(case, case.padded, self.m.sms)
        sums = self.sums_ms(case)
        if backward:
            phases = [
                ("dy permute", permute),
                ("dy all-to-all", a2a),
                ("data-gradient GEMMs", gemm * self.m.dgrad_factor[case.shape.name]),
                ("SwiGLU backward", self.swiglu_backward_ms(case, self.m.sms)),
                ("dx all-to-all", a2a),
                ("dx sums", sums),
                ("weight-gradient GEMMs", gemm * self.m.wgrad_factor[case.shape.name]),
                ("overhead (fitted)", self.fit.overhead_backward_unfused_ms),
            ]
        else:
            phases = [
                ("plan", plan),
                ("permute", permute),
                ("dispatch all-to-all", a2a),
                ("GEMM1 + GEMM2", gemm),
                ("combine all-to-all", a2a),
                ("weighted sums", sums),
                ("overhead (fitted)", self.fit.overhead_unfused_ms),
            ]
        timeline, t = [], 0.0
        for name, ms in phases:
            timeline.append((name, t, t + ms))
            t += ms
        return {"ms": t, "phases_ms": dict(phases), "timeline": timeline}

    def dispatch_only(self, case: Case) -> float:
        """The dispatch probe: planning, then every routed row into the ring by PROBE_CTAS CTAs, alone."""
        return (
            self.m.plan_ms
            + self.latency_ms(case)
            + case.routes * case.row_bytes * self.ms_per_byte(case, PROBE_CTAS, 1.0)
        )

    def ep_case(self, shape: Shape, P: int, tokens: int | None = None) -> Case:
        return Case(shape, P, tokens or shape.slice_tokens, shape.model_experts)


# ----------------------------------------------------------------------------------------------------
# Measured points and calibration


@dataclass
class Point:
    group: str
    label: str
    measured_ms: float
    kind: str  # gemms (GEMM1 + GEMM2), fused, unfused, dispatch, backward fused, backward unfused
    case: Case
    role: str = "check"  # fit: used to fit constants; check: not fitted; input: a rate was taken from it
    note: str = ""

    def predict(self, model: Model) -> float:
        if self.kind == "fused":
            return model.fused(self.case)["ms"]
        if self.kind == "unfused":
            return model.unfused(self.case)["ms"]
        if self.kind == "dispatch":
            return model.dispatch_only(self.case)
        if self.kind == "backward fused":
            return model.fused(self.case, backward=True)["ms"]
        if self.kind == "backward unfused":
            return model.unfused(self.case, backward=True)["ms"]
        return model.gemm_ms(self.case, self.case.padded, model.m.sms)  # the two GEMMs on every SM


def one_gpu_case(m: Measured, name: str, dense: float, **kw) -> Case:
    s = m.bench_shapes[name]
    shape = m.shapes[name]
    return Case(
        shape, 1, shape.slice_tokens, shape.slice_experts, dense_tflops=dense, padded_rows=s["padded_rows"], **kw
    )


def layer_kwargs(layer: dict) -> dict:
    return {
        "comm_ctas": layer["comm_ctas"],
        "minibatch_rows": layer["minibatch_rows"],
        "engine_rows": layer["engine_rows"],
    }


def measured_points(m: Measured) -> list[Point]:
    """Every measured point the model is compared with."""
    pts: list[Point] = []
    for name, s in m.bench_shapes.items():
        # The forward's two grouped GEMMs alone: each in its own timed group (GEMM1 has 2/3 of the FLOPs,
        # so the pair runs at the clock 1 / (2/3 / dense1 + 1/3 / dense2)), and back to back in the forward's.
        g1, g2 = s["grouped_gemms"]["gemm1_gate_up"], s["grouped_gemms"]["gemm2_down"]
        pair_dense = 1 / (2 / 3 / dense_tflops(g1) + 1 / 3 / dense_tflops(g2))
        pair_ms = median_ms(g1, "pounce (SwiGLU fused)") + median_ms(g2, "pounce")
        case = one_gpu_case(m, name, pair_dense)
        pts.append(
            Point("grouped GEMMs, one GPU", f"{name} GEMM1 + GEMM2 (grouped_gemms)", pair_ms, "gemms", case, "fit")
        )
        fwd = s["forward"]
        dense = dense_tflops(fwd)
        case = one_gpu_case(m, name, dense)
        label = f"{name} GEMM1 + GEMM2 alone (forward group)"
        pts.append(
            Point("grouped GEMMs, one GPU", label, median_ms(fwd, "pounce GEMM1 + GEMM2 alone"), "gemms", case, "fit")
        )
        # The forward group: fused (default layer) and the unfused chain, both schedules.
        cfg = s["fused_config"]
        fused = one_gpu_case(m, name, dense, **layer_kwargs(cfg))
        pts.append(Point("forward, one GPU", f"{name} fused", median_ms(fwd, "pounce_fused"), "fused", fused, "fit"))
        for impl, host in (("pounce_unfused", True), ("pounce_unfused, device schedule", False)):
            case = one_gpu_case(m, name, dense, host_schedule=host)
            label = f"{name} unfused, {'host' if host else 'device'} schedule"
            pts.append(Point("forward, one GPU", label, median_ms(fwd, impl), "unfused", case, "fit"))
        # The sweeps: each one interleaved group with the unfused chain and the dense GEMM.
        for sweep, group in s.get("fused_sweeps", {}).items():
            groups = group.values() if sweep == "virtual_ranks" else [group]
            for g in groups:
                dense = dense_tflops(g["timings"])
                for layer in g["layers"]:
                    impl = layer["impl"]
                    kw = layer_kwargs(layer)
                    ranks = int(impl[2:]) if sweep == "virtual_ranks" else 1
                    shape = m.shapes[name]
                    case = Case(
                        shape,
                        ranks,
                        shape.slice_tokens // ranks,
                        shape.slice_experts,
                        virtual=True,
                        dense_tflops=dense,
                        padded_rows=s["padded_rows"] / ranks,
                        in_place=ranks == 1 and layer["ring_blocks"] * BLOCK_M >= s["padded_rows"],
                        **kw,
                    )
                    one_wave = wave_minibatch_rows(case_gemm_ctas(m, case), shape.intermediate, waves=1)
                    role, note = "fit", ""
                    if ranks > 1:
                        role = "check"
                    if layer["minibatch_rows"] < one_wave:
                        role, note = OUTSIDE, "minibatch below one wave of GEMM1 tiles"
                    elif not case.in_place and ranks == 1:
                        role, note = OUTSIDE, "ring of two minibatches: dispatch waits for combines"
                    grp = "virtual ranks P = 2, 4, 8, one GPU" if ranks > 1 else "sweeps, one GPU"
                    label = f"{name} {sweep}: {impl}"
                    pts.append(Point(grp, label, median_ms(g["timings"], impl), "fused", case, role, note))
                case = one_gpu_case(m, name, dense, host_schedule=True)
                label = f"{name} {sweep} group: unfused" + (
                    f" ({g['layers'][0]['impl']})" if sweep == "virtual_ranks" else ""
                )
                pts.append(
                    Point("sweeps, one GPU", label, median_ms(g["timings"], "pounce_unfused"), "unfused", case, "fit")
                )
    # The dispatch probe: P virtual ranks of the DeepSeek-V3 EP shape, each with its own 8192 tokens.
    v3 = m.shapes["deepseek_v3"]
    for row in m.doc["dispatch"]["rows"]:
        if row["mode"] != "pull":
            continue
        P = row["ranks"]
        case = Case(v3, P, m.doc["dispatch"]["tokens_per_rank"], m.doc["dispatch"]["experts"], virtual=True)
        pts.append(
            Point(
                "dispatch probe, virtual ranks, one GPU",
                f"dispatch only, P = {P}",
                row["all_ready_us_slowest_rank"] / 1e3,
                "dispatch",
                case,
            )
        )
    # Two GPUs over NVLink: the fused layer at EP = 2, and dispatch alone over NCCL (an input).
    ep = m.ep
    case = Case(
        m.shapes[ep["shape"]],
        ep["gpus"],
        ep["tokens_per_gpu"],
        m.shapes[ep["shape"]].model_experts,
        comm_ctas=ep["comm_ctas"],
    )
    pts.append(
        Point(
            "EP = 2, two GPUs",
            f"{ep['shape']} fused, EP = 2 (commit 9718134)",
            ep["forward_ms_slowest_rank"],
            "fused",
            case,
        )
    )
    for row in m.ep_dispatch["rows"]:
        if row["transport"] == "nccl" and row["mode"] == "pull":
            case = Case(v3, row["ranks"], m.ep_dispatch["tokens_per_rank"], m.ep_dispatch["experts"])
            pts.append(
                Point(
                    "EP = 2, two GPUs",
                    "dispatch only over NCCL, P = 2 (commit 9718134)",
                    row["all_ready_us_slowest_rank"] / 1e3,
                    "dispatch",
                    case,
                    "input",
                    "its NVLink factor and first-row latency are inputs",
                )
            )
    # The backward from kept rows on one GPU, both ways, in its own run (its clock: the dense GEMM timed
    # in its group).
    for name, s in m.backward_shapes.items():
        if name not in m.bench_shapes:
            continue
        case = one_gpu_case(m, name, dense_tflops(s["backward"]))
        for kind, impl in (
            ("backward fused", "pounce backward, from the kept forward, fused kernel"),
            ("backward unfused", "pounce backward, from the kept forward"),
        ):
            label = f"{name} {'fused kernel' if kind == 'backward fused' else 'chain of kernels'}"
            pts.append(Point("backward, one GPU", label, median_ms(s["backward"], impl), kind, case, "fit"))
    return pts


def case_gemm_ctas(m: Measured, case: Case) -> int:
    per_rank = m.sms // case.ranks if case.virtual else m.sms
    return per_rank - (case.comm_ctas or 0)


def least_squares_offset(preds: list[float], meas: list[float]) -> float:
    """The constant c >= 0 minimizing sum(((p + c - m) / m)^2)."""
    num = sum((m_ - p) / m_**2 for p, m_ in zip(preds, meas))
    den = sum(1 / m_**2 for m_ in meas)
    return max(0.0, num / den)


def rms_relative(preds: list[float], meas: list[float]) -> float:
    return math.sqrt(sum(((p - m_) / m_) ** 2 for p, m_ in zip(preds, meas)) / len(meas))


def calibrate(measured: Measured, fabric: Fabric = Fabric()) -> tuple[Model, list[Point]]:
    """Fits the seven constants on the one-GPU points (least squares of relative errors)."""
    pts = measured_points(measured)
    fit_pts = [p for p in pts if p.role == "fit"]
    gemm = [p for p in fit_pts if p.kind == "gemms"]
    unfused = [p for p in fit_pts if p.kind == "unfused"]
    fused = [p for p in fit_pts if p.kind == "fused"]

    # GEMM curve: for each r0 the best peak is the geometric mean of predicted (at peak 1) / measured.
    best = None
    for r0 in range(0, 2001, 5):
        model = Model(measured, fabric, Fit(gemm_r0=float(r0)))
        ratios = [p.predict(model) / p.measured_ms for p in gemm]
        peak = math.exp(statistics.fmean(math.log(x) for x in ratios))
        model = Model(measured, fabric, Fit(gemm_peak=peak, gemm_r0=float(r0)))
        err = rms_relative([p.predict(model) for p in gemm], [p.measured_ms for p in gemm])
        if best is None or err < best[0]:
            best = (err, peak, float(r0))
    fit = Fit(gemm_peak=best[1], gemm_r0=best[2])

    # The unfused chain's one constant.
    model = Model(measured, fabric, fit)
    fit = replace(
        fit,
        overhead_unfused_ms=least_squares_offset([p.predict(model) for p in unfused], [p.measured_ms for p in unfused]),
    )

    # The comm CTAs' copy factor beside GEMMs, and the fused layer's constant for each factor.
    best = None
    for i in range(20, 101):
        trial = replace(fit, comm_eff=i / 100)
        model = Model(measured, fabric, trial)
        preds = [p.predict(model) for p in fused]
        meas = [p.measured_ms for p in fused]
        offset = least_squares_offset(preds, meas)
        err = rms_relative([x + offset for x in preds], meas)
        if best is None or err < best[0]:
            best = (err, replace(trial, overhead_fused_ms=offset))

    # The backwards' constants, with everything else fixed.
    fit = best[1]
    model = Model(measured, fabric, fit)
    offsets = {}
    for kind in ("backward fused", "backward unfused"):
        group = [p for p in fit_pts if p.kind == kind]
        offsets[kind] = least_squares_offset([p.predict(model) for p in group], [p.measured_ms for p in group])
    fit = replace(
        fit,
        overhead_backward_fused_ms=offsets["backward fused"],
        overhead_backward_unfused_ms=offsets["backward unfused"],
    )
    return Model(measured, fabric, fit), pts


def errors(model: Model, pts: list[Point]) -> list[dict]:
    rows = []
    for p in pts:
        pred = p.predict(model)
        rows.append(
            {
                "group": p.group,
                "point": p.label,
                "role": p.role,
                "note": p.note,
                "measured_ms": p.measured_ms,
                "predicted_ms": pred,
                "relative_error": (pred - p.measured_ms) / p.measured_ms,
            }
        )
    return rows


def group_errors(rows: list[dict]) -> dict[str, dict]:
    """Per group: points, max and median |relative error| of the points the model claims."""
    out: dict[str, dict] = {}
    for r in rows:
        if r["role"] in (OUTSIDE, "input"):
            continue
        out.setdefault(r["group"], []).append(abs(r["relative_error"]))
    return {
        g: {"points": len(v), "max": max(v), "median": statistics.median(v), "stated": STATED_ERROR.get(g)}
        for g, v in out.items()
    }


# ----------------------------------------------------------------------------------------------------
# Predictions and output


def predictions(model: Model, tokens: int | None = None) -> list[dict]:
    out = []
    for shape in model.m.shapes.values():
        for P in EP_SIZES:
            if shape.model_experts % P:
                continue  # the experts do not split over P GPUs
            case = model.ep_case(shape, P, tokens)
            fused, unfused = model.fused(case), model.unfused(case)
            fused_bwd, unfused_bwd = model.fused(case, backward=True), model.unfused(case, backward=True)
            step_fused, step_unfused = fused["ms"] + fused_bwd["ms"], unfused["ms"] + unfused_bwd["ms"]
            out.append(
                {
                    "shape": shape.name,
                    "ep": P,
                    "nodes": max(1, P // model.fabric.gpus_per_node),
                    "tokens_per_rank": case.tokens,
                    "local_experts": case.local_experts,
                    "rows_per_expert": case.rows_per_expert,
                    "fused_ms": fused["ms"],
                    "unfused_ms": unfused["ms"],
                    "unfused_over_fused": unfused["ms"] / fused["ms"],
                    "comm_ctas": fused["comm_ctas"],
                    "minibatch_rows": fused["minibatch_rows"],
                    "fused_bound": fused["bound"],
                    "fused_phases_ms": fused["phases_ms"],
                    "unfused_phases_ms": unfused["phases_ms"],
                    "backward_fused_ms": fused_bwd["ms"],
                    "backward_unfused_ms": unfused_bwd["ms"],
                    "training_step_fused_ms": step_fused,
                    "training_step_unfused_ms": step_unfused,
                    "training_step_unfused_over_fused": step_unfused / step_fused,
                    "backward_fused_phases_ms": fused_bwd["phases_ms"],
                    "backward_unfused_phases_ms": unfused_bwd["phases_ms"],
                }
            )
    return out


def headline(model: Model, rows: list[dict], tokens: int | None = None) -> dict:
    name, P = HEADLINE
    case = model.ep_case(model.m.shapes[name], P, tokens)
    fused, unfused = model.fused(case), model.unfused(case)
    fused_bwd, unfused_bwd = model.fused(case, backward=True), model.unfused(case, backward=True)
    # The one assumption that moves it most: the NVLink bandwidth (only two GPUs were measured).
    half = Model(model.m, replace(model.fabric, nvlink_gbps=model.fabric.nvlink_gbps / 2), model.fit)
    f2, u2 = half.fused(case), half.unfused(case)
    return {
        "shape": name,
        "ep": P,
        "fused": fused,
        "unfused": unfused,
        "unfused_over_fused": unfused["ms"] / fused["ms"],
        "backward_fused": fused_bwd,
        "backward_unfused": unfused_bwd,
        "training_step_unfused_over_fused": (unfused["ms"] + unfused_bwd["ms"]) / (fused["ms"] + fused_bwd["ms"]),
        "error": headline_error(rows),
        "at_half_nvlink": {
            "nvlink_gbps": half.fabric.nvlink_gbps,
            "fused_ms": f2["ms"],
            "unfused_ms": u2["ms"],
            "unfused_over_fused": u2["ms"] / f2["ms"],
        },
    }


def headline_error(rows: list[dict]) -> dict:
    """The error stated for a forward at EP scale: the stated bound of the forward groups (every shape),
    and the worst error on the headline shape's own forwards (one GPU, fused and unfused; EP = 2)."""
    groups = ("forward, one GPU", "EP = 2, two GPUs")
    own = [r["relative_error"] for r in rows if r["group"] in groups and r["point"].startswith(HEADLINE[0] + " ")]
    return {"stated": max(STATED_ERROR[g] for g in groups), "shape_worst": max(own, key=abs), "shape_points": len(own)}


def report(model: Model, rows: list[dict], groups: dict, preds: list[dict], head: dict) -> str:
    m, fab, fit = model.m, model.fabric, model.fit
    out = ["pounce scale model: the fused layer against an unfused expert-parallel chain, forward and backward", ""]
    add = out.append
    add("Measured inputs:")
    for k, (v, src) in m.inputs().items():
        val = ", ".join(f"{x:.4g}" for x in v) if isinstance(v, list) else f"{v:.4g}"
        add(f"  {k} = {val}  [{src}]")
    add("Assumed, not measured (options):")
    add(f"  NVLink {fab.nvlink_gbps:g} GB/s per GPU per direction (--nvlink-gbps)")
    add(f"  network {fab.net_gbps:g} GB/s per GPU per direction (--net-gbps)")
    add(f"  network latency {fab.net_latency_us:g} us per phase (--net-latency-us)")
    add(f"  {fab.gpus_per_node} GPUs per node (--gpus-per-node)")
    add("Fitted on one GPU:")
    add(f"  GEMM rate = {fit.gemm_peak:.3f} x dense x r / (r + {fit.gemm_r0:.0f}), r rows per expert, on padded rows")
    add(f"  comm CTA copy rate beside GEMMs = {fit.comm_eff:.2f} x its rate alone")
    add(f"  overhead: fused {fit.overhead_fused_ms:.3f} ms, unfused {fit.overhead_unfused_ms:.3f} ms")
    add(
        f"  backward overhead: fused {fit.overhead_backward_fused_ms:.3f} ms, "
        f"unfused {fit.overhead_backward_unfused_ms:.3f} ms"
    )
    add("")
    add("Error against every measured point (relative: predicted / measured - 1):")
    add(f"  {'group':<40} {'point':<58} {'measured':>9} {'predicted':>9} {'error':>7}")
    for r in rows:
        tag = "" if r["role"] in ("fit", "check") else f"  [{r['role']}{': ' + r['note'] if r['note'] else ''}]"
        numbers = f"{r['measured_ms']:9.3f} {r['predicted_ms']:9.3f} {r['relative_error']:+7.1%}"
        add(f"  {r['group']:<40} {r['point']:<58} {numbers}{tag}")
    add("")
    add("Per group (points the model claims; fitted groups marked *):")
    fitted = {r["group"] for r in rows if r["role"] == "fit"}
    for g, e in groups.items():
        star = "*" if g in fitted else " "
        spread = f"max {e['max']:.1%}, median {e['median']:.1%} (stated: within {e['stated']:.0%})"
        add(f"  {star}{g:<40} {e['points']:3d} points: {spread}")
    add("")
    add("Predicted forward per rank, EP shapes (ms; the comm CTAs and minibatch rows the tool would use):")
    columns = ("shape", "EP", "tokens", "rows/expert", "fused", "unfused", "unfused/fused", "comm CTAs", "minibatch")
    add("  {:<18} {:>3} {:>6} {:>11} {:>8} {:>8} {:>13} {:>9} {:>9}  bound".format(*columns))
    for p in preds:
        values = (p["shape"], p["ep"], p["tokens_per_rank"], p["rows_per_expert"], p["fused_ms"], p["unfused_ms"])
        values += (p["unfused_over_fused"], p["comm_ctas"], p["minibatch_rows"], p["fused_bound"])
        add("  {:<18} {:3d} {:6d} {:11.0f} {:8.3f} {:8.3f} {:13.2f} {:9d} {:9d}  {}".format(*values))
    add(f"  (EP above {fab.gpus_per_node} spans nodes; Mixtral's 8 experts do not split beyond EP 8)")
    add("")
    add("Predicted training step per rank (forward + backward from kept rows, ms):")
    columns = ("shape", "EP", "bwd fused", "bwd unfused", "step fused", "step unfused", "unfused/fused")
    add("  {:<18} {:>3} {:>9} {:>11} {:>10} {:>12} {:>13}".format(*columns))
    for p in preds:
        values = (p["shape"], p["ep"], p["backward_fused_ms"], p["backward_unfused_ms"])
        values += (p["training_step_fused_ms"], p["training_step_unfused_ms"], p["training_step_unfused_over_fused"])
        add("  {:<18} {:3d} {:9.3f} {:11.3f} {:10.3f} {:12.3f} {:13.2f}".format(*values))
    add("")
    f, u, err, h = head["fused"], head["unfused"], head["error"], head["at_half_nvlink"]
    add(f"Headline: {head['shape']} EP shape at EP {head['ep']} (one NVLink node, {fab.nvlink_gbps:g} GB/s assumed):")
    add(f"  fused {f['ms']:.2f} ms ({f['comm_ctas']} comm CTAs, minibatch {f['minibatch_rows']} rows)")
    add(f"  unfused chain {u['ms']:.2f} ms: {head['unfused_over_fused']:.2f}x")
    add(f"  error: within {err['stated']:.0%} per forward (stated for every shape's measured forwards);")
    worst = f"{err['shape_worst']:+.1%}"
    add(f"  on this shape's {err['shape_points']} measured forwards (one GPU, EP 2) the worst is {worst}")
    ratio = f"{h['unfused_over_fused']:.2f}x"
    add(f"  at {h['nvlink_gbps']:g} GB/s NVLink (half): fused {h['fused_ms']:.2f} ms, unfused {h['unfused_ms']:.2f} ms")
    out[-1] += f", {ratio}"
    fb, ub = head["backward_fused"], head["backward_unfused"]
    add(f"  training step (forward + backward from kept rows): fused {f['ms'] + fb['ms']:.2f} ms, unfused")
    out[-1] += f" {u['ms'] + ub['ms']:.2f} ms: {head['training_step_unfused_over_fused']:.2f}x"
    for title, result in (
        ("Fused timeline (ms from the start of the forward)", f),
        ("Unfused timeline", u),
        ("Fused backward timeline (ms from the start of the backward)", fb),
        ("Unfused backward timeline", ub),
    ):
        add(f"  {title}:")
        for name, t0, t1 in result["timeline"]:
            add(f"    {t0:7.3f} - {t1:7.3f}  {name}")
    return "\n".join(out)


def plot(path: Path, rows: list[dict], preds: list[dict], fabric: Fabric) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FormatStrFormatter, NullFormatter
    except ImportError:
        return False

    def plain_log(ax, axis, ticks):  # log scale with plain numbers at chosen ticks
        getattr(ax, f"set_{axis}scale")("log")
        a = getattr(ax, f"{axis}axis")
        a.set_major_formatter(FormatStrFormatter("%g"))
        a.set_minor_formatter(NullFormatter())
        getattr(ax, f"set_{axis}ticks")(ticks)

    fig, axes = plt.subplots(1, 3, figsize=(18, 5.6))
    ax = axes[0]
    markers = "os^vDPX*"
    for i, g in enumerate(dict.fromkeys(r["group"] for r in rows)):
        sel = [r for r in rows if r["group"] == g and r["role"] != OUTSIDE]
        ax.scatter(
            [r["measured_ms"] for r in sel], [r["predicted_ms"] for r in sel], s=18, marker=markers[i % 8], label=g
        )
    out = [r for r in rows if r["role"] == OUTSIDE]
    ax.scatter(
        [r["measured_ms"] for r in out],
        [r["predicted_ms"] for r in out],
        s=30,
        facecolors="none",
        edgecolors="gray",
        label=OUTSIDE,
    )
    lo = min(min(r["measured_ms"], r["predicted_ms"]) for r in rows) * 0.8
    hi = max(max(r["measured_ms"], r["predicted_ms"]) for r in rows) * 1.2
    ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
    ax.fill_between([lo, hi], [lo * 0.9, hi * 0.9], [lo * 1.1, hi * 1.1], color="gray", alpha=0.12, label="±10%")
    ax.set(xlabel="measured ms", ylabel="predicted ms", title="Calibration: predicted against measured")
    ax.set_xlim(lo, hi), ax.set_ylim(lo, hi)
    for axis in ("x", "y"):
        plain_log(ax, axis, [2, 3, 5, 10, 20])
    ax.legend(fontsize=7)
    shapes = list(dict.fromkeys(p["shape"] for p in preds))
    for name in shapes:
        sel = [p for p in preds if p["shape"] == name]
        eps = [p["ep"] for p in sel]
        (line,) = axes[1].plot(eps, [p["fused_ms"] for p in sel], "-o", ms=3, label=f"{name}")
        axes[1].plot(eps, [p["unfused_ms"] for p in sel], "--", color=line.get_color(), lw=1)
        axes[2].plot(eps, [p["unfused_over_fused"] for p in sel], "-o", ms=3, color=line.get_color(), label=name)
    for ax in axes[1:]:
        ax.set_xscale("log", base=2)
        ax.set_xticks(EP_SIZES, [str(x) for x in EP_SIZES])
        ax.axvline(fabric.gpus_per_node, color="gray", lw=0.8, ls=":")
        ax.set_xlabel(f"EP size (GPUs; beyond {fabric.gpus_per_node}: {fabric.net_gbps:g} GB/s network, assumed)")
    axes[1].set(ylabel="predicted forward ms per rank", title="Fused layer (solid), unfused chain (dashed)")
    plain_log(axes[1], "y", [2, 3, 5, 10, 20, 30, 50])
    axes[1].legend(fontsize=7)
    axes[2].axhline(1.0, color="k", lw=0.8)
    axes[2].set(ylabel="unfused / fused", title=f"Unfused / fused (NVLink {fabric.nvlink_gbps:g} GB/s, assumed)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def tool_commit() -> str:
    """The commit of the code that ran ($POUNCE_COMMIT, as the benchmarks take it, or the checkout's)."""
    if os.environ.get("POUNCE_COMMIT"):
        return os.environ["POUNCE_COMMIT"]
    try:
        git = ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]
        return subprocess.run(git, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def to_json(model: Model, rows: list[dict], groups: dict, preds: list[dict], head: dict) -> dict:
    def timeline(t):
        return [{"phase": n, "start_ms": a, "end_ms": b} for n, a, b in t]

    head = dict(head)
    for key in ("fused", "unfused", "backward_fused", "backward_unfused"):
        head[key] = {**head[key], "timeline": timeline(head[key]["timeline"])}
    return {
        "tool": "tools/scale_model.py",
        "git_commit": tool_commit(),
        "inputs_measured": {k: {"value": v, "source": s} for k, (v, s) in model.m.inputs().items()},
        "inputs_assumed": asdict(model.fabric),
        "fitted": asdict(model.fit),
        "points": rows,
        "errors_by_group": groups,
        "predictions": preds,
        "headline": head,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--results", type=Path, default=RESULTS, help="one-GPU results (default: the last full check on one H200)")
    ap.add_argument("--ep-results", type=Path, default=EP_RESULTS, help="pounce_ep_bench JSON of two GPUs")
    ap.add_argument("--ep-dispatch", type=Path, default=EP_DISPATCH, help="pounce_dispatch_bench JSON of two GPUs")
    ap.add_argument("--backward-results", type=Path, default=BACKWARD_RESULTS, help="one-GPU results with the backward")
    ap.add_argument(
        "--nvlink-gbps", type=float, default=Fabric.nvlink_gbps, help="assumed NVLink GB/s per GPU per direction"
    )
    ap.add_argument(
        "--net-gbps", type=float, default=Fabric.net_gbps, help="assumed network GB/s per GPU per direction"
    )
    ap.add_argument(
        "--net-latency-us", type=float, default=Fabric.net_latency_us, help="assumed latency per phase across nodes"
    )
    ap.add_argument("--gpus-per-node", type=int, default=Fabric.gpus_per_node)
    ap.add_argument(
        "--tokens", type=int, help="tokens per rank for every shape (default: each shape's slice, as pounce_ep_bench)"
    )
    ap.add_argument("--json", type=Path, help="write predictions and errors here")
    ap.add_argument("--png", type=Path, help="write the plot here (needs matplotlib)")
    args = ap.parse_args(argv)

    measured = Measured(args.results, args.ep_results, args.ep_dispatch, args.backward_results)
    fabric = Fabric(args.nvlink_gbps, args.net_gbps, args.net_latency_us, args.gpus_per_node)
    model, pts = calibrate(measured, fabric)
    rows = errors(model, pts)
    groups = group_errors(rows)
    preds = predictions(model, args.tokens)
    head = headline(model, rows, args.tokens)
    print(report(model, rows, groups, preds, head))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(to_json(model, rows, groups, preds, head), indent=1) + "\n")
    if args.png:
        args.png.parent.mkdir(parents=True, exist_ok=True)
        if not plot(args.png, rows, preds, fabric):
            print(f"matplotlib is not installed: no plot at {args.png}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

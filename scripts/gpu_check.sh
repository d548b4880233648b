#!/usr/bin/env bash
# The one GPU-machine job: build (ninja, all cores), run the GPU test suite, run the benchmarks and the
# PyTorch baselines, and leave logs and JSON in OUTDIR. See CONTRIBUTING.md.
#
# usage: scripts/gpu_check.sh OUTDIR [--quick] [--sanitize] [--prebuilt] [--phases LIST] [--no-sweeps]
#   --quick     benchmarks at the default shape only (uniform routing), no PyTorch eager sweep
#   --no-sweeps the benchmark without the fused layer's option sweeps
#   --sanitize  also run small grouped-GEMM, unfused, fused-layer and planner tests under compute-sanitizer
#               (memcheck, racecheck, synccheck)
#   --prebuilt  use the binaries and libpounce.so in build/bin, built beforehand (here or on another
#               machine with the same toolkit, then copied into build/bin) instead of building: saves the
#               build's minutes
#   --phases    a comma-separated subset of tests,sanitize,bench,zipf,balanced,movers,torch,train,
#               train-chain,train-fp8,timeline,ab (default: all but the train phases, timeline and ab,
#               sanitize only with --sanitize),
#               to split one check over several shorter runs into the same OUTDIR; torch reads the bench
#               phase's JSON there.
#               train runs python -m pounce.train into OUTDIR/train, train-chain the same with
#               --backward chain into OUTDIR/train-chain, train-fp8 with --fp8-data-gradients
#               --fp8-weight-gradients into OUTDIR/train-fp8. timeline uses a second build with
#               -DPOUNCE_TIMELINE=ON (build-timeline/bin with --prebuilt): its test, what recording costs
#               the forward, and the traces of a forward and a training step in OUTDIR/timeline. ab times
#               this build's library against the one in $AB_LIB (a folder holding another build's
#               libpounce.so.0, e.g. a branch's) with scripts/ab_bench.sh into OUTDIR/ab.
# The commit recorded in the JSON is $POUNCE_COMMIT, else `git rev-parse HEAD`.
set -uo pipefail

out=${1:?usage: scripts/gpu_check.sh OUTDIR [--quick] [--sanitize] [--prebuilt] [--phases LIST] [--no-sweeps]}
shift
quick=0 sanitize=0 prebuilt=0 phases="" sweeps=--sweeps
while [ $# -gt 0 ]; do
  case $1 in
    --quick) quick=1 ;;
    --sanitize) sanitize=1 ;;
    --prebuilt) prebuilt=1 ;;
    --no-sweeps) sweeps="" ;;
    --phases) phases=${2:?--phases needs a list}; shift ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
[ -z "$phases" ] && phases=tests,bench,zipf,balanced,movers,torch && [ $sanitize = 1 ] && phases=$phases,sanitize
has() { [[ ",$phases," == *",$1,"* ]]; }
mkdir -p "$out"
out=$(realpath "$out")

# Never NVLink multicast: it can take shared machines down.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export POUNCE_COMMIT=${POUNCE_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}

# Build against the NCCL we run with: the nvidia-nccl-cu13 wheel next to PyTorch, if present.
nccl_root=$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null || true)
build=build-gpu
if [ $prebuilt = 1 ]; then
  build=build
  { nvidia-smi; echo "commit $POUNCE_COMMIT, prebuilt binaries, NCCL at run time: ${nccl_root:-<system>}, phases $phases"; } >> "$out/build.log" 2>&1
else
  {
    nvidia-smi
    echo "commit $POUNCE_COMMIT, NCCL_ROOT=${nccl_root:-<CUDA toolkit>}"
    cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DPOUNCE_PTXAS_VERBOSE=ON ${nccl_root:+-DNCCL_ROOT="$nccl_root"} &&
      cmake --build "$build" -j "$(nproc)"
  } > "$out/build.log" 2>&1 || { tail -60 "$out/build.log"; echo "BUILD FAILED"; exit 1; }
  echo "build ok ($(grep -c 'bytes spill' "$out/build.log") ptxas reports, $(grep 'bytes spill' "$out/build.log" | grep -vc ' 0 bytes spill stores, 0 bytes spill loads') with spills)"
fi
[ -n "$nccl_root" ] && export LD_LIBRARY_PATH="$nccl_root/lib:${LD_LIBRARY_PATH:-}"
bin=$build/bin

status=0
if has tests; then
  # The GPU suite, then the experiments' tests (their CPU half runs in CI too).
  for suite in pounce_tests_gpu pounce_experiment_tests; do
    timeout 600 "$bin/$suite" > "$out/$suite.log" 2>&1 || status=1
    echo "$suite: $(grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]+ test' "$out/$suite.log" | tr '\n' ' ')"
    grep -E '^\[  FAILED  \] [A-Za-z]' "$out/$suite.log" || true
  done
  # The Python package's tests on this GPU, from the source tree over this build's libpounce.so (they
  # need PyTorch with CUDA and pytest).
  if python3 -c 'import pytest, torch' 2>/dev/null; then
    lib=$(realpath "$bin/libpounce.so")
    (cd python/tests && POUNCE_LIBRARY="$lib" timeout 300 python3 -m pytest -q -rs . > "$out/pytest.log" 2>&1) ||
      status=1
    echo "pytest: $(tail -1 "$out/pytest.log")"
  else
    echo "pytest: skipped (no pytest or PyTorch here)" | tee "$out/pytest.log"
  fi
fi

if has sanitize; then
  # The grouped GEMM (BF16 and FP8, the FP8 long-K loop included), the quantizers (small cases) and the unfused chain under all three tools; small fused-layer and device-planner cases
  # (one rank in place and combined, virtual ranks, top-k past 32) under memcheck and synccheck, and the
  # smallest fused cases, forward (BF16 and E4M3) and backward (in place and combined), with the planner's under racecheck
  # (the shared-memory hand-offs of planning, the opening, the tile source and the elementwise stages).
  gemm='Shapes/GroupedGemmTest.MatchesHost/one_row*:Shapes/GroupedGemmTest.MatchesHost/edges*:GroupedGemm.WaitsFor*:Shapes/Fp8GroupedGemmTest.*/one_row*:Shapes/Fp8GroupedGemmTest.*/edges*:Shapes/Fp8GroupedGemmTest.*/deep_k*:Shapes/Fp8GroupedGemmTest.*/odd_deep_k*:QuantizeKernel.EdgeCases*:QuantizeKernel.WeightBlock*:QuantizeKernel.Gather*:QuantizeKernel.Transposed*:QuantizeKernel.Mx*:Shapes/Fp8KGroupedGemmTest.*/empty*:Routings/BackwardChainFp8Test.*/T300*:BackwardKernels.*:Shapes/UnfusedFp8Test.*T1_*:Shapes/UnfusedMoeTest.*T64*:Shapes/KGroupedGemmTest.*/empty_experts*:Routings/BackwardChainTest.*/T300*'
  fused='VirtualRanks/FusedMoeTest.*/P1_T300*:VirtualRanks/FusedMoeBackwardTest.*/P1_T97*:VirtualRanks/FusedMoeBackwardTest.*/P8_T1_*:VirtualRanks/FusedMoeTest.*/P1_T97*:VirtualRanks/FusedMoeTest.*/P2_T129*:FusedMoe.OneRankInPlaceMatchesCombinedBitwise:DevicePlanner.*:Routings/DevicePlannerTest.*/P2_uniform_E64*:VirtualRanks/FusedFp8Test.*/P1_T300*:VirtualRanks/FusedFp8Test.*/P2_T129*'
  for tool in memcheck racecheck synccheck; do
    filter="$gemm:$fused"
    [ $tool = racecheck ] &&
      filter="$gemm:VirtualRanks/FusedMoeTest.*/P1_T300*:VirtualRanks/FusedMoeBackwardTest.*/P1_T97*:VirtualRanks/FusedMoeBackwardTest.*/P2_T129*:DevicePlanner.*:VirtualRanks/FusedFp8Test.*/P1_T300*:VirtualRanks/FusedFp8Test.*/P2_T129*"
    echo "== compute-sanitizer --tool $tool --gtest_filter=$filter" >> "$out/sanitizer.log"
    timeout 240 compute-sanitizer --tool $tool --error-exitcode 1 "$bin/pounce_tests_gpu" --gtest_filter="$filter" \
      >> "$out/sanitizer.log" 2>&1 && echo "sanitizer $tool: clean" || { echo "sanitizer $tool: FAILED"; status=1; }
  done
fi

# Clocks, power and temperature once a second while the benchmarks run: sustained tensor-core load
# lowers clocks, and the numbers should say so when it happens.
nvidia-smi dmon -s pcu -d 1 >> "$out/dmon.log" 2>&1 &
dmon=$!
if has bench; then
  if [ $quick = 1 ]; then
    timeout 400 "$bin/pounce_bench" $sweeps --json "$out/bench-uniform.json" > "$out/bench.log" 2>&1 || status=1
  else
    timeout 400 "$bin/pounce_bench" --shapes all $sweeps --json "$out/bench-uniform.json" > "$out/bench.log" 2>&1 ||
      status=1
  fi
  sed -n '/^shape /,$p' "$out/bench.log"
fi
if has zipf && [ $quick = 0 ]; then
  timeout 300 "$bin/pounce_bench" --shapes all --routing zipf --reps 10 --json "$out/bench-zipf.json" \
    > "$out/bench-zipf.log" 2>&1 || status=1
  sed -n '/^shape /,$p' "$out/bench-zipf.log"
fi
if has balanced && [ $quick = 0 ]; then
  # Every expert the same number of rows (whole m-blocks on the catalogue shapes: no padding), the
  # condition under which equal-rows grouped GEMM benchmarks are quoted.
  timeout 300 "$bin/pounce_bench" --shapes all --routing balanced --reps 10 --no-backward \
    --json "$out/bench-balanced.json" > "$out/bench-balanced.log" 2>&1 || status=1
  sed -n '/^shape /,$p' "$out/bench-balanced.log"
fi
if has movers; then
  # The row movers (GB/s per comm CTA) and the dispatch-only pull-versus-push probe (virtual ranks on
  # GPU 0, and across GPUs over NCCL when there are several).
  timeout 120 "$bin/pounce_copy_bench" --json "$out/copy.json" > "$out/copy.log" 2>&1 || status=1
  timeout 300 "$bin/pounce_dispatch_bench" --json "$out/dispatch.json" > "$out/dispatch.log" 2>&1 || status=1
  cat "$out/dispatch.log"
  # Expert parallelism across GPUs, when the machine has several: the fused layer against pounce's
  # unfused expert-parallel chain, and the eager PyTorch EP MoE against pounce.MoE over a process group.
  gpus=$(nvidia-smi -L | wc -l)
  if [ "$gpus" -ge 2 ]; then
    timeout 300 "$bin/pounce_ep_bench" --json "$out/ep.json" > "$out/ep.log" 2>&1 || status=1
    cat "$out/ep.log"
    POUNCE_LIBRARY=$(realpath "$bin/libpounce.so") timeout 600 torchrun --nproc_per_node="$gpus" \
      scripts/torch_ep_baseline.py --shapes deepseek_v3,qwen3_30b --json "$out/torch-ep.json" \
      > "$out/torch-ep.log" 2>&1 || status=1
    tail -8 "$out/torch-ep.log"
  fi
fi
if has torch; then
  timeout 300 python3 scripts/torch_baselines.py --bench-json "$out/bench-uniform.json" --out "$out/torch.json" \
    > "$out/torch.log" 2>&1 || status=1
  cat "$out/torch.log"
fi
# The training comparison (python -m pounce.train) over this build's library, pounce's backward the
# persistent kernel; train-chain: the same with the backward's chain of kernels; train-fp8: its backward
# GEMMs in FP8 (which run in the chain).
for phase in train train-chain train-fp8; do
  has $phase || continue
  flags=()
  [ $phase = train-chain ] && flags=(--backward chain)
  [ $phase = train-fp8 ] && flags=(--fp8-data-gradients --fp8-weight-gradients)
  PYTHONPATH=python POUNCE_LIBRARY=$(realpath "$bin/libpounce.so") timeout 400 python3 -m pounce.train \
    ${flags[@]+"${flags[@]}"} --out "$out/$phase" > "$out/$phase.log" 2>&1 || status=1
  tail -20 "$out/$phase.log"
done
if has timeline; then
  tbin=build-timeline/bin
  if [ $prebuilt = 0 ]; then
    tbin=build-gpu-timeline/bin
    { cmake -S . -B build-gpu-timeline -G Ninja -DCMAKE_BUILD_TYPE=Release -DPOUNCE_TIMELINE=ON \
        ${nccl_root:+-DNCCL_ROOT="$nccl_root"} && cmake --build build-gpu-timeline -j "$(nproc)" \
        --target pounce_bench pounce_tests_gpu; } >> "$out/build.log" 2>&1 || { echo "TIMELINE BUILD FAILED"; status=1; }
  fi
fi
if has timeline && [ -x "$tbin/pounce_bench" ]; then
  mkdir -p "$out/timeline"
  timeout 120 "$tbin/pounce_tests_gpu" --gtest_filter='*Timeline*' > "$out/timeline/test.log" 2>&1 || status=1
  echo "timeline test: $(grep -E '^\[  PASSED|^\[  FAILED' "$out/timeline/test.log" | tr '\n' ' ')"
  timeout 300 "$tbin/pounce_bench" --shapes deepseek_v3,qwen3_30b --no-gemms --no-backward \
    --timeline "$out/timeline" --json "$out/timeline/bench.json" > "$out/timeline/bench.log" 2>&1 || status=1
  grep 'timeline:' "$out/timeline/bench.log"
fi
if has ab; then
  BIN=$bin scripts/ab_bench.sh "$out/ab" "$bin" "${AB_LIB:?the ab phase needs AB_LIB, a folder with another libpounce.so.0}" 2 \
    -- --shapes deepseek_v3,qwen3_30b,mixtral_8x7b --reps 10 --warmup 2 > "$out/ab.log" 2>&1 || status=1
  tail -60 "$out/ab.log"
fi
kill $dmon 2>/dev/null
exit $status

#!/usr/bin/env bash
# Two builds of libpounce.so against each other on one GPU: the same pounce_bench binary (in $BIN, default
# build/bin) loads build A's library, then build B's, alternately for ROUNDS rounds (so drift in clock
# and temperature falls on both), then tools/ab_compare.py prints each timed row's median under A and B.
# The two builds must differ only inside the library (kernels, launch code), not in the benchmark's
# interface. Before the timing, pounce_tests_gpu runs under each library with TEST_FILTER (default: the
# GEMM and FP8 tests).
#
# usage: scripts/ab_bench.sh OUTDIR LIBDIR_A LIBDIR_B [ROUNDS] [-- pounce_bench options]
#   e.g. scripts/ab_bench.sh out build/bin build/lib-b 2 -- --shapes deepseek_v3,qwen3_30b --reps 10
set -uo pipefail
out=${1:?usage: scripts/ab_bench.sh OUTDIR LIBDIR_A LIBDIR_B [ROUNDS] [-- pounce_bench options]}
lib_a=${2:?LIBDIR_A}
lib_b=${3:?LIBDIR_B}
shift 3
rounds=2
if [ $# -gt 0 ] && [ "$1" != -- ]; then rounds=$1; shift; fi
[ $# -gt 0 ] && [ "$1" = -- ] && shift
bench_args=("$@")
[ ${#bench_args[@]} -eq 0 ] && bench_args=(--shapes deepseek_v3,qwen3_30b,mixtral_8x7b --reps 10 --warmup 2)
mkdir -p "$out"
bin=${BIN:-build/bin}

# Never NVLink multicast: it can take shared machines down.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nccl=$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null || true)
status=0
for build in A B; do
  lib=$lib_a
  [ $build = B ] && lib=$lib_b
  [ -e "$lib/libpounce.so.0" ] || { echo "$lib has no libpounce.so.0" >&2; exit 2; }
  LD_LIBRARY_PATH=$lib${nccl:+:$nccl/lib} timeout 300 "$bin/pounce_tests_gpu" \
    --gtest_filter="${TEST_FILTER:-*GroupedGemm*:*Fp8*}" > "$out/tests-$build.log" 2>&1 || {
    # A library older than the test binary may lack a host function the tests call: that is no failure
    # of the library's kernels, and the benchmark still runs under it.
    grep -q 'symbol lookup error' "$out/tests-$build.log" || status=1
  }
  echo "tests $build ($lib): $(grep -E '^\[  (PASSED|FAILED) |symbol lookup error' "$out/tests-$build.log" | tr '\n' ' ')"
done
for round in $(seq 1 "$rounds"); do
  for build in A B; do
    lib=$lib_a
    [ $build = B ] && lib=$lib_b
    LD_LIBRARY_PATH=$lib${nccl:+:$nccl/lib} POUNCE_COMMIT=${POUNCE_COMMIT:-unknown} timeout 300 \
      "$bin/pounce_bench" "${bench_args[@]}" --json "$out/$build-$round.json" > "$out/$build-$round.log" 2>&1 ||
      status=1
    echo "bench $build round $round: $(tail -1 "$out/$build-$round.log")"
  done
done
python3 "$(dirname "$0")/../tools/ab_compare.py" "$out" | tee "$out/compare.txt"
exit $status

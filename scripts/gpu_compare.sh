#!/usr/bin/env bash
# On the GPU machine: builds every tree under snapshots/ (from scripts/snapshot.sh) in parallel,
# runs the GPU benchmark in each (BENCH_ARGS) and, when TEST_ARGS is set, pytest in each; then
# prints one table with every tree's TFLOP/s side by side (benchmarks/compare_runs.py).
# Logs and JSON go to $OUT (else gpu_out/), one folder per tree.
#   BENCH_ARGS="--dtypes bf16 --head-dims 256 --lens 1024,4096,16384 --impls ours,sdpa-flash"
#   TEST_ARGS="-x tests/test_accuracy.py -k cuda"
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-gpu_out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
BENCH_ARGS=${BENCH_ARGS:-"--dtypes bf16 --lens 1024,4096,16384 --impls ours,sdpa-flash --repeats 10"}
trees=$(cd snapshots && ls -d */ | tr -d /)
n=$(echo $trees | wc -w)
jobs=$(( $(nproc) / n > 1 ? $(nproc) / n : 1 ))
status=0
start=$(date +%s)
for t in $trees; do
  ( cd "$ROOT/snapshots/$t" && FLASHATTN_BUILD=${FLASHATTN_BUILD:-cuda} MAX_JOBS=$jobs \
      python3 setup.py build_ext --inplace > "$OUT/build_$t.log" 2>&1 \
      || { echo "build of $t failed:"; tail -20 "$OUT/build_$t.log"; } ) &
done
wait
echo "built $n trees in $(( $(date +%s) - start )) s"
for t in $trees; do  # each tree must import its own build
  ( cd "$ROOT/snapshots/$t" && PYTHONPATH=$PWD python3 -c "import flashattn_ext._C as c, os, sys; \
      sys.exit(0 if c.__file__.startswith(os.getcwd()) else 'imports ' + c.__file__)" ) || status=1
done
for t in $trees; do
  # PYTHONPATH: scripts run from a subfolder of the tree import the tree's own build.
  ( cd "$ROOT/snapshots/$t" && PYTHONPATH=$PWD python3 benchmarks/bench_gpu.py --out-dir "$OUT/$t" \
      --no-plots $BENCH_ARGS > "$OUT/bench_$t.log" 2>&1 ) || { echo "bench of $t failed"; status=1; }
done
if [[ -n "${TEST_ARGS:-}" ]]; then
  for t in $trees; do
    ( cd "$ROOT/snapshots/$t" && PYTHONPATH=$PWD python3 -m pytest -q $TEST_ARGS 2>&1 | tail -2 ) \
      | sed "s/^/$t: /"
    status=$(( status | ${PIPESTATUS[0]} ))
  done
fi
python3 benchmarks/compare_runs.py $(for t in $trees; do echo "$OUT/$t/gpu.json"; done) | tee "$OUT/compare.txt"
exit $status

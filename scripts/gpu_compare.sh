#!/usr/bin/env bash
# On the GPU machine: builds every tree under snapshots/ (from scripts/snapshot.sh) in parallel,
# runs the GPU benchmark in each (BENCH_ARGS; several benchmarks separated by '|') and, when
# TEST_ARGS is set, pytest in each; then prints, per benchmark, one table with every tree's TFLOP/s
# side by side (benchmarks/compare_runs.py).
# The SDPA backends named in --impls run in the first tree only (compare_runs.py takes them from
# there); the other trees time ours (and ours-det) alone. TEST_TREES limits the tests to some trees.
# Logs and JSON go to $OUT (else gpu_out/), one folder per tree.
#   BENCH_ARGS="--dtypes bf16 --head-dims 256 --lens 1024,4096,16384 --impls ours,sdpa-flash | --dtypes fp64 --head-dims 128"
#   TEST_ARGS="-x tests/test_accuracy.py -k cuda"   (no -q: pytest already runs with -q, and -qq
#   drops the summary line this script prints)
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
IFS='|' read -ra benches <<< "$BENCH_ARGS"
first=$(echo $trees | cut -d' ' -f1)
# The benchmark arguments with the SDPA backends left out of --impls (ours if none is named).
ours_only() {
  local impls kept
  impls=$(grep -oE -- '--impls[ =][^ ]+' <<< "$1" | sed -E 's/--impls[ =]//') || { echo "$1 --impls ours"; return; }
  kept=$(tr ',' '\n' <<< "$impls" | grep -v '^sdpa-' | paste -sd, -)
  sed -E "s/--impls[ =][^ ]+/--impls ${kept:-ours}/" <<< "$1"
}
for t in $trees; do
  for i in "${!benches[@]}"; do
    mkdir -p "$OUT/bench$i"
    args=${benches[$i]}
    [[ $t == "$first" ]] || args=$(ours_only "$args")
    # PYTHONPATH: scripts run from a subfolder of the tree import the tree's own build.
    ( cd "$ROOT/snapshots/$t" && PYTHONPATH=$PWD python3 benchmarks/bench_gpu.py --out-dir "$OUT/bench$i/$t" \
        --no-plots $args > "$OUT/bench$i/$t.log" 2>&1 ) || { echo "bench $i of $t failed"; status=1; }
  done
done
if [[ -n "${TEST_ARGS:-}" ]]; then
  for t in ${TEST_TREES:-$trees}; do
    ( cd "$ROOT/snapshots/$t" && PYTHONPATH=$PWD python3 -m pytest -q $TEST_ARGS 2>&1 | tail -2 ) \
      | sed "s/^/$t: /"
    status=$(( status | ${PIPESTATUS[0]} ))
  done
fi
for i in "${!benches[@]}"; do
  echo "--- benchmark $i:${benches[$i]}"
  python3 benchmarks/compare_runs.py $(for t in $trees; do echo "$OUT/bench$i/$t/gpu.json"; done)
done | tee "$OUT/compare.txt"
exit $status

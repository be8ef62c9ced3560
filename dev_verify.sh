#!/usr/bin/env bash
# ad-hoc device script (untracked): build, every CUDA test, compute-sanitizer on the wgmma backward's cases
cd "$(dirname "$0")"
export OUT=${OUT:-gpu_out}
STEPS=build timeout 200 bash scripts/gpu_run.sh | tail -1
git log --oneline -1 2>/dev/null || true
env OMP_NUM_THREADS=2 timeout 220 python3 -m pytest -q -n 6 -k cuda tests 2>&1 | tee $OUT/tests.log | grep -E "FAIL|passed|failed|rror" | head -20
for tool in memcheck racecheck; do
  echo "--- $tool (default kernels: the wgmma dK/dV at dims 64 / 128), cases 2-4, 12, 30"
  for c in 2 3 12 30; do
    timeout 60 compute-sanitizer --tool $tool --error-exitcode 9 python3 scripts/sanitize_cases.py $c $((c+1)) 2>&1 | tail -1
  done
done

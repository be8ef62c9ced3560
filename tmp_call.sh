#!/bin/bash
set -u
export BENCH_ARGS="--dtypes bf16 --head-dims 64,256 --lens 1024,16384 --causal both --impls ours,sdpa-flash --repeats 10"
timeout 300 bash scripts/gpu_compare.sh > $OUT/call.txt 2>&1; tail -30 $OUT/call.txt
cd snapshots/f
PYTHONPATH=$PWD timeout 200 python3 -m pytest -q -x -k "cuda and (split or several_query or head_dims or lengths)" tests/test_accuracy.py 2>&1 | tail -2
for t in a f; do
  echo "=== small grids, tree $t"
  PYTHONPATH=$PWD/../$t timeout 60 python3 benchmarks/bench_small_grids.py --repeats 30 --out-dir $OUT/sg_$t $( [ $t = f ] && echo "--impls ours" ) 2>&1 | tee -a $OUT/small_grids.txt
done
for tool in memcheck racecheck; do
  echo "--- $tool (f, split cases)"
  PYTHONPATH=$PWD timeout 150 compute-sanitizer --tool $tool --error-exitcode 9 python3 scripts/sanitize_cases.py 17 21 2>&1 | tail -2
done

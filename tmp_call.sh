#!/bin/bash
set -u
export BENCH_ARGS="--dtypes bf16 --head-dims 128 --lens 2048,4096,8192,16384 --causal no --impls ours,sdpa-flash --repeats 10 | --dtypes fp16 --head-dims 128 --lens 4096,8192,16384 --causal no --impls ours,sdpa-flash --repeats 10"
export TEST_ARGS="-x -k split tests/test_accuracy.py"
export TEST_TREES="d"
timeout 300 bash scripts/gpu_compare.sh > $OUT/call.txt 2>&1; tail -40 $OUT/call.txt
for t in a d; do
  echo "=== small grids, tree $t"
  PYTHONPATH=$PWD/snapshots/$t timeout 50 python3 snapshots/a/benchmarks/bench_small_grids.py --repeats 20 --out-dir $OUT/sg_$t $( [ $t = d ] && echo "--impls ours" ) 2>&1 | tee -a $OUT/small_grids.txt
done
cd snapshots/a
for tool in memcheck racecheck; do
  echo "--- $tool (main, split cases)"
  PYTHONPATH=$PWD timeout 120 compute-sanitizer --tool $tool --error-exitcode 9 python3 scripts/sanitize_cases.py 17 19 2>&1 | tail -3
done

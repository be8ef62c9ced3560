#!/bin/bash
set -u
export BENCH_ARGS="--dtypes bf16 --head-dims 128 --causal both --impls ours,sdpa-flash --repeats 10 | --dtypes fp16 --head-dims 128 --lens 4096,8192,16384 --causal no --impls ours,sdpa-flash --repeats 10 | --dtypes bf16 --head-dims 64,256 --lens 1024,16384 --causal both --impls ours,sdpa-flash --repeats 10"
export TEST_ARGS="-x -k cuda tests/test_accuracy.py tests/test_autograd.py tests/test_errors.py tests/test_determinism.py"
export TEST_TREES="c"
timeout 440 bash scripts/gpu_compare.sh > $OUT/call.txt 2>&1; tail -90 $OUT/call.txt
for t in a c; do
  echo "=== small grids, tree $t"
  PYTHONPATH=$PWD/snapshots/$t timeout 50 python3 snapshots/c/benchmarks/bench_small_grids.py --repeats 20 --out-dir $OUT/sg_$t $( [ $t = c ] && echo "--impls ours" ) 2>&1 | tee -a $OUT/small_grids.txt
done

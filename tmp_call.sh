#!/bin/bash
set -u
start=$(date +%s)
for t in a f; do ( cd snapshots/$t && FLASHATTN_BUILD=cuda MAX_JOBS=8 python3 setup.py build_ext --inplace > $OUT/build_$t.log 2>&1 || tail -20 $OUT/build_$t.log ) & done; wait
echo "built in $(( $(date +%s) - start )) s"
cd snapshots/f
for t in a f; do
  echo "=== small grids, tree $t"
  PYTHONPATH=$PWD/../$t timeout 90 python3 benchmarks/bench_small_grids.py --repeats 30 --out-dir $OUT/sg_$t $( [ $t = f ] && echo "--impls ours" ) 2>&1 | tee -a $OUT/small_grids.txt
done
echo "=== tree a again"
PYTHONPATH=$PWD/../a timeout 60 python3 benchmarks/bench_small_grids.py --repeats 30 --impls ours --out-dir $OUT/sg_a2 2>&1 | tee -a $OUT/small_grids.txt

#!/usr/bin/env bash
# On the GPU machine: kernel patches measured against the working tree without a whole build per patch.
# Builds the tree in place, then for each variants/NAME.patch (the folder is ignored by git: `run` with
# carry ["variants"]) applies it, rebuilds (ninja recompiles only what the patch touches), keeps the package
# with that build in variant_builds/NAME and takes the patch back out. Then, per build, TESTS (pytest
# arguments; the patch applied and its extension in the tree) and BENCH (benchmarks/bench_variants.py
# arguments, one string per run, several separated by '|'), every build a variant of its interleaved rounds.
# Logs under $OUT (else gpu_out/).
#   TESTS="-k cuda tests/test_accuracy.py" BENCH="--rows 128:1024,128:4096 | --causal --rows 64:512" \
#     bash scripts/gpu_variants.sh
# TEST_ENV: environment settings for the tests' process, e.g. TEST_ENV="FLASHATTN_CUDA_KERNELS=wgmma".
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16}
build() { env FLASHATTN_BUILD="${FLASHATTN_BUILD:-cuda}" python3 setup.py build_ext --inplace > "$OUT/build_$1.log" 2>&1; }
extension() { ls flashattn_ext/_C*.so; }
status=0

start=$(date +%s)
build base || { echo "base: build failed"; tail -30 "$OUT/build_base.log"; exit 1; }
echo "base: built in $(( $(date +%s) - start )) s"
rm -rf variant_builds && mkdir -p variant_builds/base && cp -r flashattn_ext variant_builds/base/
names=(base)
for patch in variants/*.patch; do
  [[ -e $patch ]] || continue
  name=$(basename "$patch" .patch)
  git apply "$patch" || { echo "$name: does not apply"; status=1; continue; }
  start=$(date +%s)
  if build "$name"; then
    echo "$name: built in $(( $(date +%s) - start )) s"
    mkdir -p "variant_builds/$name" && cp -r flashattn_ext "variant_builds/$name/"
    names+=("$name")
  else
    echo "$name: build failed"
    tail -20 "$OUT/build_$name.log"
    status=1
  fi
  git apply -R "$patch"
done

if [[ -n "${TESTS:-}" ]]; then
  procs=$([[ ${PYTEST_PROCS:-6} -gt 0 ]] && echo "-n ${PYTEST_PROCS:-6}")  # (0: one process, no pytest-xdist)
  kept=$(mktemp) && cp "$(extension)" "$kept"
  for name in "${names[@]}"; do
    [[ $name == base ]] || git apply "variants/$name.patch"
    cp "variant_builds/$name/flashattn_ext/$(basename "$(extension)")" flashattn_ext/
    env OMP_NUM_THREADS=2 ${TEST_ENV:-} python3 -m pytest -q $procs $TESTS > "$OUT/tests_$name.log" 2>&1
    status=$(( status | $? ))
    echo "$name: $(grep -E '^(FAILED|ERROR)' "$OUT/tests_$name.log" | head -5)$(tail -1 "$OUT/tests_$name.log")"
    [[ $name == base ]] || git apply -R "variants/$name.patch"
  done
  cp "$kept" "flashattn_ext/$(basename "$(extension)")" && rm -f "$kept"
fi

if [[ -n "${BENCH:-}" ]]; then
  variants=()
  for name in "${names[@]}"; do variants+=(--variant "$name" "PYTHONPATH=$PWD/variant_builds/$name"); done
  IFS='|' read -ra benches <<< "$BENCH"
  for args in "${benches[@]}"; do
    python3 benchmarks/bench_variants.py $args --json "$OUT/bench.jsonl" "${variants[@]}" 2>&1 \
      | tee -a "$OUT/bench.log" | sed -n '/^mean over/,$p'
    status=$(( status | ${PIPESTATUS[0]} ))
  done
fi
exit $status

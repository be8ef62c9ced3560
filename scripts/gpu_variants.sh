#!/usr/bin/env bash
# On the GPU machine: kernel patches measured against the working tree without a whole build per patch.
# Builds the tree in place, then for each variants/NAME.patch (the folder is ignored by git: `run` with
# carry ["variants"]) applies it, rebuilds (ninja recompiles only what the patch touches), keeps the package
# with that build in variant_builds/NAME and takes the patch back out (scripts/variant_patches.sh writes the patches
# from branches). Then, per build, each TESTS run
# (pytest arguments; the patch applied and its extension in the tree) and each BENCH run
# (benchmarks/bench_variants.py arguments), every build a variant of its interleaved rounds. Runs are
# separated by '|'; leading VAR=VALUE words of a run are its environment. Logs under $OUT (else gpu_out/).
# REUSE_BUILDS=1 on a warm machine skips the builds and uses the previous call's (variant_builds/). A run's
# ONLY=a,b word (TESTS, RUNS or BENCH) restricts it to base and builds a and b; BASE=0 leaves base out of it.
# RUNS: commands (a sanitizer, a diagnostic script), each per build as TESTS, with PYTHONPATH at the tree.
#   TESTS="-k cuda tests/test_accuracy.py | FLASHATTN_CUDA_KERNELS=sm80 -k cuda tests/test_autograd.py" \
#   RUNS="ONLY=a BASE=0 compute-sanitizer --tool racecheck python3 scripts/sanitize_cases.py kvcache" \
#   BENCH="--rows 128:1024,128:4096 | FLASHATTN_CUDA_KERNELS=sm80 --causal --rows 64:512" \
#     bash scripts/gpu_variants.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16}
build() { env FLASHATTN_BUILD="${FLASHATTN_BUILD:-cuda}" python3 setup.py build_ext --inplace > "$OUT/build_$1.log" 2>&1; }
extension() { ls flashattn_ext/_C*.so | head -1; }
# A run's words -> run_env (its leading VAR=VALUE words) and run_args (the rest).
split_run() {
  local words w
  read -ra words <<< "$1"
  run_env=() run_args=()
  for w in "${words[@]}"; do
    if [[ ${#run_args[@]} -eq 0 && $w =~ ^[A-Z_][A-Z0-9_]*= ]]; then run_env+=("$w"); else run_args+=("$w"); fi
  done
}
# Whether build $1 takes part in the split run (base always; with an ONLY=a,b word builds a and b, else every
# build); sets env_words, the run's environment without that word.
takes_part() {
  local w only="" base=1
  env_words=()
  for w in "${run_env[@]}"; do
    case $w in ONLY=*) only=",${w#ONLY=},";; BASE=*) base=${w#BASE=};; *) env_words+=("$w");; esac
  done
  [[ $1 == base ]] && { [[ $base != 0 ]]; return; }
  [[ -z $only || $only == *",$1,"* ]]
}
status=0

if [[ ${REUSE_BUILDS:-0} == 1 && -d variant_builds/base ]]; then
  # (REUSE_BUILDS=1 on a warm machine: the builds of the previous call, for tests or rounds of their own)
  names=(base)
  for patch in variants/*.patch; do
    name=$(basename "$patch" .patch)
    [[ -d variant_builds/$name ]] && names+=("$name")
  done
  cp "variant_builds/base/flashattn_ext/$(basename "$(extension)")" flashattn_ext/
  echo "reused builds: ${names[*]}"
else
  # A warm machine keeps the last call's objects, built with its last patch applied, while the copied tree's
  # sources may look older to ninja: touch what the last call's patches changed so that base is rebuilt from them.
  [[ -s variant_builds/patched_files ]] && xargs -r touch -c < variant_builds/patched_files
  start=$(date +%s)
  build base || { echo "base: build failed"; tail -30 "$OUT/build_base.log"; exit 1; }
  echo "base: built in $(( $(date +%s) - start )) s"
  rm -rf variant_builds && mkdir -p variant_builds/base && cp -r flashattn_ext variant_builds/base/
  names=(base)
  for patch in variants/*.patch; do [[ -e $patch ]] && git apply --numstat "$patch" | cut -f3; done \
    | sort -u > variant_builds/patched_files
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
fi

# Each build in turn, its patch applied and its extension in the tree, for each run of $1 ('|'-separated) that it
# takes part in: pytest (kind "tests") or a command (kind "run") with the run's environment; logs
# $OUT/KIND_NAME_I.log.
each_build() {
  local spec=$1 kind=$2 runs name i log kept rc
  IFS='|' read -ra runs <<< "$spec"
  kept=$(mktemp) && cp "$(extension)" "$kept"
  for name in "${names[@]}"; do
    [[ $kind == tests && $name == base && ${TEST_BASE:-1} == 0 ]] && continue  # (the tree's tests passed before)
    [[ $name == base ]] || git apply "variants/$name.patch"
    cp "variant_builds/$name/flashattn_ext/$(basename "$(extension)")" flashattn_ext/
    for i in "${!runs[@]}"; do
      split_run "${runs[$i]}"
      takes_part "$name" || continue
      log="$OUT/${kind}_${name}_$i.log"
      # (a kernel that hangs costs the timeout, not the call)
      if [[ $kind == tests ]]; then
        timeout "${TEST_TIMEOUT:-400}" env OMP_NUM_THREADS=2 "${env_words[@]}" python3 -m pytest -q $procs \
          "${run_args[@]}" > "$log" 2>&1
        rc=$?
        echo "$name, tests $i: $(grep -E '^(FAILED|ERROR)' "$log" | head -5)$(tail -1 "$log")"
      else
        timeout "${RUN_TIMEOUT:-300}" env PYTHONPATH="$PWD" "${env_words[@]}" "${run_args[@]}" > "$log" 2>&1
        rc=$?
        echo "$name, run $i (exit $rc):" && tail -"${RUN_TAIL:-12}" "$log"
      fi
      status=$(( status | rc ))
    done
    [[ $name == base ]] || git apply -R "variants/$name.patch"
  done
  cp "$kept" "flashattn_ext/$(basename "$(extension)")" && rm -f "$kept"
}
procs=$([[ ${PYTEST_PROCS:-6} -gt 0 ]] && echo "-n ${PYTEST_PROCS:-6}")  # (0: one process, no pytest-xdist)
[[ -n "${TESTS:-}" ]] && each_build "$TESTS" tests
[[ -n "${RUNS:-}" ]] && each_build "$RUNS" run

if [[ -n "${BENCH:-}" ]]; then
  IFS='|' read -ra bench_runs <<< "$BENCH"
  for run in "${bench_runs[@]}"; do
    split_run "$run"
    variants=()
    for name in "${names[@]}"; do
      takes_part "$name" || continue
      variants+=(--variant "$name" "PYTHONPATH=$PWD/variant_builds/$name" "${env_words[@]}")
    done
    python3 benchmarks/bench_variants.py "${run_args[@]}" --json "$OUT/bench.jsonl" "${variants[@]}" 2>&1 \
      | tee -a "$OUT/bench.log" | sed -n '/^mean over/,$p'
    status=$(( status | ${PIPESTATUS[0]} ))
  done
fi
exit $status

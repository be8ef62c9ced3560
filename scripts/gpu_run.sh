#!/usr/bin/env bash
# One command for a GPU machine: build the extension with its CUDA kernels, run the
# CUDA tests (CI runs the CPU ones), compute-sanitizer on a few calls, and the GPU benchmark.
# Logs and JSON go to $OUT when it is set (else gpu_out/). Steps: STEPS="build test sanitize bench".
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
STEPS=${STEPS:-"build test sanitize bench"}
export PYTHONUNBUFFERED=1
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export MAX_JOBS=${MAX_JOBS:-16}
status=0
run_step() { echo "=== $1"; }

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' | tee -a "$OUT/gpu.txt"

if [[ " $STEPS " == *" build "* ]]; then
  run_step build
  # Sources a scripts/gpu_variants.sh call on this warm machine patched (their objects are the patch's), once.
  if [[ -s variant_builds/patched_files ]]; then
    xargs -r touch -c < variant_builds/patched_files && rm variant_builds/patched_files
  fi
  start=$(date +%s)
  FLASHATTN_BUILD=cuda python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 \
    || { tail -50 "$OUT/build.log"; exit 1; }
  echo "build: $(( $(date +%s) - start )) s (TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST, MAX_JOBS=$MAX_JOBS)" \
    | tee -a "$OUT/gpu.txt"
fi
if [[ " $STEPS " == *" test "* ]]; then
  run_step test
  # The CUDA tests (CI runs the CPU ones) in 6 processes of 2 threads each: 1465 tests in 48 s on
  # the H200 machine, against ~8 minutes for the whole suite in one process. (8 processes of 16
  # threads each, the whole suite, ran past 500 s: the CPU tests' threads oversubscribed the cores.)
  PYTEST="env OMP_NUM_THREADS=2 python3 -m pytest -q -x -n ${PYTEST_PROCS:-6}"
  # (--durations: the slowest tests, in tests.log, say where this step's minutes go)
  $PYTEST --durations=25 ${PYTEST_ARGS:--k cuda tests} 2>&1 | tee "$OUT/tests.log" | tail -25
  status=$(( status | ${PIPESTATUS[0]} ))
  # On sm_90: the wgmma forward on every call it serves, small ones too (by default it takes rows that
  # see >= 8 key tiles on grids of >= 1 block per SM), and the mma.sync kernels the wgmma forward and
  # dK/dV kernels replace there (the default run above has the wgmma backward at dims 64 / 128); with sm80 the
  # decode kernel's merges without clusters too (test_kvcache.py).
  for kernels in wgmma sm80; do
    FLASHATTN_CUDA_KERNELS=$kernels $PYTEST -k cuda tests/test_accuracy.py tests/test_autograd.py \
      $([[ $kernels == sm80 ]] && echo tests/test_kvcache.py) 2>&1 | tee "$OUT/tests_$kernels.log" | tail -3
    status=$(( status | ${PIPESTATUS[0]} ))
  done
  # The portable kernels too, where the tensor-core ones would otherwise be taken.
  FLASHATTN_CUDA_KERNELS=simt $PYTEST -k cuda tests/test_accuracy.py tests/test_autograd.py \
    2>&1 | tee "$OUT/tests_simt.log" | tail -3
  status=$(( status | ${PIPESTATUS[0]} ))
  # What GPUs with less shared memory per block run (sm_86/89/120: 99 KB; sm_80/87: 163 KB);
  # fp32 always takes the SIMT kernels, tested above.
  for cap in 101376 166912; do
    FLASHATTN_CUDA_SMEM_LIMIT=$cap $PYTEST -k "cuda and not fp32" tests/test_accuracy.py \
      tests/test_autograd.py tests/test_features.py 2>&1 | tee "$OUT/tests_smem_$cap.log" | tail -3
    status=$(( status | ${PIPESTATUS[0]} ))
  done
fi
if [[ " $STEPS " == *" sanitize "* ]]; then
  run_step sanitize
  # The whole step runs past one 600 s device call: split it over calls with SANITIZE_KERNELS (a subset of
  # "default simt wgmma sm80").
  SANITIZE_KERNELS=${SANITIZE_KERNELS:-"default simt wgmma sm80"}
  for kernels in default simt; do
    [[ " $SANITIZE_KERNELS " == *" $kernels "* ]] || continue
    for tool in memcheck racecheck; do
      echo "--- $tool, kernels: $kernels" | tee -a "$OUT/sanitize.log"
      FLASHATTN_CUDA_KERNELS=$kernels compute-sanitizer --tool $tool --error-exitcode 9 \
        python3 scripts/sanitize_cases.py 2>&1 | tee -a "$OUT/sanitize.log" | tail -4
      status=$(( status | ${PIPESTATUS[0]} ))
    done
  done
  # The wgmma forward (sm_90) on its cases, small grids sent to it, and the backward at 16-row multiples;
  # and the plain cases on the mma.sync
  # kernels that sm_90 otherwise leaves (the dK/dV kernels at dims 64 / 96 / 128 / 256 run wgmma by default).
  for tool in memcheck racecheck; do
    if [[ " $SANITIZE_KERNELS " == *" wgmma "* ]]; then
      echo "--- $tool, kernels: wgmma" | tee -a "$OUT/sanitize.log"
      FLASHATTN_CUDA_KERNELS=wgmma compute-sanitizer --tool $tool --error-exitcode 9 \
        python3 scripts/sanitize_cases.py 30 70 2>&1 | tee -a "$OUT/sanitize.log" | tail -4
      status=$(( status | ${PIPESTATUS[0]} ))
    fi
    if [[ " $SANITIZE_KERNELS " == *" sm80 "* ]]; then
      echo "--- $tool, kernels: sm80" | tee -a "$OUT/sanitize.log"
      FLASHATTN_CUDA_KERNELS=sm80 compute-sanitizer --tool $tool --error-exitcode 9 \
        python3 scripts/sanitize_cases.py 0 30 2>&1 | tee -a "$OUT/sanitize.log" | tail -4
      status=$(( status | ${PIPESTATUS[0]} ))
    fi
  done
fi
if [[ " $STEPS " == *" bench "* ]]; then
  run_step bench
  python3 benchmarks/bench_gpu.py --out-dir "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -80
  status=$(( status | ${PIPESTATUS[0]} ))
fi
# Plots travel as one tar (fewer files to copy back from a remote machine).
if ls "$OUT"/*.png > /dev/null 2>&1; then
  (cd "$OUT" && tar cf plots.tar ./*.png && rm -f ./*.png)
fi
exit $status

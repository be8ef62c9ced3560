#!/usr/bin/env bash
# On the GPU machine: builds this tree ("main") and this tree with the patches of benchmarks/pending
# applied ("carry": 0001; "tma": 0001-0004) side by side, checks that the patched kernels finish and
# agree with PyTorch on a few calls, times the three (benchmarks/bench_variants.py, interleaved
# rounds, SDPA-flash beside), then runs the forced-wgmma tests on "tma", Nsight Compute on the dim-64
# ws kernel of "main" and "tma", and compute-sanitizer on "tma".
# Steps are in order of what decides the patches' fate; each has a timeout, so that a kernel that
# hangs costs minutes, not the call. $OUT (else gpu_out/) gets steps.log (the summary, also printed)
# and logs.tar (every log, refreshed after each step: the device tool brings back 8 files at most).
#   run: bash benchmarks/pending/run_on_gpu.sh   (about 9 minutes on an H100; a 600 s call)
set -uo pipefail
cd "$(dirname "$0")/../.."
[ -f setup.py ] && [ -d benchmarks/pending ] || { echo "run_on_gpu.sh: not inside the repository ($PWD)"; exit 1; }
ROOT=$PWD
OUT=${OUT:-gpu_out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
LOGS=$(mktemp -d)
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
T0=$(date +%s)
log() {
  echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$OUT/steps.log"
  tar -cf "$OUT/logs.tar" -C "$LOGS" .
}
# Whether at most $1 seconds of the call have passed (the later steps are skipped near its 600 s end).
before() { (( $(date +%s) - T0 < $1 )) || { log "skipped: $2"; return 1; }; }
left() { echo $(( 590 - ($(date +%s) - T0) )); }  # seconds to the call's end, for a step's timeout
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$OUT/steps.log"

TREES=$ROOT/snapshots  # ignored by git: kept between calls while the machine stays warm
declare -A PATCHES=([main]="" [carry]="0001" [tma]="0001 0002 0003 0004")
for t in main carry tma; do
  if [ -f "$TREES/$t/.built" ]; then continue; fi
  rm -rf "$TREES/$t" && mkdir -p "$TREES/$t"
  tar --exclude=./snapshots --exclude=./build --exclude=./gpu_out --exclude='*.so' -cf - . | tar -xf - -C "$TREES/$t"
  for n in ${PATCHES[$t]}; do (cd "$TREES/$t" && patch -p1 -s < "$ROOT"/benchmarks/pending/$n-*.patch) || log "patch $n failed on $t"; done
  ( cd "$TREES/$t" && FLASHATTN_BUILD=cuda MAX_JOBS=$(( $(nproc) > 3 ? $(nproc) / 3 : 1 )) python3 setup.py build_ext --inplace \
      > "$LOGS/build_$t.log" 2>&1 && touch .built || log "build of $t failed: $(tail -5 "$LOGS/build_$t.log")" ) &
done
wait
log "built"

# A few calls per tree with the warp-specialized forward forced, against SDPA in fp32.
cat > "$LOGS/smoke.py" <<'PY'
import torch, torch.nn.functional as F, flashattn_ext
torch.manual_seed(0)
worst = 0.0
for (b, h, hk, lq, lk, e, causal) in [(2, 8, 8, 1024, 1024, 64, False), (1, 40, 40, 512, 512, 64, False),
                                      (1, 70, 10, 390, 1030, 64, False), (2, 4, 2, 300, 700, 64, True),
                                      (1, 100, 50, 400, 300, 128, False), (2, 16, 16, 2048, 2048, 128, False)]:
    for dtype in (torch.bfloat16, torch.float16):
        q = torch.randn(b, h, lq, e, device="cuda", dtype=dtype)
        k, v = (torch.randn(b, hk, lk, e, device="cuda", dtype=dtype) for _ in range(2))
        out = flashattn_ext.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hk != h)
        kr, vr = (t.float().repeat_interleave(h // hk, dim=1) for t in (k, v))
        ref = F.scaled_dot_product_attention(q.float(), kr, vr, is_causal=causal)
        worst = max(worst, (out.float() - ref).abs().max().item())
torch.cuda.synchronize()
print(f"smoke ok, worst |out - fp32 SDPA| {worst:.2e}")
assert worst < 2e-2, worst
PY
for t in main carry tma; do
  (cd "$TREES/$t" && FLASHATTN_CUDA_KERNELS=wgmma PYTHONPATH=$PWD timeout 120 python3 "$LOGS/smoke.py" > "$LOGS/smoke_$t.log" 2>&1)
  log "smoke $t: rc=$? $(tail -1 "$LOGS/smoke_$t.log")"
done

# Forward TFLOP/s, interleaved rounds: main as dispatched, then the ws kernel forced in each tree (bf16:
# fp16 has measured within 1-3% of it on these kernels).
V="--variant main PYTHONPATH=$TREES/main --variant main-ws PYTHONPATH=$TREES/main FLASHATTN_CUDA_KERNELS=wgmma"
V+=" --variant carry-ws PYTHONPATH=$TREES/carry FLASHATTN_CUDA_KERNELS=wgmma"
V+=" --variant tma-ws PYTHONPATH=$TREES/tma FLASHATTN_CUDA_KERNELS=wgmma"
(cd "$TREES/main" && timeout 300 python3 benchmarks/bench_variants.py --rounds 3 --child-timeout 90 --flash $V \
    --rows 64:512,64:1024,64:2048,64:8192,128:512,128:1024,128:4096 > "$LOGS/bench_nc_bf16.txt" 2>&1); tail -7 "$LOGS/bench_nc_bf16.txt" | tee -a "$OUT/steps.log"
log "bench non-causal bf16"
(cd "$TREES/main" && timeout 90 python3 benchmarks/bench_variants.py --rounds 2 --child-timeout 60 --causal \
    --variant main PYTHONPATH=$TREES/main --variant tma PYTHONPATH=$TREES/tma --flash \
    --rows 64:8192 > "$LOGS/bench_causal_bf16.txt" 2>&1); tail -5 "$LOGS/bench_causal_bf16.txt" | tee -a "$OUT/steps.log"
log "bench causal bf16"

# The patched tree's tests with the wgmma kernels forced.
before 480 "tests" && (cd "$TREES/tma" && FLASHATTN_CUDA_KERNELS=wgmma OMP_NUM_THREADS=2 PYTHONPATH=$PWD timeout $(left) python3 -m pytest -q -x -n 6 \
    -k cuda tests/test_accuracy.py tests/test_autograd.py > "$LOGS/tests_tma_wgmma.log" 2>&1)
[ -f "$LOGS/tests_tma_wgmma.log" ] && log "tests tma wgmma: $(tail -1 "$LOGS/tests_tma_wgmma.log")"
# Where the dim-64 ws kernel's time goes (L = 1024, bf16): issue, pipes, stalls, main against tma.
for t in main tma; do
  before 530 "ncu $t" || break
  (cd "$TREES/$t" && FLASHATTN_CUDA_KERNELS=wgmma PYTHONPATH=$PWD timeout 60 ncu --clock-control none \
      --kernel-name regex:fwd_ws_kernel --launch-skip 1 --launch-count 1 --section SpeedOfLight \
      --section ComputeWorkloadAnalysis --section SchedulerStats --section WarpStateStats --section InstructionStats \
      python3 scripts/profile_sm80.py --head-dim 64 --len 1024 > "$LOGS/ncu_ws64_$t.txt" 2>&1)
  log "ncu $t: rc=$?"
done

# compute-sanitizer on the patched tree's wgmma cases (scripts/gpu_run.sh runs them again once landed).
for tool in memcheck racecheck; do
  before 540 "$tool" || break
  (cd "$TREES/tma" && FLASHATTN_CUDA_KERNELS=wgmma PYTHONPATH=$PWD timeout 50 compute-sanitizer --tool $tool \
      --error-exitcode 9 python3 scripts/sanitize_cases.py 30 35 > "$LOGS/sanitize_tma_$tool.log" 2>&1)
  log "$tool tma: rc=$? $(tail -1 "$LOGS/sanitize_tma_$tool.log")"
done


#!/usr/bin/env bash
# A/B of main and this branch on one H100 / H200 (< 8 min on 16 cores): builds both trees, runs the bias tests
# (default and FLASHATTN_CUDA_KERNELS=wgmma), memcheck + racecheck on sanitizer cases 51-57, the E 64/128/256
# table for both trees (key padding mask and full bias, fwd and fwd+bwd, cuDNN beside main), and bench_features.py.
# Before the run: mkdir -p _ab/main && git archive main | tar -x -C _ab/main   (carry _ab/main to the device)
# A one-off measurement script for landing this branch: delete it when the branch lands.
set -uo pipefail
ROOT=$PWD; OUT=${OUT:-$ROOT/gpu_out}; mkdir -p "$OUT"; T0=$(date +%s)
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
left() { local l=$(( 465 - ($(date +%s) - T0) )); (( l > $1 )) && echo "$1" || echo $(( l > 5 ? l : 5 )); }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
build() { (cd "$1" && FLASHATTN_BUILD=cuda MAX_JOBS=8 timeout "$(left 300)" python3 setup.py build_ext --inplace \
  > "$OUT/build_$2.log" 2>&1; echo "build $2 rc=$? at $(( $(date +%s) - T0 )) s" | tee -a "$OUT/gpu.txt"); }
build "$ROOT" branch & build "$ROOT/_ab/main" main & wait
cat > "$OUT/ab_table.py" <<'PY'
import json, statistics, sys
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
import flashattn_ext
from flashattn_ext import kernel_plan
tree, B, L = sys.argv[1], 4, 4096
def ms(fn, reps=15, warm=3):
    for _ in range(warm): fn()
    torch.cuda.synchronize(); out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize(); out.append(a.elapsed_time(b))
    return round(statistics.median(out), 3)
for E in (64, 128, 256):
    H = 2048 // E
    q, k, v = (torch.randn(B, H, L, E, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn(B, H, L, E, device="cuda", dtype=torch.bfloat16)
    lengths = torch.tensor([L, 3 * L // 4, L // 2, L // 4], device="cuda")
    masks = {"key_padding_mask": (torch.arange(L, device="cuda")[None, :] < lengths[:, None])[:, None, None, :],
             "full_bias": torch.randn(1, H, L, L, device="cuda", dtype=torch.bfloat16)}
    for name, m in masks.items():
        row = {"tree": tree, "module": flashattn_ext.__file__, "E": E, "mask": name,
               "plan_fwd": kernel_plan(q, k, v, 0, attn_bias=m), "plan_bwd": kernel_plan(q, k, v, 0, backward=True, attn_bias=m)}
        impls = {"ours": lambda: flashattn_ext.scaled_dot_product_attention(q, k, v, attn_mask=m)}
        if tree == "main":
            impls["cudnn"] = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=m)
        for impl, f in impls.items():
            try:
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    with torch.no_grad():
                        row[impl + "_fwd_ms"] = ms(f)
                    row[impl + "_fwdbwd_ms"] = ms(lambda: f().backward(do))
            except Exception as e:  # (cuDNN may decline a mask form)
                row[impl + "_error"] = str(e)[:120]
        print(json.dumps(row))
PY
for tree in main branch; do
  dir=$ROOT; [ $tree = main ] && dir=$ROOT/_ab/main
  PYTHONPATH=$dir timeout "$(left 90)" python3 "$OUT/ab_table.py" $tree 2>&1 | tee -a "$OUT/table.jsonl"
done
PYTEST="env PYTHONPATH=$ROOT OMP_NUM_THREADS=2 python3 -m pytest -q -n 8 -k cuda"
timeout "$(left 90)" $PYTEST tests/test_full_bias.py tests/test_key_mask.py tests/test_plan.py > "$OUT/tests.log" 2>&1
tail -3 "$OUT/tests.log"
FLASHATTN_CUDA_KERNELS=wgmma timeout "$(left 60)" $PYTEST tests/test_full_bias.py > "$OUT/tests_wgmma.log" 2>&1
tail -3 "$OUT/tests_wgmma.log"
for tool in memcheck racecheck; do
  PYTHONPATH=$ROOT FLASHATTN_CUDA_KERNELS=wgmma timeout "$(left 75)" compute-sanitizer --tool $tool \
    --error-exitcode 9 python3 scripts/sanitize_cases.py 51 58 > "$OUT/sanitize_$tool.log" 2>&1
  echo "$tool rc=$?"; tail -3 "$OUT/sanitize_$tool.log"
done
for tree in branch main; do
  dir=$ROOT; [ $tree = main ] && dir=$ROOT/_ab/main
  (cd "$dir" && PYTHONPATH=$dir timeout "$(left 45)" python3 benchmarks/bench_features.py --repeats 10 \
    --out-dir "$OUT/features_$tree" > "$OUT/features_$tree.log" 2>&1); tail -12 "$OUT/features_$tree.log"
done
echo "total $(( $(date +%s) - T0 )) s" | tee -a "$OUT/gpu.txt"

#!/usr/bin/env bash
# A sequence that does not fit one GPU, on 4: heads chosen from the GPUs' memory so that one GPU's
# forward+backward needs ~1.3x its memory while a ring rank needs ~0.8x. Results under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
FLASHATTN_BUILD=cuda TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=${MAX_JOBS:-32} \
  python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
heads=$(( mib > 100000 ? 64 : 40 ))
common="--lengths 1048576 --heads $heads --causal 1 --single-max 1048576 --warmup 1 --repeats 2 --ring-only"
python3 benchmarks/bench_ring.py --worlds 4 $common --out "$OUT/ring_1m_w4.json" 2>&1 | tail -5
timeout 300 python3 benchmarks/bench_ring.py --worlds 1 $common --out "$OUT/ring_1m_w1.json" 2>&1 | tail -5
# While the build is here: the fp16 tiny-length dK probe (one GPU).
CUDA_VISIBLE_DEVICES=0 python3 scripts/probe_tiny_fp16.py 300 2>&1 | tee "$OUT/probe_tiny_fp16.txt"

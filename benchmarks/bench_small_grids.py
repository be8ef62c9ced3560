"""GPU benchmark of forwards whose grids leave SMs idle, beside torch SDPA's backends in one run:
decode steps (one query row against a long cache), chunked prefill and short prompts of a small
batch, where the fp16 / bf16 forward splits its last wave's key walks (csrc/cuda/schedule/key_split.cuh)
and calls of few query rows per kv head take the decode kernel (csrc/cuda/sm80/fwd_decode.cuh).
Inference shapes: the forward alone, no gradients, non-causal (every key visible, as a decode step
against its cache), 16 calls captured in a CUDA graph and replayed (the GPU's time, not the host's).
Times: median ms over --repeats (CUDA events); printed beside each, the K / V bytes read once over
the time (GB/s: a decode step's floor is the GPU's memory bandwidth); the JSON has TFLOP/s from
4·B·H·Lq·Lk·E too.

    python benchmarks/bench_small_grids.py [--dtype bf16] [--repeats 30] [--out-dir DIR]
"""
import argparse
import json
import os

import torch

from flashattn_ext import _measure as M

IMPLS = ("ours", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient")
# (B, H, H_kv, Lq, Lk, E): decode steps (MHA, GQA groups of 4 and 8, MQA), speculative steps of a
# few rows, chunked prefill, short prompts.
ROWS = [(1, 32, 32, 1, 4096, 128), (1, 32, 32, 1, 16384, 128), (8, 32, 32, 1, 8192, 128), (1, 32, 8, 1, 16384, 128),
        (8, 32, 8, 1, 8192, 128), (16, 64, 8, 1, 4096, 128), (4, 32, 1, 1, 8192, 128), (1, 16, 16, 1, 32768, 64),
        (8, 32, 4, 1, 8192, 64), (1, 32, 32, 1, 16384, 96), (4, 8, 8, 1, 8192, 256), (4, 16, 4, 1, 8192, 256), (4, 32, 8, 4, 8192, 128),
        (1, 32, 32, 16, 16384, 128), (1, 32, 32, 128, 8192, 128), (2, 16, 16, 256, 4096, 64),
        (1, 16, 16, 512, 8192, 64), (1, 8, 8, 64, 8192, 256), (1, 16, 16, 1024, 1024, 128), (1, 8, 8, 2048, 2048, 256),
        (1, 16, 16, 4096, 4096, 128)]


def measure(impl, row, dtype, repeats):
    b, h, h_kv, lq, lk, e = row
    gen = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(shape, generator=gen).to("cuda", dtype) for shape in
               ((b, h, lq, e), (b, h_kv, lk, e), (b, h_kv, lk, e)))
    attn = M.get_attention(impl, enable_gqa=True)
    try:
        with torch.no_grad():
            attn(q, k, v, False)
            # Replayed from a CUDA graph of 16 calls: these calls take tens of µs, about what the host spends
            # per call (Python, dispatch), which would otherwise be what is timed.
            replay = M.graph_replay(lambda: attn(q, k, v, False), capture_error_mode="relaxed")
            ms = M.per_call_ms(replay, "cuda", warmup=5, repeats=repeats, warmup_s=0.2)
    except (RuntimeError, NotImplementedError, ValueError) as err:
        return {"skipped": str(err).strip().splitlines()[0]}
    # GB/s: the K / V bytes a call must read at least once (the floor of a decode step).
    kv_bytes = 2 * b * h_kv * lk * e * q.element_size()
    return {"ms": ms, "tflops": M.tflops(M.attention_flops(b, h, lq, lk, e, False), ms), "kv_gbps": kv_bytes / ms / 1e6}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--out-dir", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    dtype, impls = M.DTYPES[args.dtype], args.impls.split(",")
    print(torch.cuda.get_device_name(), f"torch {torch.__version__}, {args.dtype}, forward, median of {args.repeats}")
    print(f"{'B':>3s} {'H':>3s} {'Hkv':>3s} {'Lq':>5s} {'Lk':>6s} {'E':>3s} | ms, K/V GB/s "
          + " ".join(f"{i:>14s}" for i in impls) + " | ours/best SDPA")
    results = []
    for row in ROWS:
        got = {impl: measure(impl, row, dtype, args.repeats) for impl in impls}
        sdpa = [got[i]["ms"] for i in impls if i.startswith("sdpa") and "ms" in got[i]]
        ratio = min(sdpa) / got["ours"]["ms"] if sdpa and "ms" in got.get("ours", {}) else None
        cells = " ".join(f"{got[i]['ms']:8.4f} {got[i]['kv_gbps']:5.0f}" if "ms" in got[i] else f"{'-':>14s}"
                         for i in impls)
        print(" ".join(f"{x:>{w}d}" for x, w in zip(row, (3, 3, 3, 5, 6, 3))) + f" | {cells} | "
              + (f"{ratio:.2f}" if ratio else "-"), flush=True)
        results.append({"row": dict(zip(("B", "H", "H_kv", "Lq", "Lk", "E"), row)), **got})
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "small_grids.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "dtype": args.dtype, "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()

"""Host time of one flash_attn_with_kvcache step: µs per call on a tiny cache (default B = 1,
C = 64, H = 2, E = 16, fp32 on the CPU), where the kernels take a few microseconds and the rest is
the Python and dispatcher work before them. The step kinds run interleaved over `--repeats` rounds of a batch of
`--calls` calls each (bench_overhead.interleaved_us: the order rotated per round); best (median) batch.

Steps: read-only dense (int32 cache_seqlens, and an int = C as transformers' decode steps pass),
append dense (tensor and int cache_seqlens), append with rotary (float32 tables, causal), append
into a paged cache, a read-only step with cache_leftpad; torch SDPA on the same dense cache for
scale. The appends write the same cache rows at every call (cache_seqlens does not move), so the
caches stay the same size.

    python benchmarks/bench_kvcache_host.py [--device cuda] [--steps a,b] [--json PATH]
"""
import argparse
import json

import torch
import torch.nn.functional as F

import flashattn_ext
from bench_overhead import interleaved_us

STEPS = ("read", "read-int", "append", "append-int", "rotary", "paged", "leftpad", "sdpa")


def make_steps(batch, cache, heads, dim, page, dtype, device):
    gen = torch.Generator(device="cpu").manual_seed(0)
    randn = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)  # noqa
    q, k, v = randn(batch, 1, heads, dim), randn(batch, 1, heads, dim), randn(batch, 1, heads, dim)
    k_cache, v_cache = randn(batch, cache, heads, dim), randn(batch, cache, heads, dim)
    pages = batch * cache // page
    k_paged, v_paged = randn(pages, page, heads, dim), randn(pages, page, heads, dim)
    table = torch.randperm(pages, generator=gen).view(batch, -1).to(device=device, dtype=torch.int32)
    full = torch.full((batch,), cache, dtype=torch.int32, device=device)
    last = torch.full((batch,), cache - 1, dtype=torch.int32, device=device)
    leftpad = torch.full((batch,), 2, dtype=torch.int32, device=device)
    angle = torch.arange(cache + 2, device=device)[:, None] / 10000 ** (torch.arange(dim // 2, device=device) / dim)
    cos, sin = angle.cos(), angle.sin()
    kv = flashattn_ext.flash_attn_with_kvcache
    sdpa_q, sdpa_k, sdpa_v = q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    return {
        "read": lambda: kv(q, k_cache, v_cache, cache_seqlens=full),
        "read-int": lambda: kv(q, k_cache, v_cache, cache_seqlens=cache, causal=True),
        "append": lambda: kv(q, k_cache, v_cache, k, v, cache_seqlens=last),
        "append-int": lambda: kv(q, k_cache, v_cache, k, v, cache_seqlens=cache - 1),
        "rotary": lambda: kv(q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=last,
                             causal=True),
        "paged": lambda: kv(q, k_paged, v_paged, k, v, cache_seqlens=last, block_table=table),
        "leftpad": lambda: kv(q, k_cache, v_cache, cache_seqlens=full, cache_leftpad=leftpad),
        "sdpa": lambda: F.scaled_dot_product_attention(sdpa_q, sdpa_k, sdpa_v),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, choices=("bf16", "fp16", "fp32"),
                   help="default: bf16 on CUDA, fp32 on the CPU (its half kernels would hide the host time)")
    p.add_argument("--shape", default="1,64,2,16", help="B,C,H,E")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--steps", default=",".join(STEPS))
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", help="write {step: µs per call} here")
    args = p.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
             None: torch.bfloat16 if args.device == "cuda" else torch.float32}[args.dtype]
    batch, cache, heads, dim = (int(x) for x in args.shape.split(","))
    steps = make_steps(batch, cache, heads, dim, args.page_size, dtype, args.device)
    # (grad mode on, as an eager caller's; nothing requires grad)
    timed = interleaved_us({name: steps[name] for name in args.steps.split(",")}, args.device, args.calls,
                           args.repeats)
    results = {name: best for name, (best, _) in timed.items()}
    for name, (best, median) in timed.items():
        print(f"{name:12s} {best:8.1f} ({median:6.1f}) us/call", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()

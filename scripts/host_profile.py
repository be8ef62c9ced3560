"""Where the host time of one small attention call goes: torch.profiler over many forward + backward
calls on a tiny shape (or decode steps on a small cache) (the kernels take microseconds, so the table is the host's Python, dispatcher,
autograd and CUDA runtime calls), and cProfile's Python view of the same calls.

    python scripts/host_profile.py [--device cuda] [--out-dir DIR]
        [--impl ours|sdpa|kvcache|kvcache-append|kvcache-rotary|kvcache-paged] [--forward-only]

--forward-only (ours, sdpa): the forward alone, its inputs requiring grad (bench_overhead.py's "fwd" row).
The decode steps (kvcache*) use B = 1, one new row, a 1024-key cache, H = 32, E = 128 on CUDA, and
C = 64, H = 2, E = 16 on the CPU, whose kernels would otherwise hide the host's part.
"""
import argparse
import cProfile
import io
import os
import pstats

import torch
import torch.nn.functional as F

import flashattn_ext


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--impl", default="ours", choices=("ours", "sdpa", "kvcache", "kvcache-append", "kvcache-rotary",
                                                              "kvcache-paged"))
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--out-dir", default=".")
    p.add_argument("--forward-only", action="store_true")
    args = p.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    q, k, v = (torch.randn(1, 1, 16, 64, device=args.device, dtype=dtype, requires_grad=True) for _ in range(3))
    attn = flashattn_ext.scaled_dot_product_attention if args.impl == "ours" else F.scaled_dot_product_attention

    def step():
        out = attn(q, k, v, is_causal=True)
        if not args.forward_only:
            out.sum().backward()

    if args.impl.startswith("kvcache"):  # one decode step (shapes: the docstring)
        cache, heads, dim = (1024, 32, 128) if args.device == "cuda" else (64, 2, 16)
        qd = torch.randn(1, 1, heads, dim, device=args.device, dtype=dtype)
        kc, vc = (torch.randn(1, cache, heads, dim, device=args.device, dtype=dtype) for _ in range(2))
        # kvcache: a step that only reads the cache; kvcache-append: the new row's key and value
        # appended first (benchmarks/bench_decode.py's step); kvcache-rotary: appended rotated, q
        # rotated too (float32 tables of 2 x cache positions over the whole head, causal);
        # kvcache-paged: appended into pages of 16 keys (the cache's keys in reversed blocks)
        new = [torch.randn(1, 1, heads, dim, device=args.device, dtype=dtype) for _ in range(2)] \
            if args.impl != "kvcache" else [None, None]
        seqlens = torch.full((1,), cache - (new[0] is not None), dtype=torch.int32, device=args.device)
        extra = {}
        if args.impl == "kvcache-rotary":
            angle = torch.arange(2 * cache, device=args.device)[:, None] / 10000 ** (
                torch.arange(dim // 2, device=args.device) / (dim // 2))
            extra = dict(rotary_cos=angle.cos(), rotary_sin=angle.sin(), causal=True)
        if args.impl == "kvcache-paged":
            kc, vc = (t.view(cache // 16, 16, heads, dim).flip(0).contiguous() for t in (kc, vc))
            extra = dict(block_table=torch.arange(cache // 16, device=args.device, dtype=torch.int32).flip(0)[None])

        def step():  # noqa: F811
            flashattn_ext.flash_attn_with_kvcache(qd, kc, vc, *new, cache_seqlens=seqlens, **extra)

    for _ in range(50):
        step()
    if args.device == "cuda":
        torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU]
    if args.device == "cuda":  # shows the CUDA runtime calls (launches, attribute queries) on the host
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(args.calls):
            step()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=45)
    prof_py = cProfile.Profile()
    prof_py.enable()
    for _ in range(args.calls):
        step()
    if args.device == "cuda":
        torch.cuda.synchronize()
    prof_py.disable()
    s = io.StringIO()
    pstats.Stats(prof_py, stream=s).sort_stats("tottime").print_stats(40)
    forward_only = args.forward_only and not args.impl.startswith("kvcache")
    path = os.path.join(args.out_dir, f"host_profile_{args.impl}{'_fwd' if forward_only else ''}_{args.device}.txt")
    with open(path, "w") as f:
        what = {"kvcache": "a read-only decode step", "kvcache-append": "a decode step with its append",
                "kvcache-rotary": "a decode step with its append and rotary",
                "kvcache-paged": "a decode step with its append into pages"}.get(
            args.impl, f"{'fwd' if forward_only else 'fwd+bwd'}, 1x1x16x64 causal")
        f.write(f"{args.calls} calls of {what}, {dtype}, {args.impl}\n\n")
        f.write(table + "\n\n" + s.getvalue())
    print(path)


if __name__ == "__main__":
    main()

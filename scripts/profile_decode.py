"""Nsight Compute on decode steps, ours beside an SDPA backend: each row's step (bench_decode.py's shapes: H = 32,
E = 128 unless given, bf16, one query row) warmed up outside a CUDA profiler range, then called once inside it, so
that `ncu --profile-from-start off` profiles exactly those kernels. Where a short step's time goes (stalls waiting
for instructions, the prologue's latency) shows in ncu's warp-state and scheduler sections:

    ncu --profile-from-start off --section WarpStateStats --section SchedulerStats --section LaunchStats \\
        --section SpeedOfLight python3 scripts/profile_decode.py gqa:1:1024 mqa:1:4096 [--impls ours-read sdpa-cudnn]

A row is KIND:B:C[:E] (mha, gqa or mqa). Implementations are bench_decode.py's (ours: the step with its append;
ours-read: the attention alone; ours-paged-read; sdpa-cudnn, sdpa-flash)."""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import bench_decode as D  # noqa: E402

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("rows", nargs="+", help="KIND:B:C[:E], e.g. gqa:1:1024")
p.add_argument("--impls", nargs="+", default=["ours-read", "sdpa-cudnn"])
p.add_argument("--page-size", type=int, default=256)
args = p.parse_args()

steps = []
for row in args.rows:
    kind, b, cache, *rest = row.split(":")
    heads, dim, group = 32, int(rest[0]) if rest else 128, D.KINDS[kind]
    t = D.make_row(int(b), int(cache), heads, heads // group if group else 1, dim, 1, args.page_size, torch.bfloat16,
                   "cuda")
    for impl in args.impls:
        step = D.step_fn(impl, t)
        for _ in range(2):  # (lazy initialisation and the first launches outside the range)
            step()
        steps.append((f"{row} {impl}", step))
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
for name, step in steps:
    torch.cuda.nvtx.range_push(name)
    step()
    torch.cuda.nvtx.range_pop()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
print("profiled:", ", ".join(name for name, _ in steps))

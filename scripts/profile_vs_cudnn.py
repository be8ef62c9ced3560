"""Nsight Compute beside cuDNN: one forward and one backward per case and implementation, each inside a
CUDA profiler range, so that `ncu --profile-from-start off` profiles exactly those kernels (cuDNN's names
say its tile shapes):

    ncu --profile-from-start off --section LaunchStats --section SpeedOfLight ... \
        python3 scripts/profile_vs_cudnn.py --cases 128:0:1024 256:0:4096 [--impls ours sdpa-cudnn] [--fwd-only]

A case is E:causal:L at B·L = 16384, H·E = 2048 (the benchmark grid's shapes). The kernels of every call are
warmed up twice outside the range first."""
import argparse

import torch

from flashattn_ext import _measure

p = argparse.ArgumentParser()
p.add_argument("--cases", nargs="+", required=True, help="E:causal:L, e.g. 128:0:4096")
p.add_argument("--impls", nargs="+", default=["ours", "sdpa-cudnn"], choices=_measure.IMPLS)
p.add_argument("--dtype", default="bfloat16")
p.add_argument("--fwd-only", action="store_true")
args = p.parse_args()
dtype = getattr(torch, args.dtype)
for case in args.cases:
    e, causal, length = (int(x) for x in case.split(":"))
    q, k, v, dout = _measure.make_inputs(max(1, 16384 // length), 2048 // e, length, e, dtype, "cuda")
    for impl in args.impls:
        attn = _measure.get_attention(impl)
        for _ in range(2):
            out = attn(q, k, v, bool(causal))
            torch.autograd.grad(out, (q, k, v), dout)
        torch.cuda.synchronize()
        print(f"profile: E={e} causal={causal} L={length} {impl}", flush=True)
        torch.cuda.profiler.start()
        out = attn(q, k, v, bool(causal))
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        if not args.fwd_only:
            torch.cuda.profiler.start()
            torch.autograd.grad(out, (q, k, v), dout)
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
print("profile: done")

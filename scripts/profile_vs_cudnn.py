"""Nsight Compute beside cuDNN: one forward and one backward per case and implementation, each inside a
CUDA profiler range, so that `ncu --profile-from-start off` profiles exactly those kernels (cuDNN's names
say its tile shapes):

    ncu --profile-from-start off --section LaunchStats --section SpeedOfLight ... \
        python3 scripts/profile_vs_cudnn.py --cases 128:0:1024 256:0:4096 [--impls ours sdpa-cudnn] [--fwd-only]

A case is E:causal:L at B·L = 16384, H·E = 2048 (the benchmark grid's shapes). `--mask padding` gives every
call a bool (B, 1, 1, L) key padding mask (each sequence keeps a different prefix of its keys), `--mask bias`
a float (1, H, L, L) bias; both non-causal. `--float8`: our float8 forward alone (`flash_attn_func` on e4m3 copies
of the inputs with per-(batch, head) descales, as bench_variants.py --dtype e4m3 times it). The kernels of every
call are warmed up twice outside the range first."""
import argparse

import torch
import torch.nn.functional as F

import flashattn_ext
from flashattn_ext import _measure

p = argparse.ArgumentParser()
p.add_argument("--cases", nargs="+", required=True, help="E:causal:L, e.g. 128:0:4096")
p.add_argument("--impls", nargs="+", default=["ours", "sdpa-cudnn"], choices=_measure.IMPLS)
p.add_argument("--dtype", default="bfloat16")
p.add_argument("--mask", choices=["none", "padding", "bias"], default="none")
p.add_argument("--fwd-only", action="store_true")
p.add_argument("--float8", action="store_true", help="our float8 forward (e4m3, per-head descales) alone")
args = p.parse_args()
if args.float8:
    args.impls, args.fwd_only = ["ours"], True
dtype = getattr(torch, args.dtype)


def attention(impl, mask):
    """f(q, k, v, causal) of an implementation, with the case's mask where there is one."""
    if mask is None:
        return _measure.get_attention(impl)
    if impl.startswith("ours"):
        return lambda q, k, v, causal: flashattn_ext.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    backend = getattr(torch.nn.attention.SDPBackend, _measure.SDPA_BACKENDS.get(impl, "MATH"))

    def forced(q, k, v, causal):
        with torch.nn.attention.sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return forced


for case in args.cases:
    e, causal, length = (int(x) for x in case.split(":"))
    if causal and args.mask != "none":
        p.error(f"case {case}: --mask {args.mask} profiles non-causal cases only")
    b, h = max(1, 16384 // length), 2048 // e
    q, k, v, dout = _measure.make_inputs(b, h, length, e, dtype, "cuda")
    mask = None
    if args.mask == "padding":
        keep = torch.arange(length, device="cuda") < torch.randint(length // 4, length + 1, (b, 1), device="cuda")
        mask = keep[:, None, None, :]
    elif args.mask == "bias":
        mask = torch.randn(1, h, length, length, device="cuda", dtype=dtype)
    for impl in args.impls:
        attn = attention(impl, mask)
        if args.float8:  # (the inputs quantized here, outside the profiled range)
            call = _measure.float8_call(q, k, v, bool(causal))
            attn = lambda *_: call()  # noqa: E731
        for _ in range(2):
            out = attn(q, k, v, bool(causal))
            if not args.fwd_only:
                torch.autograd.grad(out, (q, k, v), dout)
        torch.cuda.synchronize()
        print(f"profile: E={e} causal={causal} L={length} mask={args.mask} {impl}", flush=True)
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

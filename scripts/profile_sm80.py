"""One forward and one backward call per case, for Nsight Compute on a GPU machine:

    ncu --kernel-name regex:"fwd_kernel|bwd_dkdv_kernel" --launch-skip 2 --launch-count 2 \
        --section WarpStateStats --section ComputeWorkloadAnalysis python3 scripts/profile_sm80.py [--mask padding]

The first call of each kind is a warm-up (skipped with --launch-skip 2). `--impl sdpa-efficient`
(or another name of flashattn_ext._measure.IMPLS) runs that implementation's forward and backward
instead, to profile its kernels beside ours (no mask there)."""
import argparse

import torch

import flashattn_ext  # noqa: F401
from flashattn_ext import _measure

p = argparse.ArgumentParser()
p.add_argument("--dtype", default="bfloat16")
p.add_argument("--head-dim", type=int, default=128)
p.add_argument("--len", type=int, default=4096)
p.add_argument("--causal", type=int, default=0)
p.add_argument("--mask", choices=["none", "padding", "bias"], default="none",
               help="padding: a bool (B, 1, 1, L) key padding mask; bias: a float (1, H, L, L) bias")
p.add_argument("--impl", default="ours", choices=_measure.IMPLS)
args = p.parse_args()
dtype = getattr(torch, args.dtype)
L, E = args.len, args.head_dim
B, H = max(1, 16384 // L), 2048 // E
q, k, v = (torch.randn(B, H, L, E, device="cuda", dtype=dtype) for _ in range(3))
bias = None
if args.mask == "padding":  # every sequence keeps a different prefix of its keys
    keep = torch.arange(L, device="cuda") < torch.randint(L // 4, L + 1, (B, 1), device="cuda")
    bias = keep[:, None, None, :].expand(B, H, L, L)
elif args.mask == "bias":
    bias = torch.randn(1, H, L, L, device="cuda", dtype=dtype).expand(B, H, L, L)
if args.impl != "ours":
    attn = _measure.get_attention(args.impl)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    for _ in range(2):
        out = attn(q, k, v, bool(args.causal))
        torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
for _ in range(2 if args.impl == "ours" else 0):
    out, lse = torch.ops.flashattn.fwd(q, k, v, E ** -0.5, args.causal, attn_bias=bias)
    torch.ops.flashattn.bwd(torch.randn_like(out), q, k, v, out, lse, None, E ** -0.5, args.causal, False,
                            attn_bias=bias)
torch.cuda.synchronize()
print("profile_sm80: done")

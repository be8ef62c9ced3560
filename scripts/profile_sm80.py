"""One forward and one backward call per case, for Nsight Compute on the lent GPU:

    ncu --kernel-name regex:"fwd_kernel|bwd_dkdv_kernel" --launch-skip 2 --launch-count 2 \
        --section WarpStateStats --section ComputeWorkloadAnalysis python3 scripts/profile_sm80.py

The first call of each kind is a warm-up (skipped with --launch-skip 2)."""
import argparse

import torch

import flashattn_ext  # noqa: F401

p = argparse.ArgumentParser()
p.add_argument("--dtype", default="bfloat16")
p.add_argument("--head-dim", type=int, default=128)
p.add_argument("--len", type=int, default=4096)
p.add_argument("--causal", type=int, default=0)
args = p.parse_args()
dtype = getattr(torch, args.dtype)
L, E = args.len, args.head_dim
B, H = max(1, 16384 // L), 2048 // E
q, k, v = (torch.randn(B, H, L, E, device="cuda", dtype=dtype) for _ in range(3))
for _ in range(2):
    out, lse = torch.ops.flashattn.fwd(q, k, v, E ** -0.5, args.causal)
    torch.ops.flashattn.bwd(torch.randn_like(out), q, k, v, out, lse, None, E ** -0.5, args.causal, False)
torch.cuda.synchronize()
print("profile_sm80: done")

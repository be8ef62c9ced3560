"""A small representative set of CUDA forward and backward calls for compute-sanitizer
(memcheck, racecheck): ragged lengths, both causal alignments, GQA, every dtype, and both the
tensor-core (sm80/) and the SIMT kernels (run it again with FLASHATTN_CUDA_KERNELS=simt)."""
import torch

import flashattn_ext  # noqa: F401

CASES = [  # (dtype, batch, heads_q, heads_kv, len_q, len_k, head_dim, head_dim_v, causal)
    (torch.float32, 1, 2, 1, 77, 129, 64, 64, 0),
    (torch.bfloat16, 2, 2, 2, 130, 65, 128, 128, 2),
    (torch.float16, 1, 4, 2, 33, 33, 80, 80, 1),
    (torch.float64, 1, 1, 1, 17, 40, 256, 32, 2),
    (torch.float64, 1, 2, 1, 70, 45, 64, 48, 1),
]

for dtype, b, hq, hk, lq, lk, e, ev, causal in CASES:
    q = torch.randn(b, hq, lq, e, device="cuda", dtype=dtype)
    k = torch.randn(b, hk, lk, e, device="cuda", dtype=dtype)
    v = torch.randn(b, hk, lk, ev, device="cuda", dtype=dtype)
    out, lse = torch.ops.flashattn.fwd(q, k, v, e ** -0.5, causal)
    dout = torch.randn_like(out)
    for deterministic in (False, True):
        torch.ops.flashattn.bwd(dout, q, k, v, out, lse, None, e ** -0.5, causal, deterministic)
torch.cuda.synchronize()
print("sanitize_cases: done")

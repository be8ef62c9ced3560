"""GPU benchmark of the optional features beside torch SDPA, in one run: a boolean padding mask,
a float bias, a sliding window and a variable-length batch (bf16, 16384 tokens, H·E = 2048,
E = 128). SDPA has no window or varlen argument, so it gets what a user would give it instead:
the band as an explicit boolean mask, and the sequences padded to the longest with a key
padding mask. Times (median ms, CUDA events) of the forward and of forward+backward; ratios
above 1 mean ours is faster than that SDPA backend.

    python benchmarks/bench_features.py [--repeats 20] [--out-dir DIR]
"""
import argparse
import json
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashattn_ext
from flashattn_ext import _measure as M

BACKENDS = {"sdpa-cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION,
            "sdpa-math": SDPBackend.MATH}
B, H, L, E = 4, 16, 4096, 128
DTYPE = torch.bfloat16


def rand(*shape):
    return torch.randn(*shape, device="cuda", dtype=DTYPE, requires_grad=True)


def sdpa(backend, mask):
    def run(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return run


def cases():
    """name -> (inputs, ours(q, k, v), sdpa_mask): SDPA runs on the same (B, H, L, E) inputs."""
    q, k, v = rand(B, H, L, E), rand(B, H, L, E), rand(B, H, L, E)
    keep = torch.arange(L, device="cuda")[None, :] < torch.tensor([L, 3 * L // 4, L // 2, L // 4],
                                                                    device="cuda")[:, None]
    padding = keep[:, None, None, :]  # (B, 1, 1, L): key padding, broadcast
    bias = torch.randn(1, H, L, L, device="cuda", dtype=DTYPE)  # float bias, broadcast over batch
    i = torch.arange(L, device="cuda")
    band = (i[None, :] <= i[:, None]) & (i[None, :] >= i[:, None] - 512)  # window (512, 0)

    def window(q, k, v):
        return flashattn_ext.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             window_size=(512, 0), causal=True).transpose(1, 2)

    yield "bool padding mask (B,1,1,L)", (q, k, v), \
        lambda q, k, v: flashattn_ext.scaled_dot_product_attention(q, k, v, attn_mask=padding), padding
    yield "float bias (1,H,L,L)", (q, k, v), \
        lambda q, k, v: flashattn_ext.scaled_dot_product_attention(q, k, v, attn_mask=bias), bias
    yield "sliding window (512, 0)", (q, k, v), window, band

    # Varlen: the four sequences of the padding case, packed; SDPA runs the padded batch.
    lens = keep.sum(-1).int()
    cu = torch.zeros(B + 1, device="cuda", dtype=torch.int32)
    cu[1:] = torch.cumsum(lens, 0)
    pack = lambda t: t.transpose(1, 2)[keep].detach().requires_grad_()  # (total, H, E)
    qp, kp, vp = pack(q), pack(k), pack(v)

    def varlen(q, k, v):
        return flashattn_ext.flash_attn_varlen_func(q, k, v, cu, cu, L, L)
    yield "varlen 4 seqs (4096..1024)", (qp, kp, vp), varlen, padding


def timed(fn, inputs, repeats):
    out = fn(*inputs)
    dout = torch.randn_like(out)
    fwd = M.median_ms(lambda: fn(*inputs), "cuda", 3, repeats)
    fwd_bwd = M.median_ms(lambda: torch.autograd.grad(fn(*inputs), inputs, dout), "cuda", 3, repeats)
    return {"fwd_ms": fwd, "fwd_bwd_ms": fwd_bwd}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out-dir", default=os.environ.get("OUT") or ".")
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    rows = []
    print(f"bf16 B={B} H={H} L={L} E={E}; ms fwd / fwd+bwd; ours/x = x's time over ours")
    for name, inputs, ours, mask in cases():
        row = {"case": name, "ours": timed(ours, inputs, args.repeats)}
        q, k, v = (rand(B, H, L, E) for _ in range(3))
        for backend, enum in BACKENDS.items():
            try:
                row[backend] = timed(sdpa(enum, mask), (q, k, v), args.repeats)
            except RuntimeError as e:
                row[backend] = {"skipped": str(e).strip().splitlines()[0]}
        cells = []
        for backend in BACKENDS:
            r = row[backend]
            cells.append(f"{backend} " + ("-" if "skipped" in r else
                         f"{r['fwd_ms'] / row['ours']['fwd_ms']:.2f}x / {r['fwd_bwd_ms'] / row['ours']['fwd_bwd_ms']:.2f}x"))
        print(f"{name:28s} ours {row['ours']['fwd_ms']:.2f} / {row['ours']['fwd_bwd_ms']:.2f} ms | " + " | ".join(cells),
              flush=True)
        rows.append(row)
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "gpu_features.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

"""Reference attention for the tests: torch's SDPA (math backend) in float64, plus the same
SDPA in the input dtype, and the accuracy rule of DESIGN §4 that compares against both.

All helpers take (batch, heads, len, dim) tensors and the op's `causal` codes."""
import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

NONE, TOP_LEFT, BOTTOM_RIGHT = 0, 1, 2
CAUSAL_MODES = (NONE, TOP_LEFT, BOTTOM_RIGHT)
CAUSAL_IDS = ("none", "top_left", "bottom_right")

from flashattn_ext._measure import REL_ATOL, REL_ATOL_GRAD  # noqa: E402  (the accuracy rule's slack)


def lse_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def causal_mask(len_q, len_k, causal, device):
    """Boolean mask (True = key visible) or None. Top-left: j <= i; bottom-right: j <= i + len_k - len_q."""
    if causal == NONE:
        return None
    offset = 0 if causal == TOP_LEFT else len_k - len_q
    i = torch.arange(len_q, device=device)[:, None]
    j = torch.arange(len_k, device=device)[None, :]
    return j <= i + offset


def dead_rows(len_q, len_k, causal, device):
    """Query rows that see no key at all (bottom-right alignment with len_q > len_k)."""
    mask = causal_mask(len_q, len_k, causal, device)
    if mask is None:
        return torch.zeros(len_q, dtype=torch.bool, device=device)
    return ~mask.any(-1)


def expand_kv(t, heads_q):
    """GQA/MQA: repeat each key/value head for its group of query heads."""
    return t if t.shape[-3] == heads_q else t.repeat_interleave(heads_q // t.shape[-3], dim=-3)


def attention(q, k, v, scale, causal, backend=SDPBackend.MATH):
    """(out, lse) from torch's SDPA and logsumexp, computed in q's dtype (lse in the op's lse
    dtype). Fully masked rows give out = 0 and lse = -inf with zero gradients, as the op's
    contract says (done explicitly, so the reference does not depend on torch's version)."""
    hq, lq, lk = q.shape[-3], q.shape[-2], k.shape[-2]
    k, v = expand_kv(k, hq), expand_kv(v, hq)
    mask = causal_mask(lq, lk, causal, q.device)
    dead = dead_rows(lq, lk, causal, q.device)
    with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    out = out.masked_fill(dead[:, None], 0.0)

    acc = lse_dtype(q.dtype)
    s = scale * (q.to(acc) @ k.to(acc).transpose(-1, -2))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    # logsumexp of an all -inf row has a NaN gradient: route dead rows around it.
    lse = torch.logsumexp(s.masked_fill(dead[:, None], 0.0), dim=-1).masked_fill(dead, float("-inf"))
    return out, lse


def attention_composite(q, k, v, scale, causal):
    """Attention from torch's plain ops in q's dtype (matmul, softmax, matmul), as
    flash-attn's own tests build their same-dtype reference."""
    hq, lq, lk = q.shape[-3], q.shape[-2], k.shape[-2]
    k, v = expand_kv(k, hq), expand_kv(v, hq)
    mask = causal_mask(lq, lk, causal, q.device)
    dead = dead_rows(lq, lk, causal, q.device)
    s = (q @ k.transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask | dead[:, None], float("-inf")).masked_fill(dead[:, None], 0.0)
    out = (torch.softmax(s, dim=-1) @ v).masked_fill(dead[:, None], 0.0)
    _, lse = attention(q, k, v, scale, causal)
    return out, lse


def same_dtype_backend(device, len_q, len_k, causal):
    """Backend for 'torch in the input dtype': the math path on CPU (as DESIGN §4 asks); on
    CUDA the backend torch picks by itself, except math where rows are fully masked (the
    fused backends differ there across versions)."""
    if torch.device(device).type == "cpu" or dead_rows(len_q, len_k, causal, "cpu").any():
        return SDPBackend.MATH
    return None


def ours(q, k, v, scale, causal, deterministic=False):
    return torch.ops.flashattn.fwd(q, k, v, scale, causal, deterministic)


def run_with_grads(fn, q, k, v, dout, dlse=None):
    """fn(q, k, v) -> (out, lse) on fresh leaves; returns dict of out, lse, dq, dk, dv, where
    the gradients are those of sum(out * dout) [+ sum(lse * dlse)]."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = fn(q, k, v)
    outputs, grads = [out], [dout.to(out.dtype)]
    if dlse is not None:
        outputs.append(lse)
        grads.append(dlse.to(lse.dtype))
    dq, dk, dv = torch.autograd.grad(outputs, (q, k, v), grads)
    return {"out": out.detach(), "lse": lse.detach(), "dq": dq, "dk": dk, "dv": dv}


def assert_accurate(name, got, ref, same, rel_atol, atol_floor=1.0):
    """DESIGN §4: max|got - ref| <= 2 max|same - ref| + atol, atol = rel_atol * max(max|ref|, atol_floor).
    Infinities (lse of fully masked rows) must sit at the same places with the same sign."""
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != reference {tuple(ref.shape)}"
    got, ref, same = got.double(), ref.double(), same.double()
    assert not got.isnan().any(), f"{name}: NaN at {got.isnan().nonzero()[:5].tolist()}"
    inf = ref.isinf()
    assert torch.equal(got.isinf(), inf), f"{name}: infinities differ from the reference"
    assert torch.equal(got[inf], ref[inf]), f"{name}: infinities of the wrong sign"
    fin = ~inf
    if not fin.any():
        return
    err = (got[fin] - ref[fin]).abs().max().item()
    err_torch = (same[fin] - ref[fin]).nan_to_num(nan=0.0).abs().max().item()
    atol = rel_atol * max(ref[fin].abs().max().item(), atol_floor)
    bound = 2 * err_torch + atol
    assert err <= bound, (f"{name}: max error {err:.3e} > 2 * torch's {err_torch:.3e} + atol {atol:.3e} "
                          f"(max|ref| = {ref[fin].abs().max().item():.3e})")


def check_against_reference(q, k, v, scale, causal, dlse=None, fn=None, atol_floor=1.0):
    """Runs the op (or fn) with gradients and checks out, lse, dq, dk, dv against the float64
    reference with the accuracy rule. Returns our results.

    torch's error ('same') is that of SDPA in the input dtype. For bfloat16 / float16 it is the
    larger of SDPA's and that of the plain-op composite in the input dtype (flash-attn's own
    reference), on every device: on CPU the math path upcasts to float32 inside and rounds only
    its results, while any FlashAttention backward rounds O to the input dtype before
    D = rowsum(dO * O) and dS before dK = dS^T Q; on CUDA the fused backend is one more
    FlashAttention, whose rounding errors may happen to be smaller than ours on a given draw
    (fp16, 2 x 2 scores, E = 256: scripts/probe_tiny_fp16.py).

    atol_floor: magnitude below which errors are measured absolutely (the inputs' scale)."""
    fn = fn or (lambda q_, k_, v_: ours(q_, k_, v_, scale, causal))
    dtype, device = q.dtype, q.device
    lq, lk = q.shape[-2], k.shape[-2]
    dout = torch.randn(q.shape[:-1] + (v.shape[-1],), dtype=dtype, device=device)
    got = run_with_grads(fn, q, k, v, dout, dlse)
    ref = run_with_grads(lambda *t: attention(*t, scale, causal), q.double(), k.double(), v.double(),
                         dout.double(), None if dlse is None else dlse.double())
    backend = same_dtype_backend(device, lq, lk, causal)
    same = run_with_grads(lambda *t: attention(*t, scale, causal, backend), q, k, v, dout, dlse)
    if dtype in (torch.bfloat16, torch.float16):
        plain = run_with_grads(lambda *t: attention_composite(*t, scale, causal), q, k, v, dout, dlse)
        def err(x, name):
            return (x[name].double() - ref[name]).nan_to_num(nan=0.0).abs().max()

        same = {name: plain[name] if err(plain, name) > err(same, name) else same[name] for name in same}
    for name in ("out", "lse", "dq", "dk", "dv"):
        tol = REL_ATOL[lse_dtype(dtype)] if name == "lse" else (REL_ATOL if name == "out" else REL_ATOL_GRAD)[dtype]
        assert got[name].dtype == (lse_dtype(dtype) if name == "lse" else dtype), name
        assert_accurate(name, got[name], ref[name], same[name], tol, atol_floor)
    return got


def make_qkv(batch, heads_q, heads_kv, len_q, len_k, head_dim, head_dim_v, dtype, device):
    q = torch.randn(batch, heads_q, len_q, head_dim, dtype=dtype, device=device)
    k = torch.randn(batch, heads_kv, len_k, head_dim, dtype=dtype, device=device)
    v = torch.randn(batch, heads_kv, len_k, head_dim_v, dtype=dtype, device=device)
    return q, k, v

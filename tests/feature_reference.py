"""Plain-torch reference for the optional features (mask / bias, sliding window, ALiBi,
softcap, dropout, variable-length batches) and the accuracy check that uses it.

`attention_ref` computes attention with plain ops in the dtype of its inputs: run in
float64 it is the reference; run in the input dtype it is "torch in the same dtype" of the
accuracy rule (as flash-attn's own tests build theirs)."""
import torch

from flashattn_ext._measure import REL_ATOL, REL_ATOL_GRAD
from reference import BOTTOM_RIGHT, NONE, TOP_LEFT, assert_accurate, expand_kv, lse_dtype


def visible(len_q, len_k, causal, window, device):
    """(len_q, len_k) bool: key j visible to query i under causal and window (bottom-right)."""
    i = torch.arange(len_q, device=device)[:, None]
    j = torch.arange(len_k, device=device)[None, :]
    ok = torch.ones(len_q, len_k, dtype=torch.bool, device=device)
    if causal != NONE:
        ok &= j <= i + (0 if causal == TOP_LEFT else len_k - len_q)
    left, right = window
    if left >= 0:
        ok &= j >= i + len_k - len_q - left
    if right >= 0:
        ok &= j <= i + len_k - len_q + right
    return ok


def alibi_ref(slopes, batch, heads, len_q, len_k, device):
    """(batch, heads, len_q, len_k) float64 bias -slope * |i + len_k - len_q - j| (flash-attn's)."""
    i = torch.arange(len_q, device=device)[:, None]
    j = torch.arange(len_k, device=device)[None, :]
    dist = (i + len_k - len_q - j).abs().double()
    s = slopes.double().expand(batch, heads) if slopes.dim() == 2 else slopes.double()[None].expand(batch, heads)
    return -s[:, :, None, None] * dist


def attention_ref(q, k, v, scale, causal=NONE, bias=None, window=(-1, -1), alibi=None, softcap=0.0, keep=None,
                  dropout_p=0.0):
    """(out, lse) on (batch, heads, len, dim) tensors; keep is the dropout keep mask
    (batch, heads_q, len_q, len_k). Rows that see no key give out = 0, lse = -inf and no
    NaN gradient."""
    b, hq, lq, _ = q.shape
    lk = k.shape[-2]
    k, v = expand_kv(k, hq), expand_kv(v, hq)
    s = (q @ k.transpose(-1, -2)) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if alibi is not None:
        s = s + alibi_ref(alibi, b, hq, lq, lk, q.device).to(s.dtype)
    if bias is not None:
        s = s.masked_fill(~bias, float("-inf")) if bias.dtype == torch.bool else s + bias.to(s.dtype)
    s = s.masked_fill(~visible(lq, lk, causal, window, q.device), float("-inf"))
    acc = lse_dtype(q.dtype)
    dead = (s == float("-inf")).all(-1, keepdim=True)
    lse = torch.logsumexp(s.to(acc).masked_fill(dead, 0.0), dim=-1, keepdim=True)
    p = torch.exp(s.to(acc) - lse).to(q.dtype)
    if keep is not None:
        p = p * keep / (1 - dropout_p)
    out = (p @ v).masked_fill(dead, 0.0)
    return out, lse.squeeze(-1).masked_fill(dead.squeeze(-1), float("-inf"))


def run_grads(fn, leaves, dout, dlse=None):
    """fn(*leaves) -> (out, lse) on fresh copies of `leaves` (those requiring grad get
    gradients); returns [out, lse, grad of each leaf that requires grad]."""
    leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in leaves]
    out, lse = fn(*leaves)
    outputs, grads = [out], [dout.to(out.dtype)]
    if dlse is not None:
        outputs.append(lse)
        grads.append(dlse.to(lse.dtype))
    wrt = [t for t in leaves if t.requires_grad]
    return [out.detach(), lse.detach()] + list(torch.autograd.grad(outputs, wrt, grads))


def check_features(fn, ref, leaves, dlse=None, names=None):
    """The accuracy rule (DESIGN §4) for fn(*leaves) -> (out, lse) against ref(*leaves) run
    in float64 (reference) and in the leaves' dtype (torch's own error), for out, lse and the
    gradient of every leaf that requires grad. Returns ours as a dict."""
    dtype = leaves[0].dtype
    dout = torch.randn(fn(*[t.detach() for t in leaves])[0].shape, dtype=dtype, device=leaves[0].device)
    got = run_grads(fn, leaves, dout, dlse)
    as64 = [t.double() if t.is_floating_point() else t for t in leaves]
    expected = run_grads(ref, as64, dout.double(), None if dlse is None else dlse.double())
    same = run_grads(ref, leaves, dout, dlse)
    names = names or ["out", "lse"] + [f"grad{i}" for i, t in enumerate(leaves) if t.requires_grad]
    for name, g, r, s in zip(names, got, expected, same):
        if name == "lse":
            tol = REL_ATOL[lse_dtype(dtype)]
        else:
            tol = (REL_ATOL if name == "out" else REL_ATOL_GRAD)[dtype]
        assert_accurate(name, g, r, s, tol)
    return dict(zip(names, got))

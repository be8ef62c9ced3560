"""The attention probabilities of a call, rebuilt from its q, k and row log-sum-exp:
P = exp(S - lse), with S the scores after every modifier the ops apply (scale, softcap,
ALiBi, bias, causal and window). They take O(len_q * len_k) memory: for return_attn_probs
and need_weights, which ask for the whole matrix anyway, never on the fast path."""
import torch

from .ops import CAUSAL_NONE, CAUSAL_TOP_LEFT, dropout_mask


def _visible(len_q, len_k, causal, window, device):
    """(len_q, len_k) bool: key j visible to query i (the Band of csrc/common/score_mods.h)."""
    i = torch.arange(len_q, device=device)[:, None]
    j = torch.arange(len_k, device=device)[None, :]
    off = len_k - len_q
    ok = torch.ones(len_q, len_k, dtype=torch.bool, device=device)
    if causal != CAUSAL_NONE:
        ok &= j <= i + (0 if causal == CAUSAL_TOP_LEFT else off)
    left, right = window
    if left >= 0:
        ok &= j >= i + off - left
    if right >= 0:
        ok &= j <= i + off + right
    return ok


def attention_probs(q, k, lse, scale, causal, window=(-1, -1), softcap=0.0, alibi_slopes=None, attn_bias=None):
    """Probabilities (batch, heads_q, len_q, len_k) in lse's dtype, for (batch, heads, len,
    dim) views q, k, the lse (batch, heads_q, len_q) the op returned for them, and the
    call's options as the op takes them. Rows that see no key are 0. Differentiable."""
    acc = lse.dtype
    heads_q, len_q, len_k = q.shape[1], q.shape[2], k.shape[2]
    if k.shape[1] != heads_q:
        k = k.repeat_interleave(heads_q // k.shape[1], dim=1)
    s = scale * (q.to(acc) @ k.to(acc).transpose(-1, -2))
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if alibi_slopes is not None:
        i = torch.arange(len_q, device=q.device)[:, None]
        j = torch.arange(len_k, device=q.device)[None, :]
        distance = (i + len_k - len_q - j).abs().to(acc)
        slopes = alibi_slopes.to(acc)
        slopes = slopes[None] if slopes.dim() == 1 else slopes
        s = s - slopes[:, :, None, None] * distance
    if attn_bias is not None:
        s = s.masked_fill(~attn_bias, float("-inf")) if attn_bias.dtype == torch.bool else s + attn_bias.to(acc)
    s = s.masked_fill(~_visible(len_q, len_k, causal, window, q.device), float("-inf"))
    p = torch.exp(s - lse[..., None])
    # exp(-inf - (-inf)) is NaN on rows that see no key; their probabilities are 0.
    return p.masked_fill(torch.isinf(lse)[..., None], 0.0)


def with_dropout_signs(p, rng_state, dropout_p):
    """flash-attn's encoding of the dropout pattern in the probabilities: negative where the
    call dropped the score (the ops' keep mask for rng_state), unchanged where it kept it."""
    b, h, lq, lk = p.shape
    keep = dropout_mask(rng_state, b, h, lq, lk, dropout_p).to(p.device)
    return torch.where(keep, p, -p)


def varlen_attention_probs(q, k, lse, scale, causal, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           window=(-1, -1), softcap=0.0, alibi_slopes=None):
    """attention_probs of a variable-length batch, for (1, heads, total, dim) views q, k and
    lse (1, heads_q, total_q): sequence b in [b, :, :len_q, :len_k] of a zero-padded
    (batch, heads_q, max_seqlen_q, max_seqlen_k) tensor."""
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    batch = len(cu_q) - 1
    p = lse.new_zeros((batch, q.shape[1], max_seqlen_q, max_seqlen_k))
    for b in range(batch):
        (q0, q1), (k0, k1) = cu_q[b:b + 2], cu_k[b:b + 2]
        slopes = None if alibi_slopes is None else (alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[b])
        p[b, :, :q1 - q0, :k1 - k0] = attention_probs(
            q[:, :, q0:q1], k[:, :, k0:k1], lse[:, :, q0:q1], scale, causal, window, softcap, slopes)[0]
    return p

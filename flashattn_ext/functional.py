"""Public attention functions. They only reshape views and translate flags; every call
reaches the ops flashattn::fwd / flashattn::bwd on (batch, heads, len, dim) views."""
import math

import torch

from ._checks import check_fwd_args
from .ops import CAUSAL_BOTTOM_RIGHT, CAUSAL_NONE, CAUSAL_TOP_LEFT


def _attention(q, k, v, scale, causal, deterministic):
    check_fwd_args(q, k, v, causal)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1]) if q.shape[-1] > 0 else 1.0
    return torch.ops.flashattn.fwd(q, k, v, float(scale), causal, deterministic)


def _not_yet(name, value, issue_text):
    raise NotImplementedError(f"flashattn_ext: {name}={value!r} is not supported yet ({issue_text}); "
                              f"call it with the default value")


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """Drop-in for torch.nn.functional.scaled_dot_product_attention on (..., H, L, E) tensors.

    The causal mask is aligned top-left, as SDPA's is_causal. Key/value heads may divide the
    query heads when enable_gqa=True. The value head dim may differ from the query's."""
    if attn_mask is not None:
        _not_yet("attn_mask", type(attn_mask).__name__, "arbitrary masks come with the feature-set issue")
    if dropout_p != 0.0:
        _not_yet("dropout_p", dropout_p, "dropout comes with the feature-set issue")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"flashattn_ext: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() < 3:
            raise ValueError(f"flashattn_ext: {name} must have at least 3 dimensions (..., heads, seq_len, "
                             f"head_dim), got shape {tuple(t.shape)}")
    lead = query.shape[:-3]
    for name, t in (("key", key), ("value", value)):
        if t.shape[:-3] != lead:
            raise ValueError(f"flashattn_ext: {name} has leading (batch) dimensions {tuple(t.shape[:-3])} but "
                             f"query has {tuple(lead)}; they must be equal")
    hq, hk = query.shape[-3], key.shape[-3]
    if hq != hk and not enable_gqa:
        raise ValueError(f"flashattn_ext: query has {hq} heads and key has {hk}; pass enable_gqa=True for "
                         f"grouped-query attention, or give them the same number of heads")

    def to_4d(t):
        return t.reshape((-1,) + tuple(t.shape[-3:])) if t.dim() != 4 else t

    out, _ = _attention(to_4d(query), to_4d(key), to_4d(value), scale,
                        CAUSAL_TOP_LEFT if is_causal else CAUSAL_NONE, False)
    return out.reshape(tuple(lead) + tuple(out.shape[1:])) if query.dim() != 4 else out


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_lse=False):
    """flash-attn 2's flash_attn_func on (batch, seq_len, heads, head_dim) tensors.

    The causal mask is aligned bottom-right (query i sees keys j <= i + len_k - len_q).
    Returns out (batch, seq_len_q, heads, head_dim_v), and with return_lse=True also the
    row log-sum-exp (batch, heads, seq_len_q) in float32 (float64 for float64 inputs)."""
    if dropout_p != 0.0:
        _not_yet("dropout_p", dropout_p, "dropout comes with the feature-set issue")
    if tuple(window_size) != (-1, -1):
        _not_yet("window_size", tuple(window_size), "sliding windows come with the feature-set issue")
    if softcap != 0.0:
        _not_yet("softcap", softcap, "softcap comes with the feature-set issue")
    if alibi_slopes is not None:
        _not_yet("alibi_slopes", type(alibi_slopes).__name__, "ALiBi comes with the feature-set issue")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"flashattn_ext: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"flashattn_ext: {name} must have 4 dimensions (batch, seq_len, heads, head_dim), "
                             f"got shape {tuple(t.shape)}")
    out, lse = _attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale,
                          CAUSAL_BOTTOM_RIGHT if causal else CAUSAL_NONE, bool(deterministic))
    out = out.transpose(1, 2)
    return (out, lse) if return_lse else out

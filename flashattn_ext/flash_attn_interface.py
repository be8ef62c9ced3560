"""flash-attn 2's Python API under its own names and argument orders: flash_attn_func,
flash_attn_varlen_func and their packed variants, whose qkv / kv tensors are split into views
(no copy) before the call. `from flashattn_ext.flash_attn_interface import ...` stands in for
`from flash_attn.flash_attn_interface import ...` (flash_attn_with_kvcache lives in kvcache.py).

Every function takes dropout_p, softmax_scale, causal (aligned bottom-right), window_size,
softcap, alibi_slopes and deterministic as functional.flash_attn_func documents them, and
return_attn_probs: with it, the result is flash-attn's (out, softmax_lse, S_dmask), S_dmask
the attention probabilities rebuilt from softmax_lse (see _attn_probs.py), negative where
dropout dropped them. flash-attn returns S_dmask only for testing, and only with dropout;
here it is always returned, always exact, and costs O(len_q * len_k) memory.

Every function also takes FlashAttention-3's q_descale, k_descale, v_descale (keyword only) for
float8 inputs, forward only, as functional.flash_attn_func documents them."""

import torch

from . import fp8, functional
from ._attn_probs import attention_probs, varlen_attention_probs, with_dropout_signs
from .functional import _check_tensors, _count, _real, _scale, _window, checked_fwd, fp8_call
from .kvcache import flash_attn_with_kvcache
from .ops import CAUSAL_BOTTOM_RIGHT, CAUSAL_NONE, new_rng_state, rows_contiguous

__all__ = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache"]


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *, return_lse=False,
                    q_descale=None, k_descale=None, v_descale=None):
    """functional.flash_attn_func (q, k, v of shape (batch, seq_len, heads, head_dim)) with
    flash-attn's return_attn_probs: (out, softmax_lse (batch, heads, seq_len_q), S_dmask
    (batch, heads, seq_len_q, seq_len_k)). return_lse=True gives (out, softmax_lse)."""
    descales = (q_descale, k_descale, v_descale)
    if not return_attn_probs:
        return functional.flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                                          alibi_slopes, deterministic, return_lse=return_lse, q_descale=q_descale,
                                          k_descale=k_descale, v_descale=v_descale)
    _check_tensors((("q", q), ("k", k), ("v", v)), _rank(4, "batch, seq_len, heads, head_dim"))
    out, lse, probs = _forward_and_probs(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p,
                                         softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                         descales=descales)
    return out.transpose(1, 2), lse, probs


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, *, return_lse=False,
                           q_descale=None, k_descale=None, v_descale=None):
    """functional.flash_attn_varlen_func (packed q, k, v of shape (total, heads, head_dim))
    with flash-attn's return_attn_probs: (out, softmax_lse (heads, total_q), S_dmask (batch,
    heads, max_seqlen_q, max_seqlen_k) holding sequence b's probabilities in [b, :, :len_q,
    :len_k], zeros elsewhere). block_table (a paged KV cache) is not supported: it must be None."""
    if block_table is not None:
        raise ValueError(f"flashattn_ext: block_table (a paged KV cache) is not supported; it must be None, got a "
                         f"{type(block_table).__name__}")
    descales = (q_descale, k_descale, v_descale)
    if not return_attn_probs:
        return functional.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                 dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                                 deterministic, return_lse=return_lse, q_descale=q_descale,
                                                 k_descale=k_descale, v_descale=v_descale)
    _check_tensors((("q", q), ("k", k), ("v", v)), _rank(3, "total, heads, head_dim"))
    _check_tensors((("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)), lambda name, t: None)
    # S_dmask's padded lengths: max_seqlen_*, clamped to the rows there are (as the op clamps them).
    varlen = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                  max_seqlen_q=min(_count(max_seqlen_q, "max_seqlen_q"), q.shape[0]),
                  max_seqlen_k=min(_count(max_seqlen_k, "max_seqlen_k"), k.shape[0]))
    out, lse, probs = _forward_and_probs(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                         deterministic, varlen, descales)
    return out[0].transpose(0, 1), lse[0], probs


def _rank(n, dims):
    def rule(name, t):
        if t.dim() != n:
            raise ValueError(f"flashattn_ext: {name} must have {n} dimensions ({dims}), got shape {tuple(t.shape)}")
    return rule


def _forward_and_probs(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                       varlen=None, descales=(None, None, None)):
    """(out, lse, S_dmask) of one call on (batch, heads, len, dim) views (varlen: the op's
    cu_seqlens arguments). The call draws its dropout state here, so that S_dmask can show
    which scores it dropped. A float8 call (fp8.py) runs on its dequantized tensors, with the
    descales in its scale and output; S_dmask is then bfloat16."""
    q, k, v = rows_contiguous(q), rows_contiguous(k), rows_contiguous(v)
    if fp8.requested(q, k, v, *descales):
        varlen = varlen or {}
        call = fp8_call(q, k, v, descales, softmax_scale, dropout_p, CAUSAL_BOTTOM_RIGHT if causal else CAUSAL_NONE,
                        "thd" if varlen else "blhd", varlen.get("cu_seqlens_q"), varlen.get("cu_seqlens_k"))
        return call.run(lambda q, k, v, scale: _forward_and_probs(q, k, v, 0.0, scale, causal, window_size, softcap,
                                                                  alibi_slopes, deterministic, varlen or None))
    scale = _scale(softmax_scale, q.shape[-1], q.dtype, "softmax_scale")
    causal = CAUSAL_BOTTOM_RIGHT if causal else CAUSAL_NONE
    window = _window(window_size)
    softcap, dropout_p = _real(softcap, "softcap", " >= 0 (0 = off)"), _real(dropout_p, "dropout_p", " in [0, 1)")
    rng_state = new_rng_state(q.device) if dropout_p > 0.0 else None
    out, lse = checked_fwd(q, k, v, scale, causal, bool(deterministic), "blhd" if varlen is None else "thd",
                           window_left=window[0], window_right=window[1], alibi_slopes=alibi_slopes, softcap=softcap,
                           dropout_p=dropout_p, rng_state=rng_state, **(varlen or {}))
    if varlen is None:
        probs = attention_probs(q, k, lse, scale, causal, window, softcap, alibi_slopes)
    else:
        probs = varlen_attention_probs(q, k, lse, scale, causal, varlen["cu_seqlens_q"], varlen["cu_seqlens_k"],
                                       varlen["max_seqlen_q"], varlen["max_seqlen_k"], window, softcap, alibi_slopes)
    if rng_state is not None:
        probs = with_dropout_signs(probs, rng_state, dropout_p)
    return out, lse, probs.to(q.dtype)


def _unpack(name, packed, dim, count, layout):
    """The `count` tensors stacked along `dim` of a packed argument, as views."""
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"flashattn_ext: {name} must be a torch.Tensor, got {type(packed).__name__}")
    rank = len(layout.split(","))
    if packed.dim() != rank or packed.shape[dim] != count:
        raise ValueError(f"flashattn_ext: {name} must have shape ({layout}) with {count} at dimension {dim}, got "
                         f"shape {tuple(packed.shape)}")
    return packed.unbind(dim)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                              q_descale=None, k_descale=None, v_descale=None):
    """flash_attn_func on qkv (batch, seq_len, 3, heads, head_dim): q, k, v = qkv[:, :, i].
    Returns out (batch, seq_len, heads, head_dim); its gradient reaches qkv."""
    q, k, v = _unpack("qkv", qkv, 2, 3, "batch, seq_len, 3, heads, head_dim")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, q_descale=q_descale, k_descale=k_descale,
                           v_descale=v_descale)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                             q_descale=None, k_descale=None, v_descale=None):
    """flash_attn_func on q (batch, seq_len_q, heads, head_dim) and kv (batch, seq_len_k, 2,
    heads_kv, head_dim): k, v = kv[:, :, 0], kv[:, :, 1]; heads_kv may divide heads (GQA)."""
    k, v = _unpack("kv", kv, 2, 2, "batch, seq_len_k, 2, heads_kv, head_dim")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, q_descale=q_descale, k_descale=k_descale,
                           v_descale=v_descale)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, *, q_descale=None, k_descale=None,
                                     v_descale=None):
    """flash_attn_varlen_func on qkv (total, 3, heads, head_dim), the same cu_seqlens and
    max_seqlen for queries and keys. Returns out (total, heads, head_dim)."""
    q, k, v = _unpack("qkv", qkv, 1, 3, "total, 3, heads, head_dim")
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
                                  causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
                                  q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                                    q_descale=None, k_descale=None, v_descale=None):
    """flash_attn_varlen_func on q (total_q, heads, head_dim) and kv (total_k, 2, heads_kv,
    head_dim). Returns out (total_q, heads, head_dim)."""
    k, v = _unpack("kv", kv, 1, 2, "total_k, 2, heads_kv, head_dim")
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)

"""Public attention functions. They only reshape views and translate flags; every call
reaches the ops flashattn::fwd / flashattn::bwd on (batch, heads, len, dim) views."""
import math
import operator

import torch

from . import fp8
from ._checks import (FP32_SCALE_LIMIT, call_signature, check_features, check_fwd_args, check_layout, check_scale,
                      passed_before, remember_passed)
from .ops import CAUSAL_BOTTOM_RIGHT, CAUSAL_NONE, CAUSAL_TOP_LEFT, fwd, fwd_plain, new_rng_state, rows_contiguous


def checked_fwd(q, k, v, scale, causal, deterministic=False, layout="bhld", **features):
    """flashattn::fwd after every check of csrc/ops/ that needs no tensor values, in Python
    (so that bad input raises at trace time under torch.compile too; see _checks.py);
    `features` as the op names them; `layout` how the caller passed q, k, v (for messages)."""
    check_fwd_args(q, k, v, causal, layout, paged=features.get("block_table") is not None)
    check_features(q, k, causal, **features)
    return fwd(q, k, v, scale, causal, deterministic, **features)


# Windows this wide reach past any sequence a tensor can hold: unbounded (-1), and within int64.
_UNBOUNDED_WINDOW = 2**62


def _real(value, name, rule=""):
    """float(value) for a scalar argument, with a message naming it."""
    try:
        if isinstance(value, (str, bytes, bool)):
            raise TypeError
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"flashattn_ext: {name} must be a real number{rule}, got {value!r}") from None


def _window(window_size):
    try:
        left, right = window_size
        left, right = int(left), int(right)
    except (TypeError, ValueError):
        raise ValueError(f"flashattn_ext: window_size must be a pair (left, right) of ints (-1 = unbounded), got "
                         f"{window_size!r}") from None
    return tuple(-1 if w >= _UNBOUNDED_WINDOW else w for w in (left, right))


def default_scale(head_dim):
    return 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0


def _scale(scale, head_dim, dtype, name):
    """A call's scale as a float: head_dim^-1/2 where not given, else the argument checked as the op checks it,
    in a message naming it `name` (the argument's name in the caller's signature)."""
    if scale is None:
        return default_scale(head_dim)
    scale = _real(scale, name)
    check_scale(scale, dtype, name)
    return scale


def _is_zero(x):
    """x is a plain number equal to 0: an option left off (anything else goes through _real)."""
    return type(x) in (float, int) and x == 0


def _plain_options(scale, dropout_p, softcap=0.0):
    """No option but the causal flag, and a scale that needs no conversion: a call the public
    functions may take straight to the op once its signature passed the checks."""
    return ((scale is None or (type(scale) is float and -FP32_SCALE_LIMIT <= scale <= FP32_SCALE_LIMIT))
            and _is_zero(dropout_p) and _is_zero(softcap))


def _attention(q, k, v, scale, causal, deterministic, attn_bias=None, window_size=(-1, -1), alibi_slopes=None,
               softcap=0.0, dropout_p=0.0, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0,
               layout="bhld", scale_name="scale"):
    scale = _scale(scale, q.shape[-1], q.dtype, scale_name)
    if (attn_bias is None and alibi_slopes is None and cu_seqlens_q is None and cu_seqlens_k is None and not softcap
            and not dropout_p and window_size == (-1, -1)):
        # No optional feature: the op with its defaults, and only the checks that can fail then (the
        # feature checks pass on defaults). Passing on the eleven feature keywords and checking them
        # cost 8-10 us per call (2-core CPU, bench_overhead.py: forward under no_grad 69 -> 60 us).
        # Those checks run once per signature (the other entry points: attention(), the modules).
        signature = call_signature(q, k, v, "attention", causal)  # (None where a last dimension is not contiguous)
        if not passed_before(signature):
            q, k, v = rows_contiguous(q), rows_contiguous(k), rows_contiguous(v)
            check_fwd_args(q, k, v, causal, layout)
            remember_passed(signature)
        return fwd_plain(q, k, v, scale, causal, deterministic)
    q, k, v = rows_contiguous(q), rows_contiguous(k), rows_contiguous(v)
    dropout_p = _real(dropout_p, "dropout_p", " in [0, 1)")
    softcap = _real(softcap, "softcap", " >= 0 (0 = off)")
    left, right = _window(window_size)
    max_seqlen_q, max_seqlen_k = (_count(n, name) for n, name in ((max_seqlen_q, "max_seqlen_q"),
                                                                  (max_seqlen_k, "max_seqlen_k")))
    return checked_fwd(q, k, v, scale, causal, deterministic, layout, attn_bias=attn_bias, window_left=left,
                       window_right=right, alibi_slopes=alibi_slopes, softcap=softcap, dropout_p=dropout_p,
                       rng_state=new_rng_state(q.device) if dropout_p > 0.0 else None, cu_seqlens_q=cu_seqlens_q,
                       cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)


def fp8_call(q, k, v, descales, softmax_scale, dropout_p, causal, layout, cu_seqlens_q=None, cu_seqlens_k=None,
             features=None):
    """fp8.prepare on the op's views of a float8 call (or of one that gave descales: it says
    why that is wrong), with the scalar arguments read as _attention reads them."""
    scale = _scale(softmax_scale, q.shape[-1], torch.float32, "softmax_scale")  # (float8 accumulates in fp32)
    return fp8.prepare(q, k, v, descales, scale, _real(dropout_p, "dropout_p", " in [0, 1)"), causal, layout,
                       cu_seqlens_q, cu_seqlens_k, features)


def _fp8_attention(q, k, v, descales, softmax_scale, causal, deterministic, dropout_p, layout, **features):
    """(out, lse) of a float8 call on the op's views: the float8 kernel where it takes the call, else
    its dequantized tensors through the bfloat16 path (autocast off, so that it stays bfloat16), the
    output times v_descale."""
    q, k, v = rows_contiguous(q), rows_contiguous(k), rows_contiguous(v)
    call = fp8_call(q, k, v, descales, softmax_scale, dropout_p, causal, layout, features.get("cu_seqlens_q"),
                    features.get("cu_seqlens_k"), features)
    on_kernel = call.run_kernel(causal)
    if on_kernel is not None:
        return on_kernel
    return call.run(lambda q, k, v, scale: _attention(q, k, v, scale, causal, deterministic, layout=layout,
                                                      **features))


def _count(n, name):
    """A non-negative int argument; bounds beyond int64 are clamped (the op clamps a max_seqlen to
    the rows there are)."""
    try:
        if isinstance(n, bool):
            raise TypeError
        n = operator.index(n)
    except TypeError:
        raise TypeError(f"flashattn_ext: {name} must be an int, got {n!r}") from None
    if n < 0:
        raise ValueError(f"flashattn_ext: {name} must be >= 0, got {n}")
    return min(n, 2**63 - 1)


def _check_tensors(names_and_tensors, rank_rule):
    for name, t in names_and_tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"flashattn_ext: {name} must be a torch.Tensor, got {type(t).__name__}")
        check_layout(t, name)
        rank_rule(name, t)


def _sdpa_mask(attn_mask, target, query_dtype):
    """attn_mask as a view (no copy) of len(target) dimensions that broadcasts to `target` =
    (*lead, H, L, S). Broadcast dimensions stay of size 1 (the op reads them with stride 0 and
    sums a float mask's gradient over them in the accumulation dtype); only several leading
    dimensions that are folded into one batch dimension are expanded."""
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"flashattn_ext: attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
    shape = tuple(attn_mask.shape)
    if len(shape) > len(target) or any(s not in (1, t) for s, t in zip(reversed(shape), reversed(target))):
        raise ValueError(f"flashattn_ext: attn_mask of shape {shape} does not broadcast to (*batch, heads, L, S) = "
                         f"{tuple(target)}")
    if attn_mask.dtype not in (torch.bool, query_dtype, torch.float32):
        raise ValueError(f"flashattn_ext: attn_mask must be bool (True = take part) or float (added to the scores) "
                         f"in the query's dtype ({query_dtype}) or float32, got dtype {attn_mask.dtype}")
    mask = attn_mask.reshape((1,) * (len(target) - len(shape)) + shape)
    lead = len(target) - 3
    batch_dims = range(lead)
    if lead > 1 and any(mask.shape[i] != target[i] for i in batch_dims) and any(mask.shape[i] != 1 for i in batch_dims):
        mask = mask.expand(tuple(target[:lead]) + tuple(mask.shape[lead:]))
    return mask


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """Drop-in for torch.nn.functional.scaled_dot_product_attention on (..., H, L, E) tensors.

    attn_mask: bool (True = take part) or float (added to the scores, in the query's dtype
    or float32), broadcastable to (..., H, L, S); read in place through its strides. A float
    mask that requires grad gets its gradient. The causal mask is aligned top-left, as SDPA's
    is_causal, and cannot be combined with attn_mask (as in SDPA). dropout_p drops attention
    probabilities (seeded from torch's generator). Key/value heads may divide the query heads
    when enable_gqa=True. The value head dim may differ from the query's. A row with no key
    to attend to gives 0."""
    causal = CAUSAL_TOP_LEFT if is_causal else CAUSAL_NONE
    signature = None
    if attn_mask is None and _plain_options(scale, dropout_p):
        signature = call_signature(query, key, value, "sdpa", causal, not enable_gqa)
        if passed_before(signature):  # 4-D tensors that passed before (remembered below)
            return fwd_plain(query, key, value, default_scale(query.shape[-1]) if scale is None else scale, causal)[0]

    def at_least_3d(name, t):
        if t.dim() < 3:
            raise ValueError(f"flashattn_ext: {name} must have at least 3 dimensions (..., heads, seq_len, "
                             f"head_dim), got shape {tuple(t.shape)}")

    _check_tensors((("query", query), ("key", key), ("value", value)), at_least_3d)
    lead = query.shape[:-3]
    for name, t in (("key", key), ("value", value)):
        if t.shape[:-3] != lead:
            raise ValueError(f"flashattn_ext: {name} has leading (batch) dimensions {tuple(t.shape[:-3])} but "
                             f"query has {tuple(lead)}; they must be equal")
    hq, hk = query.shape[-3], key.shape[-3]
    if hq != hk and not enable_gqa:
        raise ValueError(f"flashattn_ext: query has {hq} heads and key has {hk}; pass enable_gqa=True for "
                         f"grouped-query attention, or give them the same number of heads")
    if attn_mask is not None and is_causal:
        raise RuntimeError("flashattn_ext: attn_mask and is_causal=True cannot be given together (as in torch "
                           "SDPA); fold the causal mask into attn_mask")

    def to_4d(t):
        return t.reshape((-1,) + tuple(t.shape[-3:])) if t.dim() != 4 else t

    if attn_mask is not None:
        attn_mask = to_4d(_sdpa_mask(attn_mask, tuple(lead) + (hq, query.shape[-2], key.shape[-2]), query.dtype))
    out, _ = _attention(to_4d(query), to_4d(key), to_4d(value), scale, causal, False, attn_bias=attn_mask,
                        dropout_p=dropout_p)
    if query.dim() != 4:
        return out.reshape(tuple(lead) + tuple(out.shape[1:]))
    remember_passed(signature)
    return out


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_lse=False, *, q_descale=None, k_descale=None,
                    v_descale=None):
    """flash-attn 2's flash_attn_func on (batch, seq_len, heads, head_dim) tensors.

    The causal mask is aligned bottom-right (query i sees keys j <= i + len_k - len_q).
    window_size=(left, right): query i sees keys i + len_k - len_q - left <= j <= i + len_k
    - len_q + right (-1 = unbounded; with causal, right is capped at 0). softcap > 0 maps the
    scaled scores s to softcap * tanh(s / softcap). alibi_slopes, float32 (heads,) or
    (batch, heads), adds -slope * |i + len_k - len_q - j|. dropout_p drops attention
    probabilities (seeded from torch's generator). Returns out (batch, seq_len_q, heads,
    head_dim_v), and with return_lse=True also the row log-sum-exp (batch, heads, seq_len_q)
    of the scores the softmax took, in float32 (float64 for float64 inputs).

    Float8 inputs (q, k, v all float8_e4m3fn or all float8_e5m2), forward only, as
    FlashAttention-3 takes them: attention over q * q_descale, k * k_descale, v * v_descale,
    each descale None (1), a number or one-element float32 tensor (per tensor), or a float32
    (batch, heads_kv) tensor (query heads take their kv head's); out in bfloat16. See fp8.py."""
    causal = CAUSAL_BOTTOM_RIGHT if causal else CAUSAL_NONE
    signature = None
    if (q_descale is None and k_descale is None and v_descale is None and alibi_slopes is None
            and _plain_options(softmax_scale, dropout_p, softcap) and type(window_size) is tuple
            and window_size == (-1, -1)):
        signature = call_signature(q, k, v, "flash", causal)
        if passed_before(signature):
            out, lse = fwd_plain(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                 default_scale(q.shape[-1]) if softmax_scale is None else softmax_scale, causal,
                                 bool(deterministic))
            out = out.transpose(1, 2)
            return (out, lse) if return_lse else out

    def four_d(name, t):
        if t.dim() != 4:
            raise ValueError(f"flashattn_ext: {name} must have 4 dimensions (batch, seq_len, heads, head_dim), "
                             f"got shape {tuple(t.shape)}")

    _check_tensors((("q", q), ("k", k), ("v", v)), four_d)
    if fp8.requested(q, k, v, q_descale, k_descale, v_descale):
        out, lse = _fp8_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                  (q_descale, k_descale, v_descale), softmax_scale, causal, bool(deterministic),
                                  dropout_p, "blhd", window_size=window_size, alibi_slopes=alibi_slopes,
                                  softcap=softcap, scale_name="softmax_scale")
        out = out.transpose(1, 2)
        return (out, lse) if return_lse else out
    out, lse = _attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale, causal,
                          bool(deterministic), window_size=window_size, alibi_slopes=alibi_slopes, softcap=softcap,
                          dropout_p=dropout_p, layout="blhd", scale_name="softmax_scale")
    remember_passed(signature)
    out = out.transpose(1, 2)
    return (out, lse) if return_lse else out


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_lse=False, *, q_descale=None, k_descale=None, v_descale=None):
    """flash-attn 2's flash_attn_varlen_func on packed (total, heads, head_dim) tensors.

    Sequence b is rows cu_seqlens_q[b]:cu_seqlens_q[b + 1] of q and cu_seqlens_k[b]:
    cu_seqlens_k[b + 1] of k and v (int32, starting at 0, non-decreasing, ending at the
    total); max_seqlen_q / max_seqlen_k bound their lengths. Every option acts per sequence as
    in flash_attn_func (alibi_slopes may be (batch, heads) with batch = len(cu_seqlens) - 1).
    Returns out (total_q, heads, head_dim_v), and with return_lse=True also lse (heads,
    total_q), flash-attn's packed layout. Float8 inputs and q_descale, k_descale, v_descale as in
    flash_attn_func, a descale tensor of shape (num_sequences, heads_kv)."""
    def three_d(name, t):
        if t.dim() != 3:
            raise ValueError(f"flashattn_ext: {name} must have 3 dimensions (total, heads, head_dim), "
                             f"got shape {tuple(t.shape)}")

    _check_tensors((("q", q), ("k", k), ("v", v)), three_d)
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"flashattn_ext: {name} must be a torch.Tensor, got {type(t).__name__}")
    q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))
    causal = CAUSAL_BOTTOM_RIGHT if causal else CAUSAL_NONE
    varlen = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                  max_seqlen_k=max_seqlen_k)
    if fp8.requested(q, k, v, q_descale, k_descale, v_descale):
        out, lse = _fp8_attention(q, k, v, (q_descale, k_descale, v_descale), softmax_scale, causal,
                                  bool(deterministic), dropout_p, "thd", window_size=window_size,
                                  alibi_slopes=alibi_slopes, softcap=softcap, scale_name="softmax_scale", **varlen)
    else:
        out, lse = _attention(q, k, v, softmax_scale, causal, bool(deterministic), window_size=window_size,
                              alibi_slopes=alibi_slopes, softcap=softcap, dropout_p=dropout_p, layout="thd",
                              scale_name="softmax_scale", **varlen)
    out = out[0].transpose(0, 1)
    return (out, lse[0]) if return_lse else out

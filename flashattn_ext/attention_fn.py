"""flashattn_ext.attention: one public function that takes every feature of the ops together
(mask or bias, causal with either alignment, sliding window, softcap, ALiBi, dropout, scale,
GQA), in either tensor layout. It reshapes views and translates flags like the other public
functions, and reaches the op through the same path (functional._attention)."""
from .functional import _attention, _check_tensors, _sdpa_mask, _window
from .ops import CAUSAL_BOTTOM_RIGHT, CAUSAL_NONE, CAUSAL_TOP_LEFT

LAYOUTS = ("bhld", "blhd")
CAUSAL = {None: CAUSAL_NONE, False: CAUSAL_NONE, "top_left": CAUSAL_TOP_LEFT, "bottom_right": CAUSAL_BOTTOM_RIGHT}


def attention(q, k, v, *, layout="bhld", attn_mask=None, causal=None, window_size=(-1, -1), softcap=0.0,
              alibi_slopes=None, dropout_p=0.0, scale=None, deterministic=False, return_lse=False):
    """Exact attention softmax(modifiers(scale * q k^T)) v with every option at once.

    q (batch, heads, len_q, dim), k and v (batch, heads_kv, len_k, dim / dim_v) with
    layout="bhld" (SDPA's order), or (batch, len, heads, dim) with layout="blhd" (flash-attn's);
    heads_kv must divide heads (grouped-query attention). The scores s = scale * q k^T
    (scale=None: 1 / sqrt(dim)) go through, in this order:
      softcap > 0      s -> softcap * tanh(s / softcap)
      alibi_slopes     float32 (heads,) or (batch, heads): s -= slope * |i + len_k - len_q - j|
      attn_mask        bool (True = take part) or float (added; its gradient is computed when it
                       requires grad) in q's dtype or float32, broadcastable to (batch, heads,
                       len_q, len_k) whatever the layout
      causal           None, "top_left" (key j <= i, SDPA's is_causal) or "bottom_right"
                       (j <= i + len_k - len_q, flash-attn's causal)
      window_size      (left, right), aligned bottom-right: i + len_k - len_q - left <= j <=
                       i + len_k - len_q + right; -1 = unbounded
    then the softmax, dropout with probability dropout_p (seeded from torch's generator), and
    the product with v. A query row that sees no key gives 0. deterministic=True makes the
    backward bitwise reproducible.

    Returns out in q's layout with v's head dim; with return_lse=True, (out, lse), lse
    (batch, heads, len_q) the row log-sum-exp of the final scores, float32 (float64 for
    float64 inputs), -inf on rows that see no key."""
    q, k, v, attn_mask, causal_code = _bhld_inputs(q, k, v, layout, attn_mask, causal)
    out, lse = _attention(q, k, v, scale, causal_code, bool(deterministic), attn_bias=attn_mask,
                          window_size=_window(window_size), alibi_slopes=alibi_slopes, softcap=softcap,
                          dropout_p=dropout_p, layout=layout)
    out = out.transpose(1, 2) if layout == "blhd" else out
    return (out, lse) if return_lse else out


def _bhld_inputs(q, k, v, layout, attn_mask, causal):
    """q, k, v as (batch, heads, len, dim) views, the mask broadcast to (batch, heads, len_q,
    len_k) (a view), and the op's causal code; every argument checked."""
    if layout not in LAYOUTS:
        raise ValueError(f"flashattn_ext: layout must be 'bhld' (batch, heads, len, dim) or 'blhd' (batch, len, "
                         f"heads, dim), got {layout!r}")

    def four_d(name, t):
        if t.dim() != 4:
            order = "(batch, heads, len, dim)" if layout == "bhld" else "(batch, len, heads, dim)"
            raise ValueError(f"flashattn_ext: {name} must have 4 dimensions {order} for layout={layout!r}, got shape "
                             f"{tuple(t.shape)}")

    _check_tensors((("q", q), ("k", k), ("v", v)), four_d)
    if layout == "blhd":
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if causal is not None and causal is not False and causal not in ("top_left", "bottom_right"):
        raise ValueError(f"flashattn_ext: causal must be None, 'top_left' or 'bottom_right', got {causal!r}")
    if attn_mask is not None:
        attn_mask = _sdpa_mask(attn_mask, (q.shape[0], q.shape[1], q.shape[2], k.shape[2]), q.dtype)
    return q, k, v, attn_mask, CAUSAL[causal]

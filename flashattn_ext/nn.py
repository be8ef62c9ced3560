"""nn modules on flashattn_ext's attention: MultiheadAttention, a drop-in for
torch.nn.MultiheadAttention, and Attention, a compact self-attention block (fused qkv
projection, grouped-query heads, causal, sliding window, softcap)."""
import math

import torch
import torch.nn.functional as F

from ._attn_probs import attention_probs
from .attention_fn import _bhld_inputs, attention
from .functional import checked_fwd
from .ops import CAUSAL_NONE, dropout_mask, new_rng_state

__all__ = ["Attention", "MultiheadAttention"]


def _keep_or_bias(mask, name, dtype):
    """torch.nn.MultiheadAttention's mask convention (bool True = masked out, float = added)
    turned into ours: a bool keep mask (True = take part) or a float bias."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"flashattn_ext: {name} must be a torch.Tensor or None, got {type(mask).__name__}")
    if mask.dtype == torch.bool:
        return ~mask
    if not mask.is_floating_point():
        raise ValueError(f"flashattn_ext: {name} must be bool (True = masked out) or float (added to the scores), got "
                         f"dtype {mask.dtype}")
    return mask if mask.dtype in (dtype, torch.float32) else mask.to(dtype)


def _merge(a, b, dtype):
    """One mask that keeps what both keep and adds what both add."""
    if a is None or b is None:
        return a if b is None else b
    if a.dtype == torch.bool and b.dtype == torch.bool:
        return a & b
    def as_bias(m):
        if m.dtype != torch.bool:
            return m
        return torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(~m, -math.inf)

    return as_bias(a) + as_bias(b)


def _pad_keys(mask, extra):
    """`extra` appended key columns (bias_k / zero attention) that every query sees."""
    if mask is None or extra == 0:
        return mask
    return F.pad(mask, (0, extra), value=True if mask.dtype == torch.bool else 0.0)


class MultiheadAttention(torch.nn.MultiheadAttention):
    """torch.nn.MultiheadAttention whose attention runs on flashattn_ext's kernels: the same
    constructor, parameters (so state_dicts load both ways), and forward arguments and results.

    forward(query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
    average_attn_weights=True, is_causal=False): inputs (L, N, E) or, with batch_first=True,
    (N, L, E), or unbatched (L, E); key_padding_mask (N, S) and attn_mask (L, S) or (N * heads,
    L, S), bool (True = masked out) or float (added), as torch's. is_causal=True is the hint
    that attn_mask is the causal mask (it must be given, as in torch); without
    key_padding_mask and weights, the kernel's causal mask replaces it.

    need_weights=True also returns the attention weights (averaged over heads unless
    average_attn_weights=False), rebuilt from the kernel's row log-sum-exp: they cost
    O(L * S) memory, as in torch. With dropout in training they are the dropped and rescaled
    weights the output used. Pass need_weights=False when they are not needed.

    One difference: a query that every mask hides gives 0 here where torch gives NaN. Inside
    torch.nn.TransformerEncoderLayer in inference (eval, no grad), torch's fused fast path
    reads these weights and never calls this forward."""

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        batched = query.dim() == 3
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not isinstance(t, torch.Tensor) or t.dim() != query.dim() or t.dim() not in (2, 3):
                raise ValueError(f"flashattn_ext: query, key and value must all be batched (3-D) or unbatched (2-D) "
                                 f"tensors, got {name} of shape "
                                 f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        if is_causal and attn_mask is None:
            raise ValueError("flashattn_ext: is_causal=True is a hint that attn_mask is the causal mask; attn_mask "
                             "must be given with it (e.g. nn.Transformer.generate_square_subsequent_mask(L))")
        # Batch first from here on: (N, L, E).
        if not batched:
            query, key, value = query[None], key[None], value[None]
            key_padding_mask = None if key_padding_mask is None else key_padding_mask[None]
        elif not self.batch_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        n, len_q, heads, dim = query.shape[0], query.shape[1], self.num_heads, self.head_dim
        q, k, v = self._project(query, key, value)
        extra = 0
        if self.bias_k is not None:
            k = torch.cat([k, self.bias_k.expand(n, 1, -1)], dim=1)
            v = torch.cat([v, self.bias_v.expand(n, 1, -1)], dim=1)
            extra += 1
        q, k, v = (t.unflatten(-1, (heads, dim)) for t in (q, k, v))  # (N, len, heads, head_dim)
        if self.add_zero_attn:
            k = torch.cat([k, k.new_zeros(n, 1, heads, dim)], dim=1)
            v = torch.cat([v, v.new_zeros(n, 1, heads, dim)], dim=1)
            extra += 1
        len_k = k.shape[1]
        causal = None
        if is_causal and key_padding_mask is None and not need_weights:
            attn_mask, causal = None, "top_left"  # as torch: the hint stands for the mask
        mask = _merge(self._attn_mask(attn_mask, n, len_q, len_k - extra, extra, query.dtype),
                      self._padding_mask(key_padding_mask, n, len_k - extra, extra, query.dtype), query.dtype)
        dropout_p = self.dropout if self.training else 0.0
        if need_weights:
            out, weights = self._attention_and_weights(q, k, v, mask, dropout_p)
            weights = weights.mean(dim=1) if average_attn_weights else weights
        else:
            out, weights = attention(q, k, v, layout="blhd", attn_mask=mask, causal=causal, dropout_p=dropout_p), None
        out = F.linear(out.flatten(2), self.out_proj.weight, self.out_proj.bias)
        if not batched:
            return out[0], None if weights is None else weights[0]
        return (out if self.batch_first else out.transpose(0, 1)), weights

    def _project(self, query, key, value):
        if self._qkv_same_embed_dim and query is key and key is value:
            return F.linear(query, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1)
        if self._qkv_same_embed_dim:
            weights = self.in_proj_weight.chunk(3)
        else:
            weights = (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight)
        biases = (None,) * 3 if self.in_proj_bias is None else self.in_proj_bias.chunk(3)
        return tuple(F.linear(x, w, b) for x, w, b in zip((query, key, value), weights, biases))

    def _attn_mask(self, attn_mask, n, len_q, len_k, extra, dtype):
        """attn_mask as a (1 or N, 1 or heads, L, S + extra) mask of ours."""
        if attn_mask is None:
            return None
        mask = _keep_or_bias(attn_mask, "attn_mask", dtype)
        if mask.dim() == 2 and tuple(mask.shape) == (len_q, len_k):
            mask = mask[None, None]
        elif mask.dim() == 3 and tuple(mask.shape) == (n * self.num_heads, len_q, len_k):
            mask = mask.unflatten(0, (n, self.num_heads))
        else:
            raise ValueError(f"flashattn_ext: attn_mask must have shape (L, S) = {(len_q, len_k)} or (N * num_heads, "
                             f"L, S) = {(n * self.num_heads, len_q, len_k)}, got {tuple(attn_mask.shape)}")
        return _pad_keys(mask, extra)

    def _padding_mask(self, key_padding_mask, n, len_k, extra, dtype):
        """key_padding_mask as a (N, 1, 1, S + extra) mask of ours."""
        if key_padding_mask is None:
            return None
        mask = _keep_or_bias(key_padding_mask, "key_padding_mask", dtype)
        if tuple(mask.shape) != (n, len_k):
            raise ValueError(f"flashattn_ext: key_padding_mask must have shape (N, S) = {(n, len_k)}, got "
                             f"{tuple(key_padding_mask.shape)}")
        return _pad_keys(mask[:, None, None, :], extra)

    def _attention_and_weights(self, q, k, v, mask, dropout_p):
        """Output (N, L, heads, head_dim) and weights (N, heads, L, S) of one call."""
        qb, kb, vb, mask, _ = _bhld_inputs(q, k, v, "blhd", mask, None)
        scale = self.head_dim ** -0.5
        rng_state = new_rng_state(q.device) if dropout_p > 0.0 else None  # drawn here: the weights show its mask
        out, lse = checked_fwd(qb, kb, vb, scale, CAUSAL_NONE, False, attn_bias=mask, dropout_p=float(dropout_p),
                               rng_state=rng_state)
        weights = attention_probs(qb, kb, lse, scale, CAUSAL_NONE, attn_bias=mask)
        if rng_state is not None:
            keep = dropout_mask(rng_state, *weights.shape, dropout_p).to(weights.device)
            weights = weights * keep / (1.0 - dropout_p)
        return out.transpose(1, 2), weights.to(q.dtype)


class Attention(torch.nn.Module):
    """Self-attention block: x (batch, len, embed_dim) -> one fused projection to queries
    (num_heads heads) and keys / values (num_kv_heads heads, which must divide num_heads:
    grouped-query attention), attention, and an output projection back to embed_dim.

    causal=True masks future keys; window_size=(left, right) limits each query to the keys
    i - left <= j <= i + right (-1 = unbounded); softcap > 0 caps the scores (softcap *
    tanh(s / softcap)); dropout drops attention probabilities in training. forward(x,
    attn_mask=None) also takes an SDPA-style mask: bool (True = take part) or float (added),
    broadcastable to (batch, num_heads, len, len)."""

    def __init__(self, embed_dim, num_heads, num_kv_heads=None, head_dim=None, bias=True, causal=False,
                 window_size=(-1, -1), softcap=0.0, dropout=0.0, device=None, dtype=None):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads < 1 or num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"flashattn_ext: num_kv_heads ({num_kv_heads}) must be >= 1 and divide num_heads "
                             f"({num_heads})")
        if head_dim is None:
            if embed_dim % num_heads:
                raise ValueError(f"flashattn_ext: embed_dim ({embed_dim}) must be divisible by num_heads "
                                 f"({num_heads}), or give head_dim")
            head_dim = embed_dim // num_heads
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.causal, self.window_size, self.softcap, self.dropout = bool(causal), tuple(window_size), softcap, dropout
        factory = dict(device=device, dtype=dtype)
        self.qkv_proj = torch.nn.Linear(embed_dim, (num_heads + 2 * num_kv_heads) * head_dim, bias=bias, **factory)
        self.out_proj = torch.nn.Linear(num_heads * head_dim, embed_dim, bias=bias, **factory)

    def forward(self, x, attn_mask=None):
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            raise ValueError(f"flashattn_ext: x must be a (batch, len, embed_dim) tensor, got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        qkv = self.qkv_proj(x).unflatten(-1, (self.num_heads + 2 * self.num_kv_heads, self.head_dim))
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=2)
        out = attention(q, k, v, layout="blhd", attn_mask=attn_mask, causal="top_left" if self.causal else None,
                        window_size=self.window_size, softcap=self.softcap,
                        dropout_p=self.dropout if self.training else 0.0)
        return self.out_proj(out.flatten(2))

    def extra_repr(self):
        return (f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"causal={self.causal}, window_size={self.window_size}, softcap={self.softcap}, dropout={self.dropout}")

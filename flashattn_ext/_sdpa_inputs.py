"""flashattn_ext.scaled_dot_product_attention: functional.scaled_dot_product_attention, plus
the inputs of torch's SDPA that are not plain tensors: torch.nn.attention.bias.CausalBias
masks (a causal flag with its alignment) and jagged nested tensors (a variable-length batch,
run through the ops' cu_seqlens path with no padding)."""
import sys

import torch

from . import functional
from .attention_fn import attention
from .functional import _attention
from .ops import CAUSAL_BOTTOM_RIGHT, CAUSAL_NONE, CAUSAL_TOP_LEFT


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """Drop-in for torch.nn.functional.scaled_dot_product_attention, as
    functional.scaled_dot_product_attention (on (..., H, L, E) tensors, bool or float
    attn_mask, causal aligned top-left, GQA with enable_gqa=True, a row with no key gives 0),
    and also:

    attn_mask = torch.nn.attention.bias.causal_upper_left(L, S) / causal_lower_right(L, S)
    (for this call's lengths): the causal mask aligned top-left / bottom-right (key j is
    visible to query i iff j <= i, resp. j <= i + S - L), with no L x S mask built.

    query, key, value jagged nested tensors (torch.nested, layout=torch.jagged) of shape
    (batch, heads, j, head_dim), as SDPA takes them (a (batch, j, heads, head_dim) tensor
    after .transpose(1, 2)), with attn_mask=None: each sequence attends within itself (with
    is_causal, top-left within the sequence), through the variable-length path; the result
    is a nested tensor like query, differentiable."""
    if getattr(query, "is_nested", False) or getattr(key, "is_nested", False) or getattr(value, "is_nested", False):
        return nested_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if attn_mask is not None and is_causal_bias(attn_mask):
        return _causal_bias_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    return functional.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                                   enable_gqa)


def is_causal_bias(mask):
    """Whether mask is a torch.nn.attention.bias.CausalBias. Read from the loaded modules: that
    module imports torch._dynamo (~1.2 s), and a CausalBias exists only once it is imported."""
    module = sys.modules.get("torch.nn.attention.bias")
    return module is not None and isinstance(mask, module.CausalBias)


def _causal_bias_sdpa(query, key, value, bias, dropout_p, is_causal, scale, enable_gqa):
    if is_causal:
        raise RuntimeError("flashattn_ext: attn_mask and is_causal=True cannot be given together (as in torch "
                           "SDPA); a CausalBias already is the causal mask")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() < 3:
            raise ValueError(f"flashattn_ext: {name} must be a tensor with at least 3 dimensions (..., heads, "
                             f"seq_len, head_dim), got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    len_q, len_k = query.shape[-2], key.shape[-2]
    if causal_bias_mode(bias, len_q, len_k) == CAUSAL_TOP_LEFT or len_q == len_k:
        return functional.scaled_dot_product_attention(query, key, value, None, dropout_p, True, scale, enable_gqa)
    # Bottom-right with len_q != len_k: attention() on (batch, heads, len, dim) views.
    lead = query.shape[:-3]
    for name, t in (("key", key), ("value", value)):
        if t.shape[:-3] != lead:
            raise ValueError(f"flashattn_ext: {name} has leading (batch) dimensions {tuple(t.shape[:-3])} but "
                             f"query has {tuple(lead)}; they must be equal")
    if query.shape[-3] != key.shape[-3] and not enable_gqa:
        raise ValueError(f"flashattn_ext: query has {query.shape[-3]} heads and key has {key.shape[-3]}; pass "
                         f"enable_gqa=True for grouped-query attention, or give them the same number of heads")
    out = attention(*(t.reshape((-1,) + tuple(t.shape[-3:])) for t in (query, key, value)), causal="bottom_right",
                    dropout_p=dropout_p, scale=scale)
    return out.reshape(tuple(lead) + tuple(out.shape[1:]))


def causal_bias_mode(bias, len_q, len_k):
    """The op's causal code for causal_upper_left / causal_lower_right, whose lengths must be
    those of the call (the bias stands for a (len_q, len_k) mask)."""
    if (bias.seq_len_q, bias.seq_len_kv) != (len_q, len_k):
        raise ValueError(f"flashattn_ext: attn_mask is a CausalBias for (seq_len_q, seq_len_kv) = ({bias.seq_len_q}, "
                         f"{bias.seq_len_kv}) but query and key have lengths ({len_q}, {len_k}); they must be equal")
    variants = sys.modules["torch.nn.attention.bias"].CausalVariant
    if bias.variant == variants.UPPER_LEFT:
        return CAUSAL_TOP_LEFT
    if bias.variant == variants.LOWER_RIGHT:
        return CAUSAL_BOTTOM_RIGHT
    raise ValueError(f"flashattn_ext: attn_mask is a CausalBias of unknown variant {bias.variant!r}")


def _check_jagged(name, t):
    if not (isinstance(t, torch.Tensor) and t.is_nested):
        got = "a dense tensor" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"flashattn_ext: query, key and value must all be nested tensors or all dense; {name} is "
                         f"{got} while another is nested")
    if t.layout != torch.jagged:
        raise ValueError(f"flashattn_ext: {name} is a nested tensor with layout {t.layout}; only layout=torch.jagged "
                         f"is supported (torch.nested.nested_tensor(..., layout=torch.jagged))")
    if t.dim() != 4 or t._ragged_idx != 2:
        raise ValueError(f"flashattn_ext: {name} must be a jagged nested tensor (batch, heads, j, head_dim), as SDPA "
                         f"takes a (batch, j, heads, head_dim) one after .transpose(1, 2); got shape {tuple(t.shape)} "
                         f"with the ragged dimension at {t._ragged_idx}")
    if t.lengths() is not None:
        raise ValueError(f"flashattn_ext: {name} is a non-contiguous jagged nested tensor (with lengths, i.e. holes "
                         f"between its sequences); pass a contiguous one (.contiguous())")


def _max_seqlen(t):
    cached = getattr(t, "_maybe_max_seqlen", None)
    if cached is not None:
        return int(cached)
    offsets = t.offsets()
    return int((offsets[1:] - offsets[:-1]).max().item()) if offsets.numel() > 1 else 0


def nested_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """SDPA on jagged nested tensors (batch, heads, j, head_dim): each sequence attends within
    itself (is_causal aligned top-left per sequence). Returns a nested tensor like query with
    value's head dim, differentiable with respect to the three inputs."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        _check_jagged(name, t)
    if attn_mask is not None:
        raise ValueError("flashattn_ext: attn_mask cannot be given with nested tensors (the sequences' lengths are "
                         "their mask); pass attn_mask=None")
    if query.shape[0] != key.shape[0] or key.shape[0] != value.shape[0]:
        raise ValueError(f"flashattn_ext: query, key and value must have the same number of sequences, got "
                         f"{query.shape[0]}, {key.shape[0]} and {value.shape[0]}")
    if key.offsets() is not value.offsets() and not torch.equal(key.offsets(), value.offsets()):
        raise ValueError("flashattn_ext: key and value must have the same sequence lengths (the same offsets)")
    if query.shape[1] != key.shape[1] and not enable_gqa:
        raise ValueError(f"flashattn_ext: query has {query.shape[1]} heads and key has {key.shape[1]}; pass "
                         f"enable_gqa=True for grouped-query attention, or give them the same number of heads")
    # values() of a (batch, heads, j, dim) jagged tensor is a (heads, total, dim) view: the
    # (1, heads, total, dim) view the variable-length op takes.
    q, k, v = query.values()[None], key.values()[None], value.values()[None]
    out, _ = _attention(q, k, v, scale, CAUSAL_TOP_LEFT if is_causal else CAUSAL_NONE, False, dropout_p=dropout_p,
                        cu_seqlens_q=query.offsets().to(torch.int32), cu_seqlens_k=key.offsets().to(torch.int32),
                        max_seqlen_q=_max_seqlen(query), max_seqlen_k=_max_seqlen(key))
    nested = torch.nested.nested_tensor_from_jagged(out[0].transpose(0, 1), offsets=query.offsets(),
                                                    max_seqlen=_max_seqlen(query))
    return nested.transpose(1, 2)

"""Hugging Face transformers integration: our kernels as an attention implementation.

    import flashattn_ext.transformers
    name = flashattn_ext.transformers.register()
    model = AutoModelForCausalLM.from_config(config, attn_implementation=name)

register() adds an attention function (AttentionInterface) and a mask function
(AttentionMaskInterface) under one name. The mask function decides how the model's masks
reach the kernels:

- a plain causal, sliding-window causal or bidirectional pattern whose keys are exactly the
  tokens the 2-D padding mask covers (no cache, or a dynamic cache): the 2-D padding mask
  itself, or None when nothing is padded. The attention function then unpads the batch and
  runs the variable-length path (flash_attn_varlen_func: causal aligned bottom-right,
  window and softcap as flags); no (L, S) mask is built. While torch.compile traces, the
  values of the mask cannot be read, so the same 2-D mask becomes a (batch, 1, 1, S)
  key-padding bias read through broadcast strides, again with no (L, S) mask.
- anything else (static caches, whose keys run past the tokens seen; packed sequences;
  custom and/or mask functions; chunked or bidirectional sliding patterns; sliding-window
  patterns while tracing, whose closures the tracer does not show): transformers' own
  boolean SDPA mask, (batch, 1, L, S), passed to the kernels as attn_bias.

A packed row whose sequence boundaries the caller passes (cu_seq_lens_q/k, max_length_q/k,
as transformers' DataCollatorWithFlattening gives them) runs through the variable-length
path whatever the mask. A decode step of generate() with a dynamic cache (a few causal query
rows after the cached keys, no padding or left padding, no gradient) runs through
flash_attn_with_kvcache on the cache transformers has just updated, read in place. This
module imports transformers only when register() is called."""
import torch

from .functional import checked_fwd, flash_attn_varlen_func
from .kvcache import flash_attn_with_kvcache
from .ops import CAUSAL_BOTTOM_RIGHT, CAUSAL_NONE, new_rng_state, rows_contiguous

# transformers treats any implementation name containing "flash" as a kernel to fetch from
# its hub, and names containing "sdpa" or "flex" as its own backends: this one has none.
IMPLEMENTATION = "tiled_exact"

# A causal call with at most this many query rows and more keys than queries is a decode step
# (or a speculative / assisted one): the queries are the newest tokens of a cache.
DECODE_ROWS = 16


_mu = None  # transformers.masking_utils, imported once (register() does it)


def _masking_utils():
    """transformers.masking_utils, imported on first use and kept: torch.compile cannot trace an
    import from transformers' lazy top-level module, so traced code only reads the global."""
    global _mu
    if _mu is None:
        import transformers.masking_utils
        _mu = transformers.masking_utils
    return _mu


def register(name=IMPLEMENTATION):
    """Register the attention and mask functions with transformers under `name` and return
    it, to pass as `attn_implementation=` (from_pretrained, from_config, or
    model.set_attn_implementation)."""
    for word in ("flash", "sdpa", "flex", "paged", "eager"):
        if word in name:
            raise ValueError(f"flashattn_ext: implementation name {name!r} contains {word!r}, which transformers "
                             f"reserves for its own backends; choose a name without it")
    from transformers import AttentionInterface

    AttentionInterface.register(name, attention_forward)
    _masking_utils().AttentionMaskInterface.register(name, mask_for_kernels)
    return name


# ---------------------------------------------------------------------------- mask function

def _closure_values(fn):
    return [cell.cell_contents for cell in (fn.__closure__ or ())]


def _is_sliding_causal(mask_function, window):
    """True when mask_function is transformers' sliding_window_causal_mask_function(window):
    and_masks(sliding_window_overlay(window), causal_mask_function). Read from the closures;
    any other structure answers False (and the mask is then built in full)."""
    mu = _masking_utils()

    if torch.compiler.is_compiling():
        return False  # functions made while tracing do not show their names and closures to the tracer
    if window is None or mask_function.__qualname__ != mu.and_masks(mu.causal_mask_function).__qualname__:
        return False
    parts = [v for v in _closure_values(mask_function) if isinstance(v, tuple)]
    if len(parts) != 1 or len(parts[0]) != 2 or parts[0][1] is not mu.causal_mask_function:
        return False
    overlay = parts[0][0]
    return (getattr(overlay, "__qualname__", None) == mu.sliding_window_overlay(window).__qualname__
            and _closure_values(overlay) == [window])


def _is_plain_pattern(mask_function, local_size):
    mu = _masking_utils()

    return (mask_function is mu.causal_mask_function or mask_function is mu.bidirectional_mask_function
            or _is_sliding_causal(mask_function, local_size))


def mask_for_kernels(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                     attention_mask=None, local_size=None, use_vmap=False, **kwargs):
    """The AttentionMaskInterface function: None, a 2-D (batch, kv_length) padding mask, or a
    4-D boolean mask (see the module docstring for which, and what each means)."""
    mu = _masking_utils()

    if mask_function is None:
        mask_function = mu.causal_mask_function
    keys_end = kv_offset + kv_length
    queries_are_last_keys = isinstance(q_offset, int) and q_offset + q_length == keys_end
    if (not use_vmap and queries_are_last_keys and _is_plain_pattern(mask_function, local_size)
            and (attention_mask is None or attention_mask.shape[-1] == keys_end)):
        if attention_mask is None:
            return None
        padding = attention_mask[:, kv_offset:].to(torch.bool)
        if not torch.compiler.is_compiling() and bool(padding.all()):
            return None
        return padding
    args = dict(kwargs, batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                local_size=local_size, use_vmap=use_vmap)
    mask = mu.sdpa_mask(**args)
    if mask is None and q_length > 1 and kv_length != q_length:
        # transformers skips the mask there for SDPA's top-left is_causal; ours reads a missing
        # mask as causal aligned bottom-right, so build it.
        mask = mu.sdpa_mask(**dict(args, allow_is_causal_skip=False))
    return mask


# ----------------------------------------------------------------------- attention function

def _window(sliding_window, causal):
    """transformers' sliding patterns as (left, right): causal keeps keys j with
    i - window < j <= i, bidirectional keeps |i - j| <= window."""
    if sliding_window is None:
        return (-1, -1)
    return (int(sliding_window) - 1, 0) if causal else (int(sliding_window), int(sliding_window))


def _one_run(padding):
    """True when every row keeps one contiguous run of tokens (left or right padding): then a
    token's rank among the kept ones differs from its position by a per-row constant, and a
    window over ranks (the packed layout) is the window over positions."""
    positions = torch.arange(padding.shape[1], device=padding.device)
    first = torch.where(padding, positions, padding.shape[1]).amin(1)
    last = torch.where(padding, positions, -1).amax(1)
    count = padding.sum(1)
    return bool(((count == 0) | (last - first + 1 == count)).all())


def _unpadded_attention(query, key, value, key_padding, causal, **options):
    """Attention over the keys the 2-D padding mask keeps, packed (no padding in the kernels).
    Causal: the queries are the last len_q keys and are packed by the same mask (padded query
    rows come out as zeros). Not causal (encoders, cross-attention): every query row runs,
    against its row's kept keys."""
    batch, heads_q, len_q, _ = query.shape
    lengths_k = key_padding.sum(1, dtype=torch.int32)
    k, v = (t.transpose(1, 2)[key_padding] for t in (key, value))
    if causal:
        keep_q = key_padding[:, -len_q:]
        q, lengths_q = query.transpose(1, 2)[keep_q], keep_q.sum(1, dtype=torch.int32)
    else:
        q = query.transpose(1, 2).reshape(batch * len_q, heads_q, query.shape[-1])
        lengths_q = torch.full((batch,), len_q, dtype=torch.int32, device=query.device)
    cu_q = torch.nn.functional.pad(lengths_q.cumsum(0, dtype=torch.int32), (1, 0))
    cu_k = torch.nn.functional.pad(lengths_k.cumsum(0, dtype=torch.int32), (1, 0))
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, int(lengths_q.max()), int(lengths_k.max()), causal=causal,
                                 **options)
    if not causal:
        return out.reshape(batch, len_q, heads_q, out.shape[-1])
    return out.new_zeros((batch, len_q, heads_q, out.shape[-1])).index_put((keep_q,), out)


def _packed_sequences(query, kwargs):
    """(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) when the caller passed the
    sequence boundaries of a packed row (transformers' DataCollatorWithFlattening with
    return_flash_attn_kwargs=True) and they can be read, else None (the mask then says it)."""
    names = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
    if query.shape[0] != 1 or torch.compiler.is_compiling() or any(kwargs.get(n) is None for n in names):
        return None
    cu_q, cu_k, max_q, max_k = (kwargs[n] for n in names)
    return cu_q.to(torch.int32), cu_k.to(torch.int32), int(max_q), int(max_k)


def _dense_attention(query, key, value, scale, causal, bias, window, softcap, dropout):
    out, _ = checked_fwd(query, key, value, scale, causal, attn_bias=bias, window_left=window[0],
                         window_right=window[1], softcap=softcap, dropout_p=dropout,
                         rng_state=new_rng_state(query.device) if dropout > 0.0 else None)
    return out.transpose(1, 2).contiguous()


def _attention_with_position_bias(query, key, value, attention_mask, position_bias, scale, causal, window, softcap,
                                  dropout):
    """T5-style models: a float (batch or 1, heads, len_q, len_k) bias added to the scores
    (learned: it gets its gradient), the mask folded into it as -inf."""
    bias = position_bias if position_bias.dtype in (query.dtype, torch.float32) else position_bias.float()
    flag = CAUSAL_BOTTOM_RIGHT if causal else CAUSAL_NONE
    if attention_mask is not None and attention_mask.dim() == 4:
        flag, window = CAUSAL_NONE, (-1, -1)  # the mask holds the pattern
        keep = attention_mask if attention_mask.dtype == torch.bool else None
        bias = bias + attention_mask.to(bias.dtype) if keep is None else bias.masked_fill(~keep, float("-inf"))
    elif attention_mask is not None:
        bias = bias.masked_fill(~attention_mask.to(torch.bool)[:, None, None, :], float("-inf"))
    return _dense_attention(query, key, value, scale, flag, bias, window, softcap, dropout)


def _left_padding(padding):
    """(batch,) int32 count of leading pad tokens when every row of the 2-D mask is pad tokens
    then real ones (a left-padded batch), else None (right padding, holes)."""
    ordered = (padding[:, 1:] >= padding[:, :-1]).all() & padding[:, -1].all()
    return (~padding).sum(1, dtype=torch.int32) if bool(ordered) else None


def _decode_step(query, key, value, attention_mask, causal, dropout, scale, window, softcap):
    """A decode step through flash_attn_with_kvcache, or None when the call is not one. The keys
    and values are the cache transformers has just updated (the new tokens appended), read in
    place as (batch, keys, kv_heads, dim) views: no new k/v, every row's cache full, the left
    padding as cache_leftpad. Not while tracing (the padding must be read), with gradients
    (flash_attn_with_kvcache is forward only) or dropout."""
    len_q, len_k = query.shape[2], key.shape[2]
    if (not causal or dropout > 0.0 or not 0 < len_q <= DECODE_ROWS or len_k <= len_q
            or torch.compiler.is_compiling()
            or (torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)))):
        return None
    leftpad = None
    if attention_mask is not None:
        if attention_mask.dim() != 2 or tuple(attention_mask.shape) != (key.shape[0], len_k):
            return None
        leftpad = _left_padding(attention_mask.to(torch.bool))
        if leftpad is None:
            return None
    out = flash_attn_with_kvcache(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                  cache_seqlens=len_k, cache_leftpad=leftpad, softmax_scale=scale, causal=True,
                                  window_size=window, softcap=softcap)
    return out.contiguous()


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                      softcap=None, is_causal=None, **kwargs):
    """The AttentionInterface function: query (batch, heads, len_q, dim), key and value
    (batch, kv_heads, len_k, dim) with kv_heads dividing heads (grouped-query attention
    needs no copy); returns (out (batch, len_q, heads, dim_v), None)."""
    query, key, value = rows_contiguous(query), rows_contiguous(key), rows_contiguous(value)
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    softcap, dropout = float(softcap or 0.0), float(dropout)
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    causal = bool(is_causal) and query.shape[2] > 1
    window = _window(sliding_window, bool(is_causal))
    for sink in ("s_aux", "sinks"):
        if kwargs.get(sink) is not None:
            raise ValueError(f"flashattn_ext: attention sinks ({sink}=..., one learned logit per head that takes "
                             f"part in the softmax) are not supported by our kernels; use attn_implementation="
                             f"'eager' for this model")
    if kwargs.get("position_bias") is not None:
        return _attention_with_position_bias(query, key, value, attention_mask, kwargs["position_bias"], scale,
                                             causal, window, softcap, dropout), None
    packed = _packed_sequences(query, kwargs)
    if packed is not None:  # the boundaries say what the mask would
        out = flash_attn_varlen_func(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                                     *packed, dropout_p=dropout, softmax_scale=scale, causal=causal,
                                     window_size=window, softcap=softcap)
        return out[None].contiguous(), None
    if attention_mask is not None and attention_mask.dim() == 4:
        # A full mask already holds the causal and window patterns.
        bias = attention_mask
        if bias.dtype not in (torch.bool, query.dtype, torch.float32):
            bias = bias.to(torch.float32)
        return _dense_attention(query, key, value, scale, CAUSAL_NONE, bias, (-1, -1), softcap, dropout), None
    decoded = _decode_step(query, key, value, attention_mask, bool(is_causal), dropout, scale, window, softcap)
    if decoded is not None:
        return decoded, None
    flag = CAUSAL_BOTTOM_RIGHT if causal else CAUSAL_NONE
    if attention_mask is None:
        return _dense_attention(query, key, value, scale, flag, None, window, softcap, dropout), None
    if (attention_mask.dim() != 2 or tuple(attention_mask.shape) != (key.shape[0], key.shape[2])
            or query.shape[2] > key.shape[2]):
        raise ValueError(f"flashattn_ext: attention_mask must be 4-D (batch, heads or 1, len_q, len_k) or a 2-D "
                         f"padding mask (batch, len_k) = {(key.shape[0], key.shape[2])} with len_q <= len_k (the "
                         f"queries are the last keys), got shape {tuple(attention_mask.shape)} and len_q "
                         f"{query.shape[2]}")
    padding = attention_mask.to(torch.bool)
    # A window over packed keys is one over positions only for causal rows of one run of tokens.
    if not torch.compiler.is_compiling() and (window == (-1, -1) or (causal and _one_run(padding))):
        out = _unpadded_attention(query, key, value, padding, causal, dropout_p=dropout, softmax_scale=scale,
                                  window_size=window, softcap=softcap)
        return out, None
    # Tracing (values unreadable) or a window over gaps in the padding: the key padding as a
    # (batch, 1, 1, len_k) bias broadcast over heads and queries, positions as they are.
    return _dense_attention(query, key, value, scale, flag, padding[:, None, None, :], window, softcap, dropout), None

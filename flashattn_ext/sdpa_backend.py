"""Our kernels as the flash backend of torch's own scaled_dot_product_attention (CUDA).

torch (>= 2.11) lets a library replace the CUDA kernels behind SDPA's flash backend:
`torch.nn.attention.register_flash_attention_impl(name, register_fn=...)` records a function
that `activate_flash_attention_impl(name)` calls; it registers Python kernels for the aten ops
the flash backend dispatches to and returns a handle whose remove() undoes that
(`restore_flash_attention_impl()`). flashattn_ext registers itself under the name
"flashattn_ext" on import (sdpa.py). Once active, SDPA calls that torch routes to its flash
backend (fp16/bf16 on sm80+, no attn_mask, head dim <= 256; torch decides) run here:

  aten::_scaled_dot_product_flash_attention(_backward)   dense (batch, heads, len, dim) SDPA
  aten::_flash_attention_forward(_backward), aten::_flash_attention_forward_no_dropout_inplace
      flash-attn 2 layout, dense (batch, len, heads, dim) or packed with cum_seq_q/k
      (nested tensors, torch.nn.attention.varlen)

Contract notes: causal is aligned top-left in the SDPA ops and bottom-right in the
_flash_attention ops (flash-attn 2's convention), window sizes and ALiBi slopes are passed on;
paged KV (block_table), seqused_k, num_splits > 1 and return_debug_mask have no counterpart in
our kernels and raise. Dropout draws [seed, offset] from torch's generator of the
inputs' device (our Philox stream, not torch's flash stream) and hands it to the backward in
the rng_state slot, an int64 pair on that device viewed as uint64 (the slot's dtype)."""
import torch

from . import ops
from ._checks import check_features, check_fwd_args
from .ops import CAUSAL_BOTTOM_RIGHT, CAUSAL_NONE, CAUSAL_TOP_LEFT, new_rng_state

NAME = "flashattn_ext"


def _contiguous_last(t):
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def _scale(scale, query):
    return float(scale) if scale is not None else query.shape[-1] ** -0.5


def _window(left, right):
    return (-1 if left is None else int(left)), (-1 if right is None else int(right))


def _refuse(what, value):
    raise RuntimeError(f"flashattn_ext (SDPA flash backend): {what} is not supported by our kernels, got {value!r}; "
                       f"call torch.nn.attention.restore_flash_attention_impl() to use torch's own flash kernels "
                       f"for such calls")


def _forward(q, k, v, scale, causal, **features):
    """The forward kernel on (batch, heads, len, dim) views, every argument checked in Python first."""
    q, k, v = _contiguous_last(q), _contiguous_last(k), _contiguous_last(v)
    check_fwd_args(q, k, v, causal)
    check_features(q, k, causal, **features)
    return ops._fwd_kernel(q, k, v, scale, causal, torch.are_deterministic_algorithms_enabled(), **features)


def _backward(dout, q, k, v, out, lse, scale, causal, **features):
    dq, dk, dv, _ = ops._bwd_kernel(_contiguous_last(dout), _contiguous_last(q), _contiguous_last(k),
                                    _contiguous_last(v), out, lse, None, scale, causal,
                                    torch.are_deterministic_algorithms_enabled(), **features)
    return dq, dk, dv


def _rng_state(dropout_p, device):
    """(features for the kernel, the rng_state slot of the aten op's outputs)."""
    if dropout_p <= 0.0:
        return {}, torch.zeros((2,), dtype=torch.uint64, device=device)
    state = new_rng_state(device)
    return {"dropout_p": float(dropout_p), "rng_state": state}, state.view(torch.uint64)


def _dropout_features(dropout_p, rng_state):
    if dropout_p <= 0.0:
        return {}
    return {"dropout_p": float(dropout_p), "rng_state": rng_state.view(torch.int64)}


# ------------------------------------------------------------- SDPA: (batch, heads, len, dim)

def sdpa_flash_forward(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    if return_debug_mask:
        _refuse("return_debug_mask", True)
    dropout, rng_out = _rng_state(dropout_p, query.device)
    out, lse = _forward(query, key, value, _scale(scale, query), CAUSAL_TOP_LEFT if is_causal else CAUSAL_NONE,
                        **dropout)
    debug = query.new_empty((0,))
    return out, lse, None, None, query.shape[2], key.shape[2], rng_out, torch.empty((), dtype=torch.uint64,
                                                                                     device=query.device), debug


def sdpa_flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                        is_causal, philox_seed, philox_offset, *, scale=None):
    return _backward(grad_out, query, key, value, out, logsumexp, _scale(scale, query),
                     CAUSAL_TOP_LEFT if is_causal else CAUSAL_NONE, **_dropout_features(dropout_p, philox_seed))


# ------------------------------------ flash-attn 2 layout: (batch, len, heads, dim) or packed

def _to_ours(t, packed):
    """(batch, len, heads, dim) -> (batch, heads, len, dim); packed (total, heads, dim) ->
    (1, heads, total, dim). Views, no copy."""
    return t.transpose(0, 1)[None] if packed else t.transpose(1, 2)


def _from_ours(t, packed):
    return t[0].transpose(0, 1) if packed else t.transpose(1, 2)


def _flash_features(cum_seq_q, cum_seq_k, max_q, max_k, window_size_left, window_size_right, alibi_slopes=None):
    left, right = _window(window_size_left, window_size_right)
    features = {"window_left": left, "window_right": right}
    if alibi_slopes is not None:
        features["alibi_slopes"] = alibi_slopes
    if cum_seq_q is not None:
        features.update(cu_seqlens_q=cum_seq_q.to(torch.int32), cu_seqlens_k=cum_seq_k.to(torch.int32),
                        max_seqlen_q=int(max_q), max_seqlen_k=int(max_k))
    return features


def flash_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *,
                  scale=None, window_size_left=None, window_size_right=None, seqused_k=None, alibi_slopes=None,
                  block_table=None, num_splits=None):
    for what, value_given, unsupported in (("return_debug_mask", return_debug_mask, bool(return_debug_mask)),
                                           ("seqused_k", seqused_k, seqused_k is not None),
                                           ("block_table (paged KV)", block_table, block_table is not None),
                                           ("num_splits > 1", num_splits, num_splits is not None and num_splits > 1)):
        if unsupported:
            _refuse(what, value_given)
    packed = cum_seq_q is not None
    dropout, rng_out = _rng_state(dropout_p, query.device)
    out, lse = _forward(_to_ours(query, packed), _to_ours(key, packed), _to_ours(value, packed),
                        _scale(scale, query), CAUSAL_BOTTOM_RIGHT if is_causal else CAUSAL_NONE,
                        **_flash_features(cum_seq_q, cum_seq_k, max_q, max_k, window_size_left, window_size_right,
                                          alibi_slopes), **dropout)
    return (_from_ours(out, packed), lse[0] if packed else lse, rng_out,
            torch.empty((), dtype=torch.uint64, device=query.device), query.new_empty((0,)))


def flash_forward_no_dropout_inplace(out, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                                     return_debug_mask, *, scale=None, window_size_left=None, window_size_right=None,
                                     seqused_k=None, alibi_slopes=None, block_table=None, num_splits=None):
    if dropout_p != 0.0:
        _refuse("dropout_p in the no-dropout op", dropout_p)
    result, lse, *_ = flash_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, 0.0, is_causal,
                                    return_debug_mask, scale=scale, window_size_left=window_size_left,
                                    window_size_right=window_size_right, seqused_k=seqused_k,
                                    alibi_slopes=alibi_slopes, block_table=block_table, num_splits=num_splits)
    out.copy_(result)
    return lse


def flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                   is_causal, rng_state, unused, *, scale=None, window_size_left=None, window_size_right=None):
    packed = cum_seq_q is not None
    lse = logsumexp[None] if packed else logsumexp
    grads = _backward(_to_ours(grad_out, packed), _to_ours(query, packed), _to_ours(key, packed),
                      _to_ours(value, packed), _to_ours(out, packed), lse, _scale(scale, query),
                      CAUSAL_BOTTOM_RIGHT if is_causal else CAUSAL_NONE,
                      **_flash_features(cum_seq_q, cum_seq_k, max_q, max_k, window_size_left, window_size_right),
                      **_dropout_features(dropout_p, rng_state))
    return tuple(_from_ours(g, packed) for g in grads)


KERNELS = {
    "_scaled_dot_product_flash_attention": sdpa_flash_forward,
    "_scaled_dot_product_flash_attention_backward": sdpa_flash_backward,
    "_flash_attention_forward": flash_forward,
    "_flash_attention_forward_no_dropout_inplace": flash_forward_no_dropout_inplace,
    "_flash_attention_backward": flash_backward,
}


class _Handle:
    """What activate_flash_attention_impl keeps; remove() drops the registrations."""

    def __init__(self, library):
        self.library = library

    def remove(self):
        if self.library is not None:
            self.library._destroy()
            self.library = None


def activate():
    """The register_fn torch calls on activate_flash_attention_impl("flashattn_ext")."""
    from . import has_cuda_kernels
    if not has_cuda_kernels():
        raise RuntimeError("flashattn_ext: this build has no CUDA kernels, so it cannot serve as SDPA's (CUDA) flash "
                           "backend; use flashattn_ext.sdpa.enabled() on the CPU")
    library = torch.library.Library("aten", "IMPL", "CUDA")
    for op, kernel in KERNELS.items():
        if hasattr(torch.ops.aten, op):  # not every torch with the hook has every op
            library.impl(op, kernel, "CUDA")
    return _Handle(library)


def register_with_torch():
    """Make "flashattn_ext" known to torch.nn.attention's registry, where this torch has one."""
    import torch.nn.attention as attention
    if hasattr(attention, "register_flash_attention_impl"):
        attention.register_flash_attention_impl(NAME, register_fn=activate)

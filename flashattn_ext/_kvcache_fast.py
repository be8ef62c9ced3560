"""The common decode step of flash_attn_with_kvcache in a few Python steps: one row per sequence
in a dense cache, or pages through a block_table, and left padding; new keys and values to append
or none; rotary tables; cache_seqlens an int32 tensor or an int (or None with nothing else);
softmax_scale and causal; nothing else. Such a call needs only the checks below, which read no
tensor value on CUDA and cost a few microseconds, and runs as one call of the C++ op
flashattn::_kvcache_step: flashattn::kvcache_append's kernel (the append, the rotary embedding of
q and the new keys, and the value rules of lengths, pages, left padding and rotary positions) and
flashattn::fwd's, with no Python between them (a read-only CUDA step that the decode kernel serves:
that kernel alone, which applies the same rules). A call these checks do not pass, the invalid ones
included, returns None here and takes the general path (kvcache._resolve), whose errors are the
documented ones. Values out of range are the ops' own rules on CUDA (no write, NaN rows); the
CPU, where they are on the host, raises on them as the general path does, with its messages."""
import math

import torch

from ._checks import DTYPE_NAMES, FP32_SCALE_LIMIT, MAX_HEAD_DIM
from ._kvcache_values import PAGE_MULTIPLE, raise_on_bad_lengths, raise_on_bad_positions, raise_on_bad_ranges
from .ops import run_kvcache_step

_Tensor = torch.Tensor
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)


def _index(t, shape, device):
    """t is a plain int32 tensor of `shape` on `device` with a unit last stride."""
    return (type(t) is _Tensor and t.dtype == torch.int32 and t.shape == shape and t.device == device
            and (t.is_contiguous() or t.stride()[-1] == 1))


def _plain(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_leftpad):
    """The tensors are plain eager CPU/CUDA tensors of one device and dtype, shaped and strided as
    a common step needs, with nothing to differentiate (the general path refuses that)."""
    if type(q) is not _Tensor or type(k_cache) is not _Tensor or type(v_cache) is not _Tensor:
        return False
    q_shape, cache_shape, v_shape = q.shape, k_cache.shape, v_cache.shape
    if len(q_shape) != 4 or len(cache_shape) != 4 or len(v_shape) != 4 or not (q.is_cuda or q.is_cpu):
        return False
    device, dtype = q.device, q.dtype
    batch, _, heads, dim = q_shape
    rows, cache_rows, heads_kv, dim_k = cache_shape
    dim_v = v_shape[3]
    if (dtype not in DTYPE_NAMES or k_cache.dtype != dtype or v_cache.dtype != dtype or k_cache.device != device
            or v_cache.device != device or cache_rows < 1 or dim_k != dim or v_shape[0] != rows
            or v_shape[1] != cache_rows or v_shape[2] != heads_kv or not 1 <= dim <= MAX_HEAD_DIM
            or not 1 <= dim_v <= MAX_HEAD_DIM or heads_kv < 1 or heads % heads_kv
            # (is_contiguous() first: cheaper than the stride tuple, and the common answer)
            or not (q.is_contiguous() or q.stride()[3] == 1)
            or not (k_cache.is_contiguous() or k_cache.stride()[3] == 1)
            or not (v_cache.is_contiguous() or v_cache.stride()[3] == 1)):
        return False
    if block_table is None:
        if rows != batch:
            return False
    elif (rows < 1 or cache_rows % PAGE_MULTIPLE or type(block_table) is not _Tensor or block_table.dim() != 2
          or not _index(block_table, (batch, block_table.shape[1]), device) or block_table.shape[1] < 1):
        return False
    if cache_leftpad is not None and not _index(cache_leftpad, (batch,), device):
        return False
    if k is not None:
        if type(k) is not _Tensor or type(v) is not _Tensor:
            return False
        k_shape = k.shape
        len_new = k_shape[1] if len(k_shape) == 4 else 0
        if (len_new < 1 or k_shape != (batch, len_new, heads_kv, dim) or v.shape != (batch, len_new, heads_kv, dim_v)
                or k.dtype != dtype or v.dtype != dtype or k.device != device or v.device != device
                or not (k.is_contiguous() or k.stride()[3] == 1) or not (v.is_contiguous() or v.stride()[3] == 1)):
            return False
    if cache_seqlens is None:
        if k is not None or block_table is not None or cache_leftpad is not None:
            return False
    elif type(cache_seqlens) is not int and not _index(cache_seqlens, (batch,), device):
        return False
    return not (torch.is_grad_enabled() and (q.requires_grad or k_cache.requires_grad or v_cache.requires_grad or (
        k is not None and (k.requires_grad or v.requires_grad))))


def _rotary_plain(q, rotary_cos, rotary_sin, rotary_interleaved):
    """Rotary tables as the op takes them: plain tensors of one shape (positions >= 1,
    1 <= rotary_dim / 2 <= head_dim / 2) and one dtype (q's or float32) on q's device, last
    dimension contiguous, nothing to differentiate."""
    if type(rotary_cos) is not _Tensor or type(rotary_sin) is not _Tensor or type(rotary_interleaved) is not bool:
        return False
    shape = rotary_cos.shape
    return (len(shape) == 2 and rotary_sin.shape == shape and shape[0] >= 1 and 1 <= 2 * shape[1] <= q.shape[3]
            and rotary_cos.dtype in (q.dtype, torch.float32) and rotary_sin.dtype == rotary_cos.dtype
            and rotary_cos.device == q.device and rotary_sin.device == q.device
            and rotary_cos.stride()[1] == 1 and rotary_sin.stride()[1] == 1
            and not (torch.is_grad_enabled() and (rotary_cos.requires_grad or rotary_sin.requires_grad)))


def step(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_leftpad, softmax_scale, causal,
         return_softmax_lse, rotary_cos=None, rotary_sin=None, rotary_interleaved=True):
    """(out[, lse]) of a common step, or None where the general path takes the call."""
    if (torch.compiler.is_compiling() or _any_autocast()
            or not _plain(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_leftpad)):
        return None
    rotary = rotary_cos is not None or rotary_sin is not None
    if rotary and (cache_seqlens is None or not _rotary_plain(q, rotary_cos, rotary_sin, rotary_interleaved)):
        return None
    if softmax_scale is None:
        scale = 1.0 / math.sqrt(q.shape[3])
    elif type(softmax_scale) in (float, int) and -FP32_SCALE_LIMIT <= softmax_scale <= FP32_SCALE_LIMIT:
        scale = float(softmax_scale)
    else:
        return None
    len_new = 0 if k is None else k.shape[1]
    if type(cache_seqlens) is int:  # (transformers' decode steps: the whole cache)
        cache_len = k_cache.shape[1] * (1 if block_table is None else block_table.shape[1])
        if not 0 <= cache_seqlens <= cache_len - len_new:
            return None  # (the general path's error)
        if q.is_cpu:
            _raise_on_bad_values(q, k_cache, [cache_seqlens] * q.shape[0], len_new, block_table, cache_leftpad,
                                 rotary_cos, causal, lengths_checked=True)
        if cache_seqlens == cache_len and block_table is None and cache_leftpad is None and not rotary:
            cache_seqlens = None  # every key of every row: no key ranges
        else:
            cache_seqlens = torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32, device=q.device)
    elif q.is_cpu and cache_seqlens is not None:  # the values are on the host: an error, as the general path's
        _raise_on_bad_values(q, k_cache, cache_seqlens.tolist(), len_new, block_table, cache_leftpad, rotary_cos,
                             causal)
    # (the op's bool arguments take Python bools only: causal is any truth value, as the general
    # path's, and rotary_interleaved is read only with the tables)
    out, lse = run_kvcache_step(k_cache, v_cache, q, k, v, cache_seqlens, block_table, cache_leftpad, rotary_cos,
                                rotary_sin, rotary_interleaved if rotary else True, scale, True if causal else False)
    return (out, lse) if return_softmax_lse else out


def _raise_on_bad_values(q, k_cache, lengths, len_new, block_table, leftpad, rotary_cos, causal,
                         lengths_checked=False):
    """The value rules of a CPU step, on its host values, in the general path's order and words."""
    page = k_cache.shape[1]
    if not lengths_checked:
        raise_on_bad_lengths(lengths, len_new, page * (1 if block_table is None else block_table.shape[1]))
    if block_table is not None or leftpad is not None:
        raise_on_bad_ranges(lengths, None if leftpad is None else leftpad.tolist(),
                            None if block_table is None else block_table.tolist(), k_cache.shape[0], page, len_new)
    if rotary_cos is not None:
        raise_on_bad_positions(lengths, rotary_cos.shape[0], len_new, q.shape[1], causal)

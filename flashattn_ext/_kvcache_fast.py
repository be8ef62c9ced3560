"""The common decode step of flash_attn_with_kvcache in a few Python steps: a dense cache with one
row per sequence, new keys and values to append or none, cache_seqlens an int32 tensor (or None
with nothing to append), softmax_scale and causal, and nothing else. Such a call needs only the
checks below, which read no tensor value and cost a few microseconds, and runs as the C++ kernels
of flashattn::kvcache_append (with new keys) and flashattn::fwd, called directly: an eager step
then costs two op calls of host time. A call these checks do not pass, the invalid ones included,
returns None here and takes the general path (kvcache._resolve), whose errors are the documented
ones; values out of range are the ops' own rules (no write, NaN rows), checked on the host on the
CPU only, as the general path does."""
import math

import torch

from ._checks import DTYPE_NAMES, MAX_HEAD_DIM
from ._kvcache_values import raise_on_bad_lengths
from .ops import CAUSAL_BOTTOM_RIGHT, CAUSAL_NONE, run_fwd, run_kvcache_append

_Tensor = torch.Tensor
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)


def _plain(q, k_cache, v_cache, k, v, cache_seqlens):
    """The tensors are plain eager CPU/CUDA tensors of one device and dtype, shaped and strided as
    a dense step needs, with nothing to differentiate (the general path refuses that)."""
    if type(q) is not _Tensor or type(k_cache) is not _Tensor or type(v_cache) is not _Tensor:
        return False
    if q.dim() != 4 or k_cache.dim() != 4 or v_cache.dim() != 4 or not (q.is_cuda or q.is_cpu):
        return False
    device, dtype = q.device, q.dtype
    batch, _, heads, dim = q.shape
    rows, cache_len, heads_kv, dim_k = k_cache.shape
    dim_v = v_cache.shape[3]
    if (dtype not in DTYPE_NAMES or k_cache.dtype != dtype or v_cache.dtype != dtype or k_cache.device != device
            or v_cache.device != device or rows != batch or cache_len < 1 or dim_k != dim
            or v_cache.shape[:3] != k_cache.shape[:3] or not 1 <= dim <= MAX_HEAD_DIM
            or not 1 <= dim_v <= MAX_HEAD_DIM or heads_kv < 1 or heads % heads_kv
            or q.stride(3) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1):
        return False
    if k is not None:
        if type(k) is not _Tensor or type(v) is not _Tensor or k.dim() != 4 or v.dim() != 4:
            return False
        len_new = k.shape[1]
        if (len_new < 1 or k.shape != (batch, len_new, heads_kv, dim) or v.shape != (batch, len_new, heads_kv, dim_v)
                or k.dtype != dtype or v.dtype != dtype or k.device != device or v.device != device
                or k.stride(3) != 1 or v.stride(3) != 1):
            return False
    if cache_seqlens is None:
        if k is not None:
            return False
    elif (type(cache_seqlens) is not _Tensor or cache_seqlens.dtype != torch.int32
          or cache_seqlens.shape != (batch,) or cache_seqlens.device != device or not cache_seqlens.is_contiguous()):
        return False
    return not (torch.is_grad_enabled() and (q.requires_grad or k_cache.requires_grad or v_cache.requires_grad or (
        k is not None and (k.requires_grad or v.requires_grad))))


def step(q, k_cache, v_cache, k, v, cache_seqlens, softmax_scale, causal, return_softmax_lse):
    """(out[, lse]) of a common step, or None where the general path takes the call."""
    if torch.compiler.is_compiling() or _any_autocast() or not _plain(q, k_cache, v_cache, k, v, cache_seqlens):
        return None
    if softmax_scale is None:
        scale = 1.0 / math.sqrt(q.shape[3])
    elif type(softmax_scale) in (float, int):
        scale = float(softmax_scale)
    else:
        return None
    seqused = cache_seqlens
    if k is not None or cache_seqlens is not None:
        if q.is_cpu:  # the values are on the host: an error, as the general path raises it
            raise_on_bad_lengths(cache_seqlens.tolist(), 0 if k is None else k.shape[1], k_cache.shape[1])
        if k is not None:
            seqused = run_kvcache_append(k_cache, v_cache, k, v, cache_seqlens)
    out, lse = run_fwd(q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2), scale,
                       CAUSAL_BOTTOM_RIGHT if causal else CAUSAL_NONE, False, None, -1, -1, None, 0.0, 0.0, None,
                       None, None, 0, 0, seqused, None, None)
    out = out.transpose(1, 2)
    return (out, lse) if return_softmax_lse else out

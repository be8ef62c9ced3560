"""flash_attn_with_kvcache: attention of new query rows against a key/value cache (decode steps),
with the new keys and values appended to the cache in place, rotary embeddings, paged caches,
left padding and cache row indirection, in flash-attn 2's layout and semantics.

The public function validates and resolves its arguments into a KVCacheArgs (shape, dtype and
device rules here; per-sequence value rules in _kvcache_values.py), then hands it to
_kvcache_compose.forward; the common decode step takes a shorter path (_kvcache_fast.py). KVCacheArgs is the contract a dedicated decode kernel takes: every
tensor checked, every default made explicit, no value read on the device."""
import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from . import _kvcache_compose, _kvcache_fast, _kvcache_values
from ._checks import DTYPE_NAMES, MAX_HEAD_DIM, check_scale
from ._kvcache_values import PAGE_MULTIPLE
from .ops import rows_contiguous


@dataclass(frozen=True)
class KVCacheArgs:
    """Resolved arguments of one call (B sequences, C = the cache length each one sees)."""
    q: torch.Tensor                        # (B, Lq, H, E), last dim contiguous
    k_cache: torch.Tensor                  # (B_cache, C, Hkv, E), or paged (blocks, page, Hkv, E)
    v_cache: torch.Tensor                  # as k_cache, head dim Ev
    k_new: Optional[torch.Tensor]          # (B, L_new, Hkv, E) appended at seqlens, or None
    v_new: Optional[torch.Tensor]          # (B, L_new, Hkv, Ev)
    seqlens: torch.Tensor                  # (B,) int32: keys in the cache before the append
    batch_idx: Optional[torch.Tensor]      # (B,) int32 cache row of each sequence (dense only)
    leftpad: Optional[torch.Tensor]        # (B,) int32 first valid key of each sequence
    block_table: Optional[torch.Tensor]    # (B, pages) int32 block of each page (paged only)
    rotary_cos: Optional[torch.Tensor]     # (R, rotary_dim / 2)
    rotary_sin: Optional[torch.Tensor]
    rotary_interleaved: bool
    scale: float
    causal: bool
    window: Tuple[int, int]                # flash-attn's normalisation applied (>= C becomes -1)
    softcap: float
    alibi_slopes: Optional[torch.Tensor]   # float32 (H,) or (B, H)
    num_splits: int                        # 0 = automatic; a scheduling hint, no effect on results

    @property
    def paged(self):
        return self.block_table is not None

    @property
    def cache_len(self):
        """C: the keys each sequence can hold (pages per sequence x page size when paged)."""
        if self.paged:
            return self.block_table.shape[1] * self.k_cache.shape[1]
        return self.k_cache.shape[1]

    @property
    def len_new(self):
        return 0 if self.k_new is None else self.k_new.shape[1]

    @property
    def rotary_rows_consecutive(self):
        """flash-attn's rule: query row i sits at position seqlens + i when causal or local,
        else every query row sits at position seqlens."""
        return self.causal or self.window != (-1, -1)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """flash-attn 2's flash_attn_with_kvcache: q (B, Lq, H, E) attends to a cache of keys and values.

    k_cache / v_cache: (B_cache, C, Hkv, E) dense (B_cache >= B without cache_batch_idx: sequence b
    in row b), or (num_blocks, page_size, Hkv, E) paged with
    block_table (B, pages_per_sequence) int32 (page_size a multiple of 16); the sequence b then sees
    C = pages_per_sequence * page_size keys, key j in block block_table[b, j // page_size].
    cache_seqlens (int, or int32 (B,)): keys of each sequence in the cache; None = all C.
    k, v (B, L_new, Hkv, E): written into the cache, in place, at positions cache_seqlens[b] ..
    cache_seqlens[b] + L_new - 1 (needs cache_seqlens); attention then sees the cache after the
    append, keys cache_leftpad[b] <= j < cache_seqlens[b] + L_new. cache_batch_idx (B,) int32: cache
    row of each sequence (dense caches); repeated rows with k, v given leave either write.
    cache_leftpad (B,) int32: first valid key of each sequence (positions stay absolute).
    rotary_cos / rotary_sin (R, rotary_dim / 2): rotary embedding of the first rotary_dim features
    of the new k (at their cache positions) and of q (row i at cache_seqlens[b] + i when causal or
    windowed, else every row at cache_seqlens[b]); interleaved pairs (0, 1), (2, 3)... or, with
    rotary_interleaved=False, halves (i, i + rotary_dim / 2); q is rotated also when no k is
    given (flash-attn refuses that).
    causal, window_size, alibi_slopes are aligned bottom-right against the cache length after the
    append (query i of sequence b sits at key cache_seqlens[b] + L_new - Lq + i); softcap as in
    flash_attn_func. GQA/MQA when Hkv divides H. num_splits: a scheduling hint (0 = automatic), never
    a change of results. Forward only: an input that requires grad under grad mode is an error.

    Returns out (B, Lq, H, Ev), and with return_softmax_lse=True also lse (B, H, Lq) float32
    (float64 for float64 inputs). A row that sees no key gives out = 0 and lse = -inf.

    Values of the index tensors (cache_seqlens, cache_leftpad, cache_batch_idx, block_table) are
    checked on the CPU; on CUDA they are trusted so that no call waits for the device (CUDA graphs
    capture it): a sequence whose values are out of range writes nothing, reads nothing out of
    bounds, and gets NaN in its out and lse rows."""
    # The common decode step takes a short path where only its features are given (_kvcache_fast.py).
    if (cache_batch_idx is None and alibi_slopes is None and type(window_size) is tuple and window_size == (-1, -1)
            and type(softcap) in (float, int) and softcap == 0 and type(num_splits) is int and num_splits >= 0):
        result = _kvcache_fast.step(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_leftpad,
                                    softmax_scale, causal, return_softmax_lse, rotary_cos, rotary_sin,
                                    rotary_interleaved)
        if result is not None:
            return result
    args = _resolve(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                    cache_leftpad, block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved,
                    alibi_slopes, num_splits)
    if args.q.device.type == "cpu" and not torch.compiler.is_compiling():
        _kvcache_values.raise_on_invalid(args)
    with torch.no_grad():
        out, lse = _kvcache_compose.forward(args)
    return (out, lse) if return_softmax_lse else out


# ------------------------------------------------------------------------------------------ checks
def _fail(message):
    raise ValueError(f"flashattn_ext: {message}")


def _shape(t):
    return tuple(t.shape)


def _tensor(t, name, rank, layout, optional=False):
    if t is None and optional:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"flashattn_ext: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != rank:
        _fail(f"{name} must have {rank} dimensions {layout}, got shape {_shape(t)}")


def _index_tensor(t, name, shape, layout):
    _tensor(t, name, len(shape), layout)
    if t.dtype != torch.int32:
        _fail(f"{name} must have dtype int32, got {t.dtype}")
    if _shape(t) != shape:
        _fail(f"{name} must have shape {shape} {layout}, got {_shape(t)}")


def _int(x, name, rule, ok):
    if isinstance(x, bool) or not isinstance(x, int) or not ok(x):
        _fail(f"{name} must be {rule}, got {x!r}")
    return x


def _check_grad(named):
    if not torch.is_grad_enabled():
        return
    for name, t in named:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            _fail(f"{name} requires grad, but flash_attn_with_kvcache is forward only (it writes into the cache "
                  f"in place): call it under torch.no_grad() or torch.inference_mode(), or detach {name}")


def _check_caches(q, k_cache, v_cache, k, v, block_table):
    _tensor(q, "q", 4, "(batch, seq_len_q, heads, head_dim)")
    layout = "(num_blocks, page_size, heads_kv, head_dim)" if block_table is not None else \
        "(batch_cache, cache_len, heads_kv, head_dim)"
    _tensor(k_cache, "k_cache", 4, layout)
    _tensor(v_cache, "v_cache", 4, layout)
    if (k is None) != (v is None):
        _fail(f"k and v must be given together (the new keys and values), got k={'None' if k is None else 'a tensor'}"
              f" and v={'None' if v is None else 'a tensor'}")
    _tensor(k, "k", 4, "(batch, seq_len_new, heads_kv, head_dim)", optional=True)
    _tensor(v, "v", 4, "(batch, seq_len_new, heads_kv, head_dim_v)", optional=True)
    if q.dtype not in DTYPE_NAMES:
        _fail(f"q has dtype {q.dtype}; supported dtypes are float64, float32, bfloat16 and float16")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
        if t is not None and t.dtype != q.dtype:
            _fail(f"{name} has dtype {t.dtype} but q has dtype {q.dtype}; they must match")
    batch, _, heads, dim = q.shape
    blocks, rows, heads_kv, dim_k = k_cache.shape
    dim_v = v_cache.shape[3]
    if _shape(v_cache)[:3] != (blocks, rows, heads_kv):
        _fail(f"v_cache has shape {_shape(v_cache)} and k_cache {_shape(k_cache)}; they must agree in every "
              f"dimension but the last (head_dim_v)")
    if dim_k != dim:
        _fail(f"k_cache has head_dim {dim_k} but q has {dim}; they must be equal")
    for name, d in (("q", dim), ("v_cache", dim_v)):
        if not 1 <= d <= MAX_HEAD_DIM:
            _fail(f"{name} has head_dim {d}; it must be between 1 and {MAX_HEAD_DIM}")
    if heads_kv < 1 or heads % heads_kv:
        _fail(f"q has {heads} heads and k_cache {heads_kv}; the number of query heads must be a multiple of the "
              f"number of key/value heads")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.shape[3] > 1 and t.stride(3) != 1:
            _fail(f"{name} must have a contiguous last dimension (stride 1), got stride {t.stride(3)}; it is "
                  f"written in place, so it cannot be copied")
    if k is not None:
        len_new = k.shape[1]
        if _shape(k) != (batch, len_new, heads_kv, dim):
            _fail(f"k must have shape (batch, seq_len_new, heads_kv, head_dim) = {(batch, len_new, heads_kv, dim)} "
                  f"(batch of q, heads and head_dim of k_cache), got {_shape(k)}")
        if _shape(v) != (batch, len_new, heads_kv, dim_v):
            _fail(f"v must have shape (batch, seq_len_new, heads_kv, head_dim_v) = "
                  f"{(batch, len_new, heads_kv, dim_v)} (as k, head_dim_v of v_cache), got {_shape(v)}")


def _check_devices(named, device):
    for name, t in named:
        if isinstance(t, torch.Tensor) and t.device != device:
            _fail(f"{name} is on device {t.device} but q is on {device}; they must be on the same device")


def _check_indexing(q, k_cache, block_table, cache_batch_idx, cache_leftpad):
    batch = q.shape[0]
    if block_table is not None:
        _tensor(block_table, "block_table", 2, "(batch, pages_per_sequence)")
        if block_table.dtype != torch.int32:
            _fail(f"block_table must have dtype int32, got {block_table.dtype}")
        if block_table.shape[0] != batch or block_table.shape[1] < 1:
            _fail(f"block_table must have shape (batch = {batch}, pages_per_sequence >= 1), got "
                  f"{_shape(block_table)}")
        page = k_cache.shape[1]
        if page < 1 or page % PAGE_MULTIPLE:
            _fail(f"the page size (k_cache.shape[1] with a block_table) must be a positive multiple of "
                  f"{PAGE_MULTIPLE}, got {page}")
        if k_cache.shape[0] < 1:
            _fail(f"a paged k_cache needs at least one block, got shape {_shape(k_cache)}")
        if cache_batch_idx is not None:
            _fail("cache_batch_idx cannot be combined with block_table: the block table already maps each "
                  "sequence to its pages")
    elif cache_batch_idx is not None:
        _index_tensor(cache_batch_idx, "cache_batch_idx", (batch,), "(batch,)")
        if k_cache.shape[0] < 1:
            _fail(f"k_cache has no rows for cache_batch_idx to index, shape {_shape(k_cache)}")
    elif k_cache.shape[0] < batch:
        _fail(f"k_cache has batch {k_cache.shape[0]} but q has {batch}; without cache_batch_idx (or block_table) "
              f"sequence b is cache row b, so it needs at least q's batch")
    if cache_leftpad is not None:
        _index_tensor(cache_leftpad, "cache_leftpad", (batch,), "(batch,)")


def _check_rotary(q, rotary_cos, rotary_sin):
    if rotary_cos is None and rotary_sin is None:
        return
    if rotary_cos is None or rotary_sin is None:
        _fail("rotary_cos and rotary_sin must be given together")
    for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        _tensor(t, name, 2, "(positions, rotary_dim / 2)")
        if t.dtype not in (q.dtype, torch.float32):
            _fail(f"{name} has dtype {t.dtype}; it must be q's dtype ({q.dtype}) or float32")
    if _shape(rotary_sin) != _shape(rotary_cos):
        _fail(f"rotary_sin has shape {_shape(rotary_sin)} but rotary_cos has {_shape(rotary_cos)}; they must match")
    half, dim = rotary_cos.shape[1], q.shape[3]
    if not 1 <= 2 * half <= dim:
        _fail(f"rotary_dim = 2 * rotary_cos.shape[1] = {2 * half} must be between 2 and head_dim = {dim}")
    if rotary_cos.shape[0] < 1:
        _fail(f"rotary_cos must hold at least one position, got shape {_shape(rotary_cos)}")


def _check_alibi(q, alibi_slopes):
    if alibi_slopes is None:
        return
    if not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(f"flashattn_ext: alibi_slopes must be a torch.Tensor, got {type(alibi_slopes).__name__}")
    batch, heads = q.shape[0], q.shape[2]
    if _shape(alibi_slopes) not in ((heads,), (batch, heads)):
        _fail(f"alibi_slopes must have shape ({heads},) (heads) or ({batch}, {heads}) (batch, heads), got "
              f"{_shape(alibi_slopes)}")
    if alibi_slopes.dtype != torch.float32:
        _fail(f"alibi_slopes must have dtype float32, got {alibi_slopes.dtype}")


def _seqlens(cache_seqlens, batch, cache_len, len_new, device):
    """(B,) int32 tensor; an int is checked here (its value is on the host on every device)."""
    if cache_seqlens is None:
        if len_new:
            _fail("k and v are given but cache_seqlens is None; cache_seqlens says where each sequence's new keys "
                  "go")
        return torch.full((batch,), cache_len, dtype=torch.int32, device=device)
    if isinstance(cache_seqlens, torch.Tensor):
        _index_tensor(cache_seqlens, "cache_seqlens", (batch,), "(batch,)")
        return cache_seqlens
    _int(cache_seqlens, "cache_seqlens", "an int or an int32 tensor of shape (batch,)", lambda x: True)
    if not 0 <= cache_seqlens <= cache_len - len_new:
        _fail(f"cache_seqlens = {cache_seqlens} must be in [0, cache length {cache_len} - new keys {len_new}]: "
              f"the cache is too short for the append")
    return torch.full((batch,), cache_seqlens, dtype=torch.int32, device=device)


def _window(window_size, cache_len):
    try:
        left, right = (int(x) for x in window_size)
    except (TypeError, ValueError):
        _fail(f"window_size must be a pair (left, right) of ints, got {window_size!r}")
    if left < -1 or right < -1:
        _fail(f"window_size must be (left, right) with each >= 0, or -1 for unbounded, got {window_size!r}")
    # flash-attn's normalisation: a side at least as wide as the cache is unbounded.
    return (-1 if left >= cache_len else left), (-1 if right >= cache_len else right)


def _rotary_tables(rotary_cos, rotary_sin):
    """The tables as the op reads them: one dtype (float32, exactly, where they differ) and a
    contiguous last dimension."""
    if rotary_cos is not None and rotary_cos.dtype != rotary_sin.dtype:
        rotary_cos, rotary_sin = rotary_cos.float(), rotary_sin.float()
    return rows_contiguous(rotary_cos), rows_contiguous(rotary_sin)


def _resolve(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
             block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes,
             num_splits):
    _check_caches(q, k_cache, v_cache, k, v, block_table)
    named = (("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v), ("rotary_cos", rotary_cos),
             ("rotary_sin", rotary_sin), ("cache_seqlens", cache_seqlens), ("cache_batch_idx", cache_batch_idx),
             ("cache_leftpad", cache_leftpad), ("block_table", block_table), ("alibi_slopes", alibi_slopes))
    _check_devices(named, q.device)
    _check_grad((("q", q),) + named)
    _check_indexing(q, k_cache, block_table, cache_batch_idx, cache_leftpad)
    _check_rotary(q, rotary_cos, rotary_sin)
    _check_alibi(q, alibi_slopes)
    if block_table is None and cache_batch_idx is None and k_cache.shape[0] > q.shape[0]:
        # (as flash-attn: a cache of more rows than the batch, sequence b in row b; views, so appends land in place)
        k_cache, v_cache = k_cache[:q.shape[0]], v_cache[:q.shape[0]]
    cache_len = block_table.shape[1] * k_cache.shape[1] if block_table is not None else k_cache.shape[1]
    len_new = 0 if k is None else k.shape[1]
    seqlens = _seqlens(cache_seqlens, q.shape[0], cache_len, len_new, q.device)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[3])
    try:
        softmax_scale = float(softmax_scale)
        softcap = float(softcap)
    except (TypeError, ValueError):
        _fail(f"softmax_scale and softcap must be numbers, got {softmax_scale!r} and {softcap!r}")
    check_scale(softmax_scale, q.dtype, "softmax_scale")
    if not softcap >= 0.0:
        _fail(f"softcap must be >= 0 (0 = off), got {softcap}")
    _int(num_splits, "num_splits", "an int >= 0 (0 = automatic)", lambda x: x >= 0)
    rotary_cos, rotary_sin = _rotary_tables(rotary_cos, rotary_sin)
    return KVCacheArgs(
        q=rows_contiguous(q), k_cache=k_cache, v_cache=v_cache, k_new=rows_contiguous(k),
        v_new=rows_contiguous(v), seqlens=seqlens, batch_idx=cache_batch_idx,
        leftpad=cache_leftpad, block_table=block_table, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
        rotary_interleaved=bool(rotary_interleaved), scale=softmax_scale, causal=bool(causal),
        window=_window(window_size, cache_len), softcap=softcap, alibi_slopes=rows_contiguous(alibi_slopes),
        num_splits=num_splits)

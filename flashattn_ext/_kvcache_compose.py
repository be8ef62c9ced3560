"""flash_attn_with_kvcache as two op calls: flashattn::kvcache_append (the new keys and values
written into the cache in place, rotated with rotary tables, q rotated into a new tensor, and
every value rule checked, in one launch; it returns where each sequence's keys end, -1 for a
sequence that breaks a rule), then one flashattn::fwd on the cache itself (a paged one with its
block_table; rows gathered only for cache_batch_idx) with each sequence's key range (seqused_k,
leftpad_k), so that causal, window and ALiBi align against each sequence's own length and the
kernels read only its keys (on CUDA, decode steps take the decode kernel: GQA rows packed, keys
split over the GPU, pages read in place), and that a sequence with -1 gets NaN rows.

A step that only reads a dense cache with no rotary, cache_leftpad or cache_batch_idx needs no
append call: the attention checks its lengths itself. Every shape comes from the tensors' shapes,
never from index values, so nothing waits for the device and a CUDA graph can capture the call."""
import torch

from .functional import checked_fwd
from .ops import CAUSAL_BOTTOM_RIGHT, CAUSAL_NONE, kvcache_append


def forward(a):
    """(out (B, Lq, H, Ev), lse (B, H, Lq)) for resolved arguments `a` (kvcache.KVCacheArgs)."""
    q, k_new, v_new = a.q, a.k_new, a.v_new
    leftpad = _unit_stride(a.leftpad)
    rotary = a.rotary_cos is not None
    if a.len_new or rotary or leftpad is not None or a.batch_idx is not None or a.paged:
        # The append (with the rotary embedding of the new keys and of q), or with nothing to append
        # the rules alone: seqused = the lengths after the append, -1 where a sequence's values
        # allow no step.
        if not a.len_new:
            batch, heads_kv = q.shape[0], a.k_cache.shape[2]
            k_new = a.k_cache.new_empty((batch, 0, heads_kv, a.k_cache.shape[3]))
            v_new = a.v_cache.new_empty((batch, 0, heads_kv, a.v_cache.shape[3]))
        q_rotated = torch.empty_like(q) if rotary else None
        seqused = kvcache_append(a.k_cache, a.v_cache, k_new, v_new, _unit_stride(a.seqlens),
                                 _unit_stride(a.batch_idx), _unit_stride(a.block_table), leftpad, a.rotary_cos,
                                 a.rotary_sin, a.rotary_interleaved, q if rotary else None, q_rotated,
                                 a.rotary_rows_consecutive)
        q = q if q_rotated is None else q_rotated
    else:
        seqused = _unit_stride(a.seqlens)  # (a view the caller sliced: the op reads it as a plain array)
    k, v = _read_cache(a)
    return _attend(a, q, k, v, seqused, leftpad)


def _unit_stride(t):
    """t with a unit last stride (the ops read index tensors as plain arrays)."""
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


def _attend(a, q, k, v, seqused, leftpad):
    """The op on (B, L, heads, E) q and caches with the key ranges."""
    out, lse = checked_fwd(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), a.scale,
                           CAUSAL_BOTTOM_RIGHT if a.causal else CAUSAL_NONE, window_left=a.window[0],
                           window_right=a.window[1], alibi_slopes=a.alibi_slopes, softcap=a.softcap,
                           seqused_k=seqused, leftpad_k=leftpad, block_table=_unit_stride(a.block_table))
    if k.shape[1] == 0:  # an empty dense cache: the op runs no kernel to mark lengths other than 0
        bad = seqused != 0 if leftpad is None else (seqused != 0) | (leftpad != 0)
        out = out.masked_fill(bad[:, None, None, None], float("nan"))
        lse = lse.masked_fill(bad[:, None, None], float("nan"))
    return out.transpose(1, 2), lse


def _read_cache(a):
    """The keys and values the op reads: the caches themselves when paged (with the block table)
    or dense and unindexed, else each sequence's cache row, gathered (clamped: a sequence whose
    row is out of range has -1 lengths, so its rows are NaN)."""
    if a.batch_idx is not None:
        rows = a.batch_idx.long().clamp(0, a.k_cache.shape[0] - 1)
        return a.k_cache.index_select(0, rows), a.v_cache.index_select(0, rows)
    return a.k_cache, a.v_cache

"""flash_attn_with_kvcache as two op calls, with torch ops around them only for the features that
need them: rotary (torch ops on q and the new keys), then flashattn::kvcache_append (the new keys
and values written into the cache in place, and every value rule but the rotary positions
checked, in one launch; it returns where each sequence's keys end, -1 for a sequence that breaks
a rule), then one flashattn::fwd on the cache itself (a paged one with its block_table; rows
gathered only for cache_batch_idx) with each sequence's key range (seqused_k, leftpad_k), so that
causal, window and ALiBi align against each sequence's own length and the kernels read only its
keys (on CUDA, decode steps take the decode kernel: GQA rows packed, keys split over the GPU,
pages read in place), and that a sequence with -1 gets NaN rows.

A step that only reads a dense cache with no cache_leftpad or cache_batch_idx needs no append
call: the attention checks its lengths itself. Every shape comes from the tensors' shapes, never
from index values, so nothing waits for the device and a CUDA graph can capture the call."""
import torch

from ._kvcache_values import lengths_or_invalid
from .functional import checked_fwd
from .ops import CAUSAL_BOTTOM_RIGHT, CAUSAL_NONE, kvcache_append


def forward(a):
    """(out (B, Lq, H, Ev), lse (B, H, Lq)) for resolved arguments `a` (kvcache.KVCacheArgs)."""
    seqlens = lengths_or_invalid(a)
    q, k_new, v_new = a.q, a.k_new, a.v_new
    if a.rotary_cos is not None:
        positions = seqlens.long()[:, None]
        rows = torch.arange(q.shape[1], device=q.device) if a.rotary_rows_consecutive else \
            torch.zeros(q.shape[1], dtype=torch.long, device=q.device)
        q = _rotate(q, a, positions + rows)
        if a.len_new:
            k_new = _rotate(k_new, a, positions + torch.arange(a.len_new, device=q.device))
    leftpad = _unit_stride(a.leftpad)
    if a.len_new or leftpad is not None or a.batch_idx is not None or a.paged:
        # The append, or with nothing to append the rules alone: seqused = the lengths after the
        # append, -1 where a sequence's values allow no step.
        if not a.len_new:
            batch, heads_kv = q.shape[0], a.k_cache.shape[2]
            k_new = a.k_cache.new_empty((batch, 0, heads_kv, a.k_cache.shape[3]))
            v_new = a.v_cache.new_empty((batch, 0, heads_kv, a.v_cache.shape[3]))
        seqused = kvcache_append(a.k_cache, a.v_cache, k_new, v_new, _unit_stride(seqlens), _unit_stride(a.batch_idx),
                                 _unit_stride(a.block_table), leftpad)
    else:
        seqused = _unit_stride(seqlens)  # (a view the caller sliced: the op reads it as a plain array)
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


def _rotate(x, a, positions):
    """Rotary embedding of x (B, L, heads, E) at positions (B, L), in float32 (float64 for
    float64 inputs) and rounded once, as a kernel does in registers."""
    table = a.rotary_cos.shape[0]
    positions = positions.clamp(0, table - 1)  # (out-of-range sequences: -1 lengths, NaN rows)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    cos = a.rotary_cos[positions].to(acc)[:, :, None, :]
    sin = a.rotary_sin[positions].to(acc)[:, :, None, :]
    dim = 2 * cos.shape[-1]
    part = x[..., :dim].to(acc)
    if a.rotary_interleaved:
        x1, x2 = part[..., 0::2], part[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    else:
        x1, x2 = part[..., :dim // 2], part[..., dim // 2:]
        rotated = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return torch.cat((rotated.to(x.dtype), x[..., dim:]), dim=-1)


def _read_cache(a):
    """The keys and values the op reads: the caches themselves when paged (with the block table)
    or dense and unindexed, else each sequence's cache row, gathered (clamped: a sequence whose
    row is out of range has -1 lengths, so its rows are NaN)."""
    if a.batch_idx is not None:
        rows = a.batch_idx.long().clamp(0, a.k_cache.shape[0] - 1)
        return a.k_cache.index_select(0, rows), a.v_cache.index_select(0, rows)
    return a.k_cache, a.v_cache

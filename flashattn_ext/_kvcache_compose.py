"""flash_attn_with_kvcache from torch ops and one flashattn::fwd call: rotary and the in-place
append as torch ops, then the op on the cache itself (a paged one with its block_table; rows
gathered only for cache_batch_idx) with each sequence's key range (seqused_k = its length after
the append, leftpad_k), so that causal, window and ALiBi align against each sequence's own length
and the kernels read only its keys (on CUDA, decode steps take the decode kernel: GQA rows packed,
keys split over the GPU, pages read in place). Every shape comes from the tensors' shapes, never
from index values, so nothing waits for the device and a CUDA graph can capture the call."""
import torch

from ._kvcache_values import valid_sequences
from .functional import checked_fwd
from .ops import CAUSAL_BOTTOM_RIGHT, CAUSAL_NONE


def forward(a):
    """(out (B, Lq, H, Ev), lse (B, H, Lq)) for resolved arguments `a` (kvcache.KVCacheArgs)."""
    if not a.len_new and a.rotary_cos is None and a.leftpad is None and a.batch_idx is None and not a.paged:
        return _read_only_step(a)
    valid = valid_sequences(a)
    seqlens = a.seqlens.long()
    q = a.q
    if a.rotary_cos is not None:
        rows = torch.arange(q.shape[1], device=q.device) if a.rotary_rows_consecutive else \
            torch.zeros(q.shape[1], dtype=torch.long, device=q.device)
        q = _rotate(q, a, seqlens[:, None] + rows)
    if a.len_new and q.shape[0]:
        k_new = a.k_new
        if a.rotary_cos is not None:
            k_new = _rotate(k_new, a, seqlens[:, None] + torch.arange(a.len_new, device=q.device))
        _append(a, k_new, a.v_new, seqlens, valid)
    k, v = _read_cache(a)
    seqused, leftpad = _key_ranges(a, seqlens)
    # Blocks clamped into the cache: only those of invalid sequences (NaN below) or of pages past a
    # sequence's keys (never read) change, and the op's own value check (CPU) never sees them.
    table = a.block_table.clamp(0, a.k_cache.shape[0] - 1) if a.paged else None
    return _attend(a, q, k, v, seqused, leftpad, table, valid)


def _read_only_step(a):
    """A step that only reads a dense cache (no append, rotary, leftpad or cache_batch_idx), the
    common decode call: cache_seqlens go to the op as they are (int32; the op clamps them where it
    reads them), and the one rule that can fail, 0 <= cache_seqlens <= C, marks the NaN rows. Five
    launches around the attention instead of a dozen (each costs a few us of a short step). (The CPU
    op checks its values instead of clamping them: there they are clamped here, as _key_ranges does.)"""
    seqlens = a.seqlens.contiguous()  # (a view the caller sliced: the op reads it as a plain array)
    valid = (seqlens >= 0) & (seqlens <= a.cache_len)
    seqused = seqlens if a.q.is_cuda else seqlens.clamp(0, a.cache_len)
    return _attend(a, a.q, a.k_cache, a.v_cache, seqused, None, None, valid)


def _attend(a, q, k, v, seqused, leftpad, table, valid):
    """The op on (B, L, heads, E) q and caches with the key ranges; NaN rows where not `valid`."""
    out, lse = checked_fwd(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), a.scale,
                           CAUSAL_BOTTOM_RIGHT if a.causal else CAUSAL_NONE, window_left=a.window[0],
                           window_right=a.window[1], alibi_slopes=a.alibi_slopes, softcap=a.softcap,
                           seqused_k=seqused, leftpad_k=leftpad, block_table=table)
    nan = float("nan")
    out = torch.where(valid[:, None, None, None], out, nan)
    lse = torch.where(valid[:, None, None], lse, nan)
    return out.transpose(1, 2), lse


def _rotate(x, a, positions):
    """Rotary embedding of x (B, L, heads, E) at positions (B, L), in float32 (float64 for
    float64 inputs) and rounded once, as a kernel does in registers."""
    table = a.rotary_cos.shape[0]
    positions = positions.clamp(0, table - 1)  # out-of-range sequences are masked by valid_sequences
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


def _append(a, k_new, v_new, seqlens, valid):
    """Writes k_new, v_new (B, L_new, Hkv, *) into the caches at seqlens .. seqlens + L_new - 1.

    Every destination is clamped into the cache; the writes of invalid sequences are turned into
    copies of the first valid write (same place, same value), or into a rewrite of the cache's
    first row with its own value when no write is valid, so that duplicate destinations carry
    equal values and the result does not depend on which one lands."""
    batch, len_new = k_new.shape[:2]
    positions = seqlens[:, None] + torch.arange(len_new, device=seqlens.device)  # (B, L_new)
    if a.paged:
        page = a.k_cache.shape[1]
        page_index = (positions // page).clamp(0, a.block_table.shape[1] - 1)
        rows = a.block_table.long().gather(1, page_index).clamp(0, a.k_cache.shape[0] - 1)
        cols = positions % page
    else:
        cache_rows = a.batch_idx.long() if a.batch_idx is not None else torch.arange(batch, device=seqlens.device)
        rows = cache_rows.clamp(0, a.k_cache.shape[0] - 1)[:, None].expand(batch, len_new)
        cols = positions.clamp(0, a.k_cache.shape[1] - 1)
    rows, cols = rows.flatten(), cols.flatten()
    ok = valid[:, None].expand(batch, len_new).flatten()
    # The first valid write (0 when none), as a 1-element index: indexing with a 0-d device
    # tensor could read its value on the host.
    first = ok.int().argmax().view(1)
    any_ok = ok.any()
    zero = torch.zeros((), dtype=torch.long, device=rows.device)
    rows = torch.where(ok, rows, torch.where(any_ok, rows.index_select(0, first), zero))
    cols = torch.where(ok, cols, torch.where(any_ok, cols.index_select(0, first), zero))
    for cache, new in ((a.k_cache, k_new), (a.v_cache, v_new)):
        values = new.flatten(0, 1)
        fallback = torch.where(any_ok, values.index_select(0, first), cache[0, 0])
        cache.index_put_((rows, cols), torch.where(ok[:, None, None], values, fallback))


def _read_cache(a):
    """The keys and values the op reads: the caches themselves when paged (with the block table)
    or dense and unindexed, else each sequence's cache row, gathered (clamped: invalid sequences
    are masked by valid_sequences)."""
    if a.batch_idx is not None:
        rows = a.batch_idx.long().clamp(0, a.k_cache.shape[0] - 1)
        return a.k_cache.index_select(0, rows), a.v_cache.index_select(0, rows)
    return a.k_cache, a.v_cache


def _key_ranges(a, seqlens):
    """seqused_k, leftpad_k (int32 (B,)) of the op: sequence b's keys leftpad <= j < seqlens + L_new,
    clamped into the cache. Only invalid sequences (which valid_sequences turns to NaN) need the
    clamp; it keeps the op's own value check (CPU) from seeing them."""
    end = (seqlens + a.len_new).clamp(0, a.cache_len)
    if a.leftpad is None:
        return end.int(), None
    return end.int(), torch.minimum(a.leftpad.long().clamp(min=0), end).int()

"""The per-sequence value rules of flash_attn_with_kvcache (cache_seqlens, cache_leftpad,
cache_batch_idx, block_table, rotary positions), written as tensor ops that never wait for the
device. On the CPU a broken rule raises, naming the sequence and its values. On every device the
ops evaluate the rules themselves where they run (flashattn::kvcache_append: lengths, left
padding, cache rows, the blocks of the pages that hold a sequence's keys, the rotary positions;
flashattn::fwd: the key range): a sequence that breaks one writes nothing and gets NaN rows (a
bad value is visible, never an out-of-bounds access)."""
import torch

PAGE_MULTIPLE = 16  # page sizes a paged cache may use: any multiple of this


def negative_length(b, length):
    return f"cache_seqlens[{b}] = {length} must be >= 0"


def too_long(b, length, len_new, cache_len):
    return (f"cache_seqlens[{b}] = {length} plus the {len_new} new keys exceeds the cache length {cache_len}: the "
            f"cache is too short for the append")


def past_tables(b, length, positions, span, len_new, len_q):
    return (f"rotary_cos has {positions} positions but sequence {b} needs position {length + span - 1} "
            f"(cache_seqlens[{b}] = {length}, {len_new} new keys, {len_q} query rows)")


def bad_leftpad(b, pad, length):
    return f"cache_leftpad[{b}] = {pad} must be in [0, cache_seqlens[{b}] = {length}]"


def bad_page(b, p, block, blocks, page, first, end):
    return (f"block_table[{b}, {p}] = {block} is not a block of k_cache (must be in [0, {blocks})); page {p} holds "
            f"keys {p * page}..{p * page + page - 1} of sequence {b}, which has keys {first}..{end - 1}")


def rotary_span(len_new, len_q, consecutive):
    """Rotary positions a sequence uses from cache_seqlens on: its new keys', and its query rows'
    (consecutive, or all at cache_seqlens)."""
    return max(len_new, len_q if consecutive else min(len_q, 1))


def raise_on_bad_positions(lengths, positions, len_new, len_q, consecutive):
    """The rotary position rule on host values (lengths: a list of valid ints)."""
    span = rotary_span(len_new, len_q, consecutive)
    for b, s in enumerate(lengths):
        if span and s + span > positions:
            raise ValueError(f"flashattn_ext: {past_tables(b, s, positions, span, len_new, len_q)}")


def raise_on_bad_lengths(lengths, len_new, cache_len):
    """The length rules on host values (a list of ints), in raise_on_invalid's order."""
    for b, s in enumerate(lengths):
        if s < 0:
            raise ValueError(f"flashattn_ext: {negative_length(b, s)}")
    for b, s in enumerate(lengths):
        if s + len_new > cache_len:
            raise ValueError(f"flashattn_ext: {too_long(b, s, len_new, cache_len)}")


def raise_on_bad_ranges(lengths, leftpads, table, blocks, page, len_new):
    """The left padding and page rules on host values (lists of valid lengths, of left paddings or
    None, of block table rows or None), in raise_on_invalid's order: only the pages that hold keys
    of a sequence must name a block."""
    if leftpads is not None:
        for b, (pad, s) in enumerate(zip(leftpads, lengths)):
            if not 0 <= pad <= s:
                raise ValueError(f"flashattn_ext: {bad_leftpad(b, pad, s)}")
    if table is not None:
        for b, row in enumerate(table):
            first, end = (leftpads[b] if leftpads is not None else 0), lengths[b] + len_new
            for p in range(first // page, min(len(row), -(-end // page)) if end > first else 0):
                if not 0 <= row[p] < blocks:
                    raise ValueError(f"flashattn_ext: {bad_page(b, p, row[p], blocks, page, first, end)}")


def _rules(a):
    """[(ok, message)]: ok is a (B,) bool tensor, message(b) describes sequence b's violation."""
    seqlens = a.seqlens.long()
    leftpad = a.leftpad.long() if a.leftpad is not None else torch.zeros_like(seqlens)
    len_new, cache_len = a.len_new, a.cache_len
    end = seqlens + len_new
    rules = [
        (seqlens >= 0, lambda b: negative_length(b, int(seqlens[b]))),
        (end <= cache_len, lambda b: too_long(b, int(seqlens[b]), len_new, cache_len)),
    ]
    if a.leftpad is not None:
        rules.append(((leftpad >= 0) & (leftpad <= seqlens),
                      lambda b: bad_leftpad(b, int(leftpad[b]), int(seqlens[b]))))
    if a.batch_idx is not None:
        rows = a.k_cache.shape[0]
        idx = a.batch_idx.long()
        rules.append(((idx >= 0) & (idx < rows),
                      lambda b: f"cache_batch_idx[{b}] = {int(idx[b])} is not a row of k_cache (must be in "
                                f"[0, {rows}))"))
    if a.paged:
        blocks, page = a.k_cache.shape[0], a.k_cache.shape[1]
        table = a.block_table.long()
        pages = torch.arange(table.shape[1], device=table.device)
        # Only the pages that hold keys of the sequence must name a block; the rest may be padding.
        used = (pages >= (leftpad // page)[:, None]) & (pages * page < end[:, None]) & (end > leftpad)[:, None]
        bad = used & ((table < 0) | (table >= blocks))

        def page_message(b):
            p = int(bad[b].nonzero()[0])
            return bad_page(b, p, int(table[b, p]), blocks, page, int(leftpad[b]), int(end[b]))
        rules.append((~bad.any(1), page_message))
    if a.rotary_cos is not None:
        positions, len_q = a.rotary_cos.shape[0], a.q.shape[1]
        span = rotary_span(len_new, len_q, a.rotary_rows_consecutive)
        rules.append((seqlens + span <= positions if span else torch.ones_like(seqlens, dtype=torch.bool),
                      lambda b: past_tables(b, int(seqlens[b]), positions, span, len_new, len_q)))
    return rules


def raise_on_invalid(a):
    """Reads the values (CPU tensors): ValueError naming the first broken rule."""
    for ok, message in _rules(a):
        if not bool(ok.all()):
            raise ValueError(f"flashattn_ext: {message(int((~ok).nonzero()[0]))}")

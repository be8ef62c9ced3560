"""Which attention calls one step of ring attention makes: for the queries of one rank and the
keys of another, the op calls (row and column slices, mask arguments) that together give
exactly the attention of those queries to those keys at their global positions.

Pure arithmetic on positions, no tensors, no communication (flashattn_ext/distributed.py
runs the calls).

Layouts: a shard of length n on rank r of P holds
  "contiguous"  positions [r n, (r + 1) n)
  "zigzag"      chunks r and 2P - 1 - r of length c = n / 2, one early and one late, so that
                under a causal mask every rank has the same amount of work.

The op aligns its masks bottom-right: in a call on q rows [qa, qb) and key columns [ka, kb)
(global positions), local row i and column j sit at global qa + i and ka + j, and the op
compares j with i + (kb - ka) - (qb - qa). The global rule "key gk is visible to query gq
when gq - left <= gk <= gq + right" is then the op's window (left - d, right + d) with
d = qb - kb: expressible when -right <= d <= left. Rows that see no key of the block and
keys no row sees are cut off the call first, which always brings d into that range.
ALiBi (-slope |gq - gk|) is the op's own only when d = 0 (diagonal chunks); between disjoint
chunks |gq - gk| splits into a per-key term (passed as a bias row) and a per-query term
(added to the call's log-sum-exp) -- see `alibi_terms`.

Zigzag with a causal mask and no window (the case the layout is for), for rank r and the
keys of rank s:
  s == r  one causal call over the whole shard: the shard's positions are increasing, so the
          local causal mask is the global one
  s <  r  both query chunks see all of key chunk s and nothing of chunk 2P-1-s:
          one unmasked call, all 2c queries x the first c keys
  s >  r  query chunk r sees nothing; chunk 2P-1-r sees both key chunks whole:
          one unmasked call, the last c queries x all 2c keys
so every off-diagonal step costs c x 2c and the diagonal step a causal 2c x 2c."""
from dataclasses import dataclass

from .ops import CAUSAL_BOTTOM_RIGHT, CAUSAL_NONE

LAYOUTS = ("contiguous", "zigzag")


@dataclass(frozen=True)
class Chunk:
    """A run of consecutive global positions [start, start + length) stored from `local`."""
    start: int
    local: int
    length: int


@dataclass(frozen=True)
class BlockCall:
    """One op call: rows [q_start, q_end) of the local queries, columns [k_start, k_end) of
    the keys held this step, the op's causal code and window, and the global positions of the
    call's first and one-past-last query and key (for ALiBi)."""
    q_start: int
    q_end: int
    k_start: int
    k_end: int
    causal: int
    window_left: int
    window_right: int
    q_global: tuple
    k_global: tuple

    @property
    def unmasked(self):
        return self.causal == CAUSAL_NONE and self.window_left == -1 and self.window_right == -1

    @property
    def diagonal(self):
        """Query and key ranges end at the same global position (then the op's ALiBi is exact)."""
        return self.q_global[1] == self.k_global[1]


def zigzag_chunk_ids(rank, world):
    """The two of the 2·world equal chunks of the sequence that `rank` holds, early one first."""
    return rank, 2 * world - 1 - rank


def shard_chunks(rank, world, shard_len, layout):
    """The chunks of global positions that the shard of `rank` holds, in local order."""
    if layout == "contiguous":
        return (Chunk(rank * shard_len, 0, shard_len),)
    c = shard_len // 2
    early, late = zigzag_chunk_ids(rank, world)
    return Chunk(early * c, 0, c), Chunk(late * c, c, c)


def _chunk_pair_call(qc, kc, left, right):
    """The call for query chunk qc and key chunk kc under the band gq - left <= gk <= gq + right
    (-1 = unbounded), or None when no query of qc sees a key of kc."""
    qa, qb, ka, kb = qc.start, qc.start + qc.length, kc.start, kc.start + kc.length
    if right >= 0:
        qa = max(qa, ka - right)  # rows ending before the keys start see none of them
    if left >= 0:
        qb = min(qb, kb + left)  # rows starting after the keys end
    if qa >= qb:
        return None
    if right >= 0:
        kb = min(kb, qb + right)  # keys right of every remaining row's band
    if left >= 0:
        ka = max(ka, qa - left)
    if ka >= kb:
        return None
    unmasked = (right < 0 or kb - 1 <= qa + right) and (left < 0 or ka >= qb - 1 - left)
    d = qb - kb
    if unmasked:
        causal, op_left, op_right = CAUSAL_NONE, -1, -1
    else:
        op_left = left - d if left >= 0 else -1
        op_right = right + d if right >= 0 else -1
        causal = CAUSAL_NONE
        if op_right == 0:  # the plain bottom-right causal mask, the op's fastest masked path
            causal, op_right = CAUSAL_BOTTOM_RIGHT, -1
    return BlockCall(qc.local + qa - qc.start, qc.local + qb - qc.start, kc.local + ka - kc.start,
                     kc.local + kb - kc.start, causal, op_left, op_right, (qa, qb), (ka, kb))


def _merged(a, b):
    """One unmasked call for two adjacent unmasked calls sharing their rows or columns, else None."""
    if not (a.unmasked and b.unmasked):
        return None
    if (a.k_start, a.k_end) == (b.k_start, b.k_end) and a.q_end == b.q_start:
        return BlockCall(a.q_start, b.q_end, a.k_start, a.k_end, CAUSAL_NONE, -1, -1, None, a.k_global)
    if (a.q_start, a.q_end) == (b.q_start, b.q_end) and a.k_end == b.k_start:
        return BlockCall(a.q_start, a.q_end, a.k_start, b.k_end, CAUSAL_NONE, -1, -1, a.q_global, None)
    return None


def block_calls(q_chunks, k_chunks, causal, window_left, window_right, alibi):
    """The op calls for queries at q_chunks and keys at k_chunks (see the module docstring).
    Calls whose global ranges ALiBi needs are never merged across a gap in positions."""
    left, right = window_left, 0 if causal else window_right
    same_positions = q_chunks == k_chunks
    if same_positions and causal and left < 0 and not alibi:
        n = sum(c.length for c in q_chunks)
        return [BlockCall(0, n, 0, n, CAUSAL_BOTTOM_RIGHT, -1, -1, None, None)]
    calls = []
    for qc in q_chunks:
        for kc in k_chunks:
            call = _chunk_pair_call(qc, kc, left, right)
            if call is None:
                continue
            while calls and not alibi and (merged := _merged(calls[-1], call)) is not None:
                calls.pop()
                call = merged
            calls.append(call)
    return calls


def ring_steps(world, shard_len, layout, causal, window_left, window_right):
    """How many steps of the ring the ranks need: 1 + the largest t for which some rank r has a
    call with the keys of rank r - t. The ring stops there: a causal sliding window shorter than
    a contiguous shard needs 2 steps of any number of ranks (a window open to the right needs
    the keys of the following ranks, which a ring passing keys forward reaches last)."""
    chunks = [shard_chunks(r, world, shard_len, layout) for r in range(world)]
    return 1 + max(t for t in range(world) for r in range(world)
                   if t == 0 or block_calls(chunks[r], chunks[(r - t) % world], causal, window_left, window_right,
                                            False))


def alibi_terms(call):
    """For a call between disjoint position ranges: ((key_first, key_step), (query_first,
    query_step)) such that |gq - gk| = query_offset(i) + key_offset(j) >= 0 for local row i and
    column j, with offset(n) = first + step * n. Measured from the near edge of the other range,
    so that the per-key term (added to the scores) stays as small as the ranges and never
    carries the large distance between them."""
    (qa, qb), (ka, kb) = call.q_global, call.k_global
    if qa >= kb:  # queries after the keys: gq - gk = (gq - kb) + (kb - gk)
        return (kb - ka, -1), (qa - kb, 1)
    # keys after the queries: gk - gq = (gk - ka) + (ka - gq)
    return (0, 1), (ka - qa, -1)

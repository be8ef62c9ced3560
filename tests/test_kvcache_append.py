"""flashattn::kvcache_append, the in-place append of a KV-cache step, against a row-by-row copy
in Python: dense caches, cache_batch_idx rows, pages (a write crossing a page boundary, blocks of
the pages a sequence reads), left padding, several new rows or none, every dtype's word size;
sequences whose values allow no step write nothing and get seqused -1; argument errors; opcheck.
And the common step of flash_attn_with_kvcache, which calls it directly: never resolved through
the general path, equal to that path bit for bit, no host synchronisation on CUDA, CUDA graph
replay."""
import pytest
import torch

import flashattn_ext
from flashattn_ext import _kvcache_compose, kvcache
from flashattn_ext.ops import kvcache_append

op = torch.ops.flashattn.kvcache_append
BATCH, HEADS_KV, DIM, DIM_V, CACHE, PAGE = 4, 2, 8, 4, 40, 16


def _i32(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


def _expected(k_cache, v_cache, k, v, seqlens, batch_idx=None, table=None, page=None, leftpad=None):
    """The caches after the append and seqused, row by row."""
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    rows, keys = k_cache.shape[:2]
    cache_len = keys if table is None else len(table[0]) * page
    seqused = []
    for b, s in enumerate(seqlens):
        end, lo = s + k.shape[1], 0 if leftpad is None else leftpad[b]
        ok = 0 <= s and end <= cache_len and 0 <= lo <= s
        places = []
        for key in range(s, end):
            if table is not None:
                places.append((table[b][key // page] if 0 <= key < cache_len else -1, key % page))
            else:
                places.append((b if batch_idx is None else batch_idx[b], key))
        ok = ok and all(0 <= r < rows for r, _ in places)
        if ok and table is not None:  # every page that holds one of its keys names a block
            ok = all(0 <= table[b][key // page] < rows for key in range(lo, end))
        seqused.append(end if ok else -1)
        for t, (r, key) in enumerate(places if ok else []):
            k_cache[r, key], v_cache[r, key] = k[b, t], v[b, t]
    return k_cache, v_cache, seqused


CASES = {
    # seqlens: sequence 2 too long for the append, sequence 3 negative (both write nothing)
    "dense": dict(seqlens=[0, 17, CACHE - 1, -1], len_new=2),
    "dense_one_row": dict(seqlens=[5, CACHE - 1, 0, 39], len_new=1),
    "batch_idx": dict(seqlens=[3, 9, 1, 30], len_new=3, batch_idx=[5, 0, 7, 2]),  # 7 is not a row (7 rows)
    "paged": dict(seqlens=[15, 0, 30, 47], len_new=2, paged=True),  # 15..16 crosses a page; 47..48 too long
    # sequence 1 reads its page 2, which names no block; sequence 2 has too much left padding
    "paged_leftpad_no_new_rows": dict(seqlens=[20, 33, 4, 40], len_new=0, paged=True, leftpad=[17, 0, 5, 40]),
    "leftpad": dict(seqlens=[3, 9, 1, 30], len_new=1, leftpad=[3, 0, 2, -1]),
    "no_new_rows": dict(seqlens=[3, -2, CACHE, CACHE + 1], len_new=0),
}


def _case(device, dtype, seqlens, len_new, batch_idx=None, paged=False, leftpad=None):
    make = lambda *shape: torch.randn(*shape).to(dtype).to(device)  # noqa: E731
    args = dict(k=make(BATCH, len_new, HEADS_KV, DIM), v=make(BATCH, len_new, HEADS_KV, DIM_V),
                seqlens=_i32(seqlens, device))
    ref = dict(seqlens=seqlens)
    if paged:
        pages = 3  # 48 keys per sequence; sequence 1's last page names no block (-1)
        table = torch.randperm(BATCH * pages).view(BATCH, pages).to(torch.int32)
        table[1, 2] = -1
        args["block_table"], ref["table"], ref["page"] = table.to(device), table.tolist(), PAGE
        shape = (BATCH * pages, PAGE, HEADS_KV)
    else:
        shape = (7 if batch_idx else BATCH, CACHE, HEADS_KV)
    if batch_idx:
        args["batch_idx"], ref["batch_idx"] = _i32(batch_idx, device), batch_idx
    if leftpad:
        args["leftpad"], ref["leftpad"] = _i32(leftpad, device), leftpad
    args["k_cache"], args["v_cache"] = make(*shape, DIM), make(*shape, DIM_V)
    return args, ref


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=["fp64", "fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_append(device, case, dtype):
    args, ref = _case(device, dtype, **CASES[case])
    want_k, want_v, want_used = _expected(*(args[n].cpu() for n in ("k_cache", "v_cache", "k", "v")), **ref)
    used = kvcache_append(**args)
    assert used.dtype == torch.int32 and used.tolist() == want_used
    assert torch.equal(args["k_cache"].cpu(), want_k) and torch.equal(args["v_cache"].cpu(), want_v)


def test_strided_new_rows(device):
    """New rows may be strided views (last dimension contiguous), as caches views of one buffer."""
    args, ref = _case(device, torch.float32, seqlens=[1, 2, 3, 4], len_new=2)
    both = torch.randn(BATCH, 2, HEADS_KV, DIM + DIM_V, device=device)
    args["k"], args["v"] = both[..., :DIM], both[..., DIM:]
    want_k, want_v, want_used = _expected(*(args[n].cpu() for n in ("k_cache", "v_cache", "k", "v")), **ref)
    assert kvcache_append(**args).tolist() == want_used
    assert torch.equal(args["k_cache"].cpu(), want_k) and torch.equal(args["v_cache"].cpu(), want_v)


def _args():
    args, _ = _case("cpu", torch.float32, seqlens=[1, 2, 3, 4], len_new=1)
    return args


BAD = [
    (dict(seqlens=_i32([1, 2, 3], "cpu")), r"argument 'seqlens' must be a contiguous 1-D tensor of shape \[4\]"),
    (dict(seqlens=torch.ones(4, dtype=torch.int64)), r"argument 'seqlens' must have dtype int32, got int64"),
    (dict(k=torch.randn(BATCH, 1, HEADS_KV, DIM + 1)),
     r"argument 'k' has head_dim \(must equal its cache's\) 9 .* but 8 was expected"),
    (dict(v=torch.randn(BATCH, 1, HEADS_KV, DIM_V, dtype=torch.float64)),
     r"argument 'v' has dtype float64 but 'k_cache' has dtype float32; they must match"),
    (dict(v_cache=torch.randn(BATCH, CACHE + 1, HEADS_KV, DIM_V)),
     r"argument 'v_cache' has number of keys \(page size when paged\) \(must equal k_cache's\) 41"),
    (dict(k_cache=torch.randn(BATCH, CACHE, HEADS_KV, 2 * DIM)[..., ::2]),
     r"argument 'k_cache' must have 4 dimensions with a contiguous last one"),
    (dict(k_cache=torch.randn(BATCH + 1, CACHE, HEADS_KV, DIM), v_cache=torch.randn(BATCH + 1, CACHE, HEADS_KV, DIM_V)),
     r"argument 'k_cache' has batch size \(one cache row per sequence\) 5"),
    (dict(batch_idx=_i32([0, 1, 2, 3], "cpu"), block_table=_i32([[0]] * 4, "cpu")),
     r"arguments 'batch_idx' and 'block_table' cannot be combined"),
    (dict(block_table=_i32([[0, 1]] * 3, "cpu")), r"argument 'block_table' must be an int32 \(batch = 4, pages >= 1\)"),
]


@pytest.mark.parametrize("change,match", [b[0:2] for b in BAD], ids=[str(i) for i in range(len(BAD))])
def test_bad_arguments(change, match):
    args = dict(_args(), **change)
    with pytest.raises(RuntimeError, match=match):
        kvcache_append(**args)


def test_opcheck(device):
    args, _ = _case(device, torch.float32, seqlens=[1, 2, 3, 4], len_new=2)
    torch.library.opcheck(op, (args["k_cache"], args["v_cache"], args["k"], args["v"], args["seqlens"]))


# ---- the common step of flash_attn_with_kvcache ----

STEPS = {"append": dict(len_new=2, causal=True), "read_only": dict(len_new=0), "no_seqlens": dict(len_new=0),
         "int_seqlens_whole_cache": dict(len_new=0), "int_seqlens_append": dict(len_new=1),
         "paged_append": dict(len_new=2, paged=True), "paged_read_only_leftpad": dict(len_new=0, paged=True, pad=True),
         "leftpad_append": dict(len_new=1, pad=True, causal=True),
         "rotary_append": dict(len_new=2, causal=True, rotary=True),
         "rotary_read_only_halves": dict(len_new=0, rotary=True, interleaved=False),
         "int_seqlens_rotary": dict(len_new=1, rotary=True, interleaved=False),
         "paged_rotary_leftpad": dict(len_new=1, paged=True, pad=True, causal=True, rotary=True)}
# Steps over every key of the cache: the common step then passes no key ranges (the general path passes
# lengths equal to the cache's), so the kernels may round differently.
ALL_KEYS = {"no_seqlens": None, "int_seqlens_whole_cache": CACHE + 2}
ROTARY_POSITIONS = CACHE + 4


def _step(device, len_new, causal=False, lengths=(5, 17, 40, 0), paged=False, pad=False, rotary=False,
          interleaved=True):
    make = lambda *shape: torch.randn(*shape, device=device, dtype=torch.bfloat16)  # noqa: E731
    call = dict(q=make(BATCH, 2, 4, DIM), cache_seqlens=_i32(lengths, device), causal=causal)
    if rotary:  # rotary_dim 6 of DIM 8, float32 tables
        angle = torch.arange(ROTARY_POSITIONS, dtype=torch.float64)[:, None] / 10000 ** (torch.arange(3) / 3)
        call["rotary_cos"], call["rotary_sin"] = angle.cos().float().to(device), angle.sin().float().to(device)
        call["rotary_interleaved"] = interleaved
    if paged:  # 3 pages of 16 keys per sequence; pages past a sequence's keys name no block (-1)
        table = torch.randperm(BATCH * 3 + 1)[:BATCH * 3].view(BATCH, 3).to(torch.int32)
        for b, s in enumerate(lengths):
            table[b, max(0, (s + len_new + PAGE - 1) // PAGE):] = -1
        call["block_table"] = table.to(device)
        call["k_cache"], call["v_cache"] = make(BATCH * 3 + 1, PAGE, HEADS_KV, DIM), make(BATCH * 3 + 1, PAGE,
                                                                                         HEADS_KV, DIM_V)
    else:
        call["k_cache"], call["v_cache"] = make(BATCH, CACHE + 2, HEADS_KV, DIM), make(BATCH, CACHE + 2, HEADS_KV,
                                                                                      DIM_V)
    if pad:
        call["cache_leftpad"] = _i32([min(3, s) for s in lengths], device)
    if len_new:
        call["k"], call["v"] = make(BATCH, len_new, HEADS_KV, DIM), make(BATCH, len_new, HEADS_KV, DIM_V)
    return call


def _same(a, b):
    """Equal bit for bit, NaN where the other is NaN."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


@pytest.mark.parametrize("step", list(STEPS))
def test_common_step_is_the_general_path(device, step, monkeypatch):
    """The common step never resolves its arguments (it is the short path), and gives what the
    general path gives, out, lse and caches bit for bit. On CUDA sequence 2 is too long for the
    cache (NaN rows, no write)."""
    lengths = (5, 17, 40, 0) if device == "cpu" else (5, 17, 49, 0)
    call = _step(device, lengths=lengths, **STEPS[step])
    if step in ALL_KEYS:
        call["cache_seqlens"] = ALL_KEYS[step]
    elif step in ("int_seqlens_append", "int_seqlens_rotary"):
        call["cache_seqlens"] = 30
    general = dict(call, k_cache=call["k_cache"].clone(), v_cache=call["v_cache"].clone())
    resolved = kvcache._resolve(
        general["q"], general["k_cache"], general["v_cache"], general.get("k"), general.get("v"),
        general.get("rotary_cos"), general.get("rotary_sin"), general["cache_seqlens"], None,
        general.get("cache_leftpad"), general.get("block_table"), None, general["causal"], (-1, -1), 0.0,
        general.get("rotary_interleaved", True), None, 0)
    want_out, want_lse = _kvcache_compose.forward(resolved)

    resolved_calls = []
    resolve = kvcache._resolve
    monkeypatch.setattr(kvcache, "_resolve", lambda *args: resolved_calls.append(1) or resolve(*args))
    out, lse = flashattn_ext.flash_attn_with_kvcache(**call, return_softmax_lse=True)
    assert not resolved_calls
    if step in ALL_KEYS:
        torch.testing.assert_close(out, want_out, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-4)
    else:
        assert _same(out, want_out) and _same(lse, want_lse)
    assert out.isnan().any() == (device != "cpu" and type(call["cache_seqlens"]) is torch.Tensor)
    assert torch.equal(call["k_cache"], general["k_cache"]) and torch.equal(call["v_cache"], general["v_cache"])


def _check_sequence_1_refused(device, call, cpu_message):
    """Sequence 1 of `call` breaks a per-sequence rule: the CPU raises `cpu_message` and writes nothing; on CUDA
    (no host sync) that sequence writes nothing and gets NaN rows, the others append and attend as usual."""
    before = call["k_cache"].clone()
    if device == "cpu":
        with pytest.raises(ValueError, match=cpu_message):
            flashattn_ext.flash_attn_with_kvcache(**call)
        assert torch.equal(call["k_cache"], before)
        return
    out, lse = flashattn_ext.flash_attn_with_kvcache(**call, return_softmax_lse=True)
    assert out[1].isnan().all() and lse[1].isnan().all() and not out[[0, 2, 3]].isnan().any()
    assert torch.equal(call["k_cache"][1], before[1]) and not torch.equal(call["k_cache"][0], before[0])


def test_common_step_out_of_range_rows(device):
    """On the device path (CUDA; the CPU raises) a sequence too long for its append writes nothing
    and gets NaN rows; on the CPU the error names it."""
    call = _step(device, len_new=3, lengths=(5, CACHE, 0, 7))
    _check_sequence_1_refused(device, call, r"cache_seqlens\[1\] = 40 plus the 3 new keys exceeds the cache length "
                                            r"42: the cache is too short for the append")


def test_common_step_rotary_past_tables(device):
    """A sequence whose rotary positions pass the tables' end: on the CPU the error names it (and
    nothing is written); on CUDA it writes nothing and gets NaN rows, the others are unaffected."""
    call = _step(device, len_new=2, causal=True, rotary=True, lengths=(5, ROTARY_POSITIONS - 1, 0, 7))
    call["k_cache"], call["v_cache"] = (torch.randn(BATCH, ROTARY_POSITIONS + 4, HEADS_KV, d, device=device,
                                                    dtype=torch.bfloat16) for d in (DIM, DIM_V))
    _check_sequence_1_refused(device, call, r"rotary_cos has 44 positions but sequence 1 needs position 44 "
                                            r"\(cache_seqlens\[1\] = 43, 2 new keys, 2 query rows\)")


@pytest.mark.skipif(not torch.cuda.is_available() or not flashattn_ext.has_cuda_kernels(), reason="needs CUDA")
@pytest.mark.parametrize("rotary", [False, True], ids=["plain", "rotary"])
def test_common_step_no_host_sync(rotary):
    call = _step("cuda", len_new=1, rotary=rotary)
    flashattn_ext.flash_attn_with_kvcache(**call)  # lazy initialisation may synchronise once
    torch.cuda.set_sync_debug_mode("error")
    try:
        flashattn_ext.flash_attn_with_kvcache(**call, return_softmax_lse=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.skipif(not torch.cuda.is_available() or not flashattn_ext.has_cuda_kernels(), reason="needs CUDA")
@pytest.mark.parametrize("rotary", [False, True], ids=["plain", "rotary"])
def test_common_step_cuda_graph(rotary):
    """Captured once, replayed with new q, k, v and lengths (one out of range): equal to eager calls."""
    static = _step("cuda", len_new=1, causal=True, rotary=rotary)
    caches = (static["k_cache"].clone(), static["v_cache"].clone())
    flashattn_ext.flash_attn_with_kvcache(**static)  # lazy initialisation outside the graph
    static["k_cache"].copy_(caches[0])
    static["v_cache"].copy_(caches[1])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = flashattn_ext.flash_attn_with_kvcache(**static)
    eager = dict(static, k_cache=caches[0], v_cache=caches[1])
    for lengths in ([5, 17, 40, 0], [6, 18, CACHE + 2, 1], [7, 19, 41, 2]):
        for name in ("q", "k", "v"):
            static[name].copy_(torch.randn_like(static[name]))
        static["cache_seqlens"].copy_(_i32(lengths, "cuda"))
        graph.replay()
        eager = dict(eager, q=static["q"].clone(), k=static["k"].clone(), v=static["v"].clone(),
                     cache_seqlens=static["cache_seqlens"].clone())
        out = flashattn_ext.flash_attn_with_kvcache(**eager)
        torch.cuda.synchronize()
        assert torch.equal(static_out.isnan(), out.isnan()) and torch.equal(static_out.nan_to_num(), out.nan_to_num())
        assert torch.equal(static["k_cache"], eager["k_cache"]) and torch.equal(static["v_cache"], eager["v_cache"])

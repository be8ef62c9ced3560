"""flash_attn_with_kvcache against a float64 reference built sequence by sequence
(kvcache_reference.py), with the accuracy rule of DESIGN §4 for out and lse and the cache
contents after the in-place append: append, rotary (both layouts, with and without append),
paged caches, leftpad, cache_batch_idx, GQA/MQA, causal, window, softcap, ALiBi, several query
rows, every dtype; plus argument errors, the masking of out-of-range values on the device path,
and CUDA-graph capture."""
import inspect

import pytest
import torch

import flashattn_ext
from flashattn_ext import _kvcache_compose
from flashattn_ext._measure import REL_ATOL
from flashattn_ext.kvcache import _resolve
from kvcache_reference import kvcache_ref
from reference import assert_accurate, lse_dtype

BATCH, HEADS, DIM, CACHE, PAGE = 3, 4, 16, 64, 16
DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def make_case(device, dtype, heads_kv=2, len_q=1, len_new=1, dim_v=DIM, paged=False, batch_idx=False, leftpad=False,
              rotary=False, interleaved=True, rotary_half=DIM // 4, rotary_f32=False, seqlens=(7, 33, None), alibi=None,
              page=PAGE, cache=CACHE, **options):
    """(kwargs of flash_attn_with_kvcache, kwargs of kvcache_ref); seqlens None = fill the cache
    (`cache` keys per sequence: cache / page pages of `page` keys when paged). Rotary tables of
    rotary_dim = 2 * rotary_half (default 8 < DIM: the last features pass through), in float32
    with rotary_f32."""
    make = lambda *shape: torch.randn(*shape, dtype=torch.float32).to(dtype)
    seqlens = [cache - len_new if s is None else s for s in seqlens]
    ours = dict(q=make(BATCH, len_q, HEADS, DIM), **options)
    ref = dict(options)
    if paged:
        pages = cache // page
        blocks = BATCH * pages + 2
        table = torch.randperm(blocks)[:BATCH * pages].view(BATCH, pages).to(torch.int32)
        # Pages past a sequence's end may hold anything (serving stacks pad with -1).
        for b, s in enumerate(seqlens):
            table[b, (s + len_new + page - 1) // page:] = -1
        ours["block_table"], ref["block_table"] = table, table.tolist()
        cache_shape = (blocks, page, heads_kv)
    elif batch_idx:
        rows = torch.tensor([4, 0, 2], dtype=torch.int32)
        ours["cache_batch_idx"], ref["batch_idx"] = rows, rows.tolist()
        cache_shape = (5, cache, heads_kv)
    else:
        cache_shape = (BATCH, cache, heads_kv)
    ours["k_cache"], ours["v_cache"] = make(*cache_shape, DIM), make(*cache_shape, dim_v)
    if len_new:
        ours["k"], ours["v"] = make(BATCH, len_new, heads_kv, DIM), make(BATCH, len_new, heads_kv, dim_v)
    ours = dict(ours, cache_seqlens=torch.tensor(seqlens, dtype=torch.int32))
    ref["seqlens"] = seqlens
    if leftpad:
        pad = torch.tensor([min(3, s) for s in seqlens], dtype=torch.int32)
        ours["cache_leftpad"], ref["leftpad"] = pad, pad.tolist()
    if rotary:
        half = rotary_half
        angle = torch.arange(cache + 2, dtype=torch.float64)[:, None] / 10000 ** (torch.arange(half) / half)
        table = torch.float32 if rotary_f32 else dtype
        ours["rotary_cos"], ours["rotary_sin"] = angle.cos().to(table), angle.sin().to(table)
        ours["rotary_interleaved"] = ref["interleaved"] = interleaved
    if alibi is not None:
        ours["alibi_slopes"] = ref["alibi"] = 0.3 * torch.rand(alibi if alibi == (HEADS,) else (BATCH, HEADS))
    for name in ("q", "k_cache", "v_cache", "k", "v", "rotary_cos", "rotary_sin"):
        if name in ours:
            ref[name] = ours[name]
    ref["causal"] = ours.get("causal", False)
    ref["window"] = ours.get("window_size", (-1, -1))
    ref["softcap"] = ours.get("softcap", 0.0)
    ref["scale"] = ours.get("softmax_scale")
    for name in ("window_size", "softmax_scale", "cache_seqlens"):
        ref.pop(name, None)
    if "cache_seqlens" in options:
        ours["cache_seqlens"] = options["cache_seqlens"]
        ref["seqlens"] = None
    ours = {n: t.to(device) if isinstance(t, torch.Tensor) else t for n, t in ours.items()}
    return ours, ref


def run_and_check(ours, ref, fn=flashattn_ext.flash_attn_with_kvcache):
    """Runs fn on copies of the caches, checks out, lse and both caches; returns out, lse."""
    ours = dict(ours, k_cache=ours["k_cache"].clone(), v_cache=ours["v_cache"].clone())
    out, lse = fn(**ours, return_softmax_lse=True)
    dtype = ours["q"].dtype
    as64 = {n: (t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() and n != "alibi" else t)
            for n, t in ref.items()}
    expected, same = kvcache_ref(**as64), kvcache_ref(**ref)
    got = (out, lse, ours["k_cache"], ours["v_cache"])
    assert out.dtype == dtype and lse.dtype == lse_dtype(dtype)
    for name, g, r, s in zip(("out", "lse", "k_cache", "v_cache"), got, expected, same):
        assert_accurate(name, g.cpu(), r, s, REL_ATOL[lse_dtype(dtype) if name == "lse" else dtype])
    return out, lse


CASES = {
    "no_append": dict(len_new=0),
    "append": dict(),
    "append_causal_spec_rows": dict(len_q=3, len_new=3, causal=True),
    "rows_beyond_new_keys": dict(len_q=4, len_new=1, causal=True, seqlens=(0, 2, None)),
    "alibi_rows_beyond_new_keys": dict(alibi=(HEADS,), len_q=4, len_new=1, causal=True, seqlens=(0, 2, None)),
    "mqa": dict(heads_kv=1, len_q=2, causal=True),
    "mha_dim_v": dict(heads_kv=4, dim_v=8),
    "dim_v_odd_rotary": dict(dim_v=6, rotary=True, len_q=2),  # (rows of 12 / 24 bytes: the append's element copies)
    "full_cache": dict(seqlens=(None, None, None), len_new=2, len_q=2),
    "no_seqlens": dict(len_new=0, cache_seqlens=None),
    "rotary_interleaved": dict(rotary=True, len_q=2),
    "rotary_halves_causal": dict(rotary=True, interleaved=False, len_q=2, len_new=2, causal=True),
    "rotary_no_append": dict(rotary=True, len_new=0, len_q=2, causal=True),
    "rotary_no_append_noncausal": dict(rotary=True, interleaved=False, len_new=0, len_q=2),
    "paged": dict(paged=True, len_new=2, len_q=2, causal=True),
    "paged_rotary_leftpad": dict(paged=True, rotary=True, leftpad=True, causal=True),
    "leftpad": dict(leftpad=True, len_q=2, causal=True),
    "batch_idx": dict(batch_idx=True, len_q=2),
    "batch_idx_rotary": dict(batch_idx=True, rotary=True, interleaved=False),
    "rotary_full_dim_gqa_rows": dict(rotary=True, rotary_half=DIM // 2, len_q=3, len_new=3, causal=True),
    "rotary_f32_tables_paged_halves": dict(paged=True, rotary=True, rotary_f32=True, interleaved=False, leftpad=True,
                                           len_q=2, len_new=3, causal=True, seqlens=(14, 30, None)),
    "rotary_mqa_batch_idx_no_append": dict(batch_idx=True, rotary=True, rotary_half=3, heads_kv=1, len_new=0,
                                           len_q=2, leftpad=True),
    "window": dict(window_size=(5, 0), len_q=3, len_new=2),
    "window_both_sides": dict(window_size=(4, 2), len_q=3, len_new=0, leftpad=True),
    "window_causal_rotary": dict(window_size=(6, -1), causal=True, rotary=True, len_q=2),
    "softcap": dict(softcap=2.0, softmax_scale=1.0, len_q=2, causal=True),
    "alibi_heads": dict(alibi=(HEADS,), len_q=2, causal=True),
    "alibi_batch_heads_window": dict(alibi=(BATCH, HEADS), window_size=(8, 3), len_q=2, leftpad=True),
    "everything_paged": dict(paged=True, rotary=True, leftpad=True, alibi=(HEADS,), softcap=3.0,
                             window_size=(20, -1), causal=True, heads_kv=1, len_q=3, len_new=2),
}


@pytest.mark.parametrize("leftpad", [True, False], ids=["leftpad", "from_0"])
@pytest.mark.parametrize("page,cache", [(16, 64), (48, 144), (64, 128), (256, 256)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_paged_page_sizes(device, dtype, page, cache, leftpad):
    """Pages of 16 (a 64-key tile spans 4), 48 (tiles start mid-page), 64 and 256 keys, with left
    padding (sequences start mid-page) or without (the CUDA decode kernel's whole-tile copies at pages of
    64 and 256), ragged lengths, MQA, several query rows, causal."""
    run_and_check(*make_case(device, dtype, paged=True, page=page, cache=cache, leftpad=leftpad, heads_kv=1, len_q=3,
                             len_new=2, causal=True, seqlens=(5, cache // 2 + 3, None)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64],
                         ids=["fp32", "bf16", "fp16", "fp64"])
@pytest.mark.parametrize("page", [16, 48, 256])
def test_cpu_paged_steps_equal_dense_bit_for_bit(dtype, page):
    """On the CPU a paged cache's rows are read in their pages, by the decode tile (up to 8 query rows) and by the
    prefill tiles (longer queries); each row's sums run as over the dense cache, so the outputs match it exactly.
    Pages in shuffled blocks, ragged lengths, GQA, head dims in whole vectors (64), ending with a half vector (40 in
    floats under AVX-512) and mid one (36 there: the last vector masked; copied under AVX2)."""
    torch.manual_seed(0)
    batch, cache, heads, heads_kv = 3, 768, 8, 2
    lens = torch.tensor([cache, 300, 77], dtype=torch.int32)
    for dim in (64, 40, 36):
        k = torch.randn(batch, cache, heads_kv, dim, dtype=dtype)
        v = torch.randn(batch, cache, heads_kv, dim, dtype=dtype)
        pages = cache // page
        table = torch.randperm(batch * pages + 3)[: batch * pages].reshape(batch, pages).to(torch.int32)
        k_pages = torch.randn(batch * pages + 3, page, heads_kv, dim, dtype=dtype)
        v_pages = torch.randn_like(k_pages)
        k_pages[table.flatten().long()] = k.reshape(batch * pages, page, heads_kv, dim)
        v_pages[table.flatten().long()] = v.reshape(batch * pages, page, heads_kv, dim)
        for len_q in (1, 5, 12):
            q = torch.randn(batch, len_q, heads, dim, dtype=dtype)
            dense = flashattn_ext.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, causal=True,
                                                          return_softmax_lse=True)
            paged = flashattn_ext.flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=lens, block_table=table,
                                                          causal=True, return_softmax_lse=True)
            assert torch.equal(dense[0], paged[0]) and torch.equal(dense[1], paged[1]), (dim, len_q)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64],
                         ids=["fp32", "bf16", "fp16", "fp64"])
@pytest.mark.parametrize("dim,dim_v", [(40, 72), (72, 40), (36, 20), (44, 52), (34, 66)])
def test_cpu_decode_head_dims_past_whole_vectors(dtype, dim, dim_v):
    """CPU decode steps whose key / value rows end with a half vector (floats under AVX-512: 40, 72; read where they
    lie, the last half loaded alone) or mid one (36, 20, 44, 52, 34, 66 there: read where they lie, the last vector
    masked; under AVX2 copied into the tiles first where not half vectors), GQA, ragged lengths, causal, one and three
    query rows, against the float64 reference."""
    torch.manual_seed(0)
    batch, cache, heads, heads_kv = 2, 300, 8, 2
    k_cache = torch.randn(batch, cache, heads_kv, dim, dtype=dtype)
    v_cache = torch.randn(batch, cache, heads_kv, dim_v, dtype=dtype)
    seqlens = [cache, 131]
    for len_q in (1, 3):
        q = torch.randn(batch, len_q, heads, dim, dtype=dtype)
        out, lse = flashattn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.tensor(
            seqlens, dtype=torch.int32), causal=True, return_softmax_lse=True)
        expected = kvcache_ref(q.double(), k_cache.double(), v_cache.double(), seqlens=seqlens, causal=True)
        same = kvcache_ref(q, k_cache, v_cache, seqlens=seqlens, causal=True)
        assert_accurate("out", out, expected[0], same[0], REL_ATOL[dtype])
        assert_accurate("lse", lse, expected[1], same[1], REL_ATOL[lse_dtype(dtype)])


@pytest.mark.parametrize("len_q", [1, 5, 16])
def test_decode_rows_gqa(device, len_q):
    """1..16 query rows of a GQA group of 4 (the decode kernel's packed rows), dense and paged."""
    for paged in (False, True):
        run_and_check(*make_case(device, torch.float16, paged=paged, heads_kv=1, len_q=len_q, len_new=1, causal=True,
                                 seqlens=(0, 20, None)))


@pytest.mark.parametrize("case", list(CASES))
def test_kvcache_fp32(device, case):
    run_and_check(*make_case(device, torch.float32, **CASES[case]))


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("case", ["append_causal_spec_rows", "paged_rotary_leftpad", "everything_paged",
                                  "batch_idx_rotary", "rotary_f32_tables_paged_halves", "dim_v_odd_rotary"])
def test_kvcache_dtypes(device, case, dtype):
    run_and_check(*make_case(device, dtype, **CASES[case]))


def test_int_seqlens_and_plain_output(device):
    """An int cache_seqlens means every sequence; without return_softmax_lse only out returns."""
    ours, ref = make_case(device, torch.float32, seqlens=(20, 20, 20), len_q=2, causal=True)
    out, _ = run_and_check(ours, ref)
    ours["cache_seqlens"] = 20
    plain = flashattn_ext.flash_attn_with_kvcache(**ours)
    assert isinstance(plain, torch.Tensor) and torch.equal(plain, out)


def test_num_splits_is_a_hint(device):
    ours, _ = make_case(device, torch.float32, len_new=0, len_q=2, causal=True)
    out = flashattn_ext.flash_attn_with_kvcache(**ours)
    for splits in (1, 3):
        assert torch.equal(flashattn_ext.flash_attn_with_kvcache(**ours, num_splits=splits), out)


def test_strided_query_and_new_keys(device):
    """q, k and v with a non-contiguous last dimension are accepted (small, copied)."""
    ours, ref = make_case(device, torch.float32, len_q=2, len_new=2, causal=True)
    for name in ("q", "k", "v"):
        wide = torch.cat((ours[name], ours[name]), dim=-1)
        ours[name] = wide[..., ::2].copy_(ours[name])
        assert ours[name].stride(-1) == 2
    run_and_check(ours, ref)


@pytest.mark.parametrize("rotary", [False, True], ids=["plain", "rotary"])
def test_cache_with_more_rows_than_the_batch(device, rotary):
    """A dense cache with rows past the batch and no cache_batch_idx (a cache allocated for a larger batch): sequence
    b is row b, as in flash-attn; the append lands in the cache itself and the other rows are left alone."""
    ours, ref = make_case(device, torch.float32, len_q=2, len_new=2, causal=True, rotary=rotary)
    extra = {name: torch.randn((2,) + ours[name].shape[1:], device=device) for name in ("k_cache", "v_cache")}
    big = {name: torch.cat((ours[name], extra[name])) for name in ("k_cache", "v_cache")}
    out, lse = flashattn_ext.flash_attn_with_kvcache(**dict(ours, **big), return_softmax_lse=True)
    want_out, want_lse = run_and_check(ours, ref)
    _, _, k_after, v_after = kvcache_ref(**ref)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    assert torch.equal(big["k_cache"][:BATCH].cpu(), k_after) and torch.equal(big["v_cache"][:BATCH].cpu(), v_after)
    assert all(torch.equal(big[name][BATCH:], extra[name]) for name in extra)


def test_cache_views_of_one_buffer(device):
    """k_cache and v_cache as strided views of one (B, C, 2, Hkv, E) buffer: written in place."""
    ours, ref = make_case(device, torch.float32, len_q=2, len_new=2, causal=True)
    kv = torch.stack((ours["k_cache"], ours["v_cache"]), dim=2)
    ours["k_cache"], ours["v_cache"] = kv[:, :, 0], kv[:, :, 1]
    out = flashattn_ext.flash_attn_with_kvcache(**ours)
    _, _, k_after, v_after = kvcache_ref(**ref)
    assert torch.equal(kv[:, :, 0].cpu(), k_after) and torch.equal(kv[:, :, 1].cpu(), v_after)
    assert torch.equal(out, run_and_check(ours, ref)[0])


def test_torch_compile_fullgraph(device):
    """torch.compile(fullgraph=True) traces the whole call (values unchecked there, as on CUDA)."""
    ours, ref = make_case(device, torch.float32, **CASES["everything_paged"])
    run_and_check(ours, ref, torch.compile(flashattn_ext.flash_attn_with_kvcache, fullgraph=True))


# ---- forward only ----

def test_requires_grad_is_an_error(device):
    ours, _ = make_case(device, torch.float32)
    ours["q"].requires_grad_()
    with pytest.raises(ValueError, match=r"q requires grad, but flash_attn_with_kvcache is forward only"):
        flashattn_ext.flash_attn_with_kvcache(**ours)
    with torch.no_grad():
        out = flashattn_ext.flash_attn_with_kvcache(**ours)
    assert not out.requires_grad


# ---- argument errors ----

def _change(**changes):
    def apply(ours):
        for name, value in changes.items():
            ours[name] = value(ours) if callable(value) else value
    return apply


BAD = [
    ("q_rank", _change(q=lambda a: a["q"][0]), r"q must have 4 dimensions \(batch, seq_len_q, heads, head_dim\), "
                                               r"got shape \(1, 4, 16\)"),
    ("int_q", _change(q=lambda a: a["q"].int(), k_cache=lambda a: a["k_cache"].int()),
     r"q has dtype torch.int32; supported dtypes are"),
    ("cache_dtype", _change(k_cache=lambda a: a["k_cache"].double()),
     r"k_cache has dtype torch.float64 but q has dtype torch.float32; they must match"),
    ("v_cache_shape", _change(v_cache=lambda a: a["v_cache"][:, :10]),
     r"v_cache has shape \(3, 10, 2, 16\) and k_cache \(3, 64, 2, 16\); they must agree"),
    ("head_dim", _change(k_cache=lambda a: a["k_cache"][..., :8], v_cache=lambda a: a["v_cache"][..., :8]),
     r"k_cache has head_dim 8 but q has 16"),
    ("heads", _change(q=lambda a: a["q"][:, :, :3]), r"q has 3 heads and k_cache 2; the number of query heads must"),
    ("cache_stride", _change(k_cache=lambda a: torch.cat((a["k_cache"], a["k_cache"]), -1)[..., ::2],
                             v_cache=lambda a: torch.cat((a["v_cache"], a["v_cache"]), -1)[..., ::2]),
     r"k_cache must have a contiguous last dimension \(stride 1\), got stride 2"),
    ("k_without_v", _change(v=None), r"k and v must be given together"),
    ("k_shape", _change(k=lambda a: a["k"][:2], v=lambda a: a["v"][:2]),
     r"k must have shape \(batch, seq_len_new, heads_kv, head_dim\) = \(3, 1, 2, 16\) .*got \(2, 1, 2, 16\)"),
    ("v_shape", _change(v=lambda a: a["v"][..., :8]), r"v must have shape .* = \(3, 1, 2, 16\) .*got \(3, 1, 2, 8\)"),
    ("append_without_seqlens", _change(cache_seqlens=None), r"k and v are given but cache_seqlens is None"),
    ("seqlens_dtype", _change(cache_seqlens=lambda a: a["cache_seqlens"].long()),
     r"cache_seqlens must have dtype int32, got torch.int64"),
    ("seqlens_shape", _change(cache_seqlens=lambda a: a["cache_seqlens"][:2]),
     r"cache_seqlens must have shape \(3,\) \(batch,\), got \(2,\)"),
    ("seqlens_float", _change(cache_seqlens=2.0), r"cache_seqlens must be an int or an int32 tensor"),
    ("seqlens_int_too_long", _change(cache_seqlens=64),
     r"cache_seqlens = 64 must be in \[0, cache length 64 - new keys 1\]: the cache is too short for the append"),
    ("cache_batch", _change(k_cache=lambda a: a["k_cache"][:2], v_cache=lambda a: a["v_cache"][:2]),
     r"k_cache has batch 2 but q has 3; without cache_batch_idx \(or block_table\) sequence b is cache row b, so "
     r"it needs at least q's batch"),
    ("batch_idx_dtype", _change(cache_batch_idx=torch.tensor([0, 1, 2])),
     r"cache_batch_idx must have dtype int32, got torch.int64"),
    ("leftpad_shape", _change(cache_leftpad=torch.zeros(3, 1, dtype=torch.int32)),
     r"cache_leftpad must have 1 dimensions"),
    ("block_table_dtype", _change(block_table=torch.zeros(3, 4, dtype=torch.int64)),
     r"block_table must have dtype int32, got torch.int64"),
    ("block_table_batch", _change(block_table=torch.zeros(2, 4, dtype=torch.int32)),
     r"block_table must have shape \(batch = 3, pages_per_sequence >= 1\), got \(2, 4\)"),
    ("page_size", _change(block_table=torch.zeros(3, 4, dtype=torch.int32),
                          k_cache=lambda a: a["k_cache"][:, :24], v_cache=lambda a: a["v_cache"][:, :24]),
     r"the page size \(k_cache.shape\[1\] with a block_table\) must be a positive multiple of 16, got 24"),
    ("paged_batch_idx", _change(block_table=torch.zeros(3, 4, dtype=torch.int32),
                                cache_batch_idx=torch.zeros(3, dtype=torch.int32)),
     r"cache_batch_idx cannot be combined with block_table"),
    ("rotary_half", _change(rotary_cos=torch.ones(70, 4)), r"rotary_cos and rotary_sin must be given together"),
    ("rotary_dim", _change(rotary_cos=torch.ones(70, 9), rotary_sin=torch.ones(70, 9)),
     r"rotary_dim = 2 \* rotary_cos.shape\[1\] = 18 must be between 2 and head_dim = 16"),
    ("rotary_shapes", _change(rotary_cos=torch.ones(70, 4), rotary_sin=torch.ones(60, 4)),
     r"rotary_sin has shape \(60, 4\) but rotary_cos has \(70, 4\)"),
    ("rotary_dtype", _change(rotary_cos=torch.ones(70, 4, dtype=torch.float64),
                             rotary_sin=torch.ones(70, 4, dtype=torch.float64)),
     r"rotary_cos has dtype torch.float64; it must be q's dtype \(torch.float32\) or float32"),
    ("alibi_shape", _change(alibi_slopes=torch.ones(3)), r"alibi_slopes must have shape \(4,\) \(heads\) or \(3, 4\)"),
    ("alibi_dtype", _change(alibi_slopes=torch.ones(4, dtype=torch.float64)),
     r"alibi_slopes must have dtype float32, got torch.float64"),
    ("window", _change(window_size=(-2, 0)), r"window_size must be \(left, right\) with each >= 0, or -1"),
    ("window_type", _change(window_size=3), r"window_size must be a pair \(left, right\) of ints, got 3"),
    ("softcap", _change(softcap=-1.0), r"softcap must be >= 0 \(0 = off\), got -1.0"),
    ("num_splits", _change(num_splits=-1), r"num_splits must be an int >= 0 \(0 = automatic\), got -1"),
]


@pytest.mark.parametrize("change,match", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_argument_errors(device, change, match):
    ours, _ = make_case(device, torch.float32)
    change(ours)
    ours = {n: t.to(device) if isinstance(t, torch.Tensor) else t for n, t in ours.items()}
    with pytest.raises(ValueError, match=match):
        flashattn_ext.flash_attn_with_kvcache(**ours)


def test_device_mismatch():
    ours, _ = make_case("cpu", torch.float32)
    ours["cache_seqlens"] = ours["cache_seqlens"].to("meta")
    with pytest.raises(ValueError, match=r"cache_seqlens is on device meta but q is on cpu; they must be on the same"):
        flashattn_ext.flash_attn_with_kvcache(**ours)


# ---- out-of-range index values: an error on the CPU, a masked sequence on the device path ----

def _seqlens(values):
    return _change(cache_seqlens=torch.tensor(values, dtype=torch.int32))


OUT_OF_RANGE = [
    ("seqlens_negative", dict(), _seqlens([7, -1, 63]), r"cache_seqlens\[1\] = -1 must be >= 0"),
    ("seqlens_negative_read_only", dict(len_new=0), _seqlens([7, -1, 64]), r"cache_seqlens\[1\] = -1 must be >= 0"),
    ("seqlens_past_cache_read_only", dict(len_new=0), _seqlens([7, 65, 64]),
     r"cache_seqlens\[1\] = 65 plus the 0 new keys exceeds the cache length 64"),
    ("cache_too_short", dict(len_new=2), _seqlens([7, 63, 62]),
     r"cache_seqlens\[1\] = 63 plus the 2 new keys exceeds the cache length 64: the cache is too short"),
    ("leftpad", dict(leftpad=True), _change(cache_leftpad=torch.tensor([3, 40, 3], dtype=torch.int32)),
     r"cache_leftpad\[1\] = 40 must be in \[0, cache_seqlens\[1\] = 33\]"),
    ("batch_idx", dict(batch_idx=True), _change(cache_batch_idx=torch.tensor([4, 5, 2], dtype=torch.int32)),
     r"cache_batch_idx\[1\] = 5 is not a row of k_cache \(must be in \[0, 5\)\)"),
    ("block_table", dict(paged=True), lambda a: a["block_table"][1].__setitem__(1, 14),
     r"block_table\[1, 1\] = 14 is not a block of k_cache \(must be in \[0, 14\)\); page 1 holds keys 16..31 of "
     r"sequence 1, which has keys 0..33"),
    ("rotary_positions", dict(rotary=True, len_new=0, len_q=3, causal=True, seqlens=(7, 33, 20)),
     _seqlens([7, 64, 20]),
     r"rotary_cos has 66 positions but sequence 1 needs position 66 \(cache_seqlens\[1\] = 64"),
]


@pytest.mark.parametrize("case,change,match", [c[1:] for c in OUT_OF_RANGE], ids=[c[0] for c in OUT_OF_RANGE])
def test_out_of_range_values(device, case, change, match):
    """Sequence 1 breaks a rule. The public function raises on the CPU; the device path (run
    here directly on every device) writes nothing for it, reads nothing out of bounds and gives
    it NaN rows, while the other sequences match a call where sequence 1 is valid and its append
    rewrites the cache's own values."""
    fixed, _ = make_case(device, torch.float32, **case)
    bad = {n: t.clone() if isinstance(t, torch.Tensor) else t for n, t in fixed.items()}
    bad = {n: t.cpu() if isinstance(t, torch.Tensor) else t for n, t in bad.items()}
    change(bad)
    bad = {n: t.to(device) if isinstance(t, torch.Tensor) else t for n, t in bad.items()}
    if device == "cpu":
        with pytest.raises(ValueError, match=match):
            flashattn_ext.flash_attn_with_kvcache(**bad)
    if "k" in fixed:  # sequence 1's valid append writes back what its slots already hold
        s = int(fixed["cache_seqlens"][1])
        for new, cache in (("k", "k_cache"), ("v", "v_cache")):
            slots = [(int(fixed["block_table"][1, p // PAGE]), p % PAGE) if "block_table" in fixed else
                     (int(fixed["cache_batch_idx"][1]) if "cache_batch_idx" in fixed else 1, p)
                     for p in range(s, s + fixed[new].shape[1])]
            fixed[new][1] = torch.stack([fixed[cache][r, c] for r, c in slots])
            bad[new] = fixed[new].clone()
    out, lse = _kvcache_compose.forward(_resolved(bad))
    want, want_lse = flashattn_ext.flash_attn_with_kvcache(**fixed, return_softmax_lse=True)
    assert out[1].isnan().all() and lse[1].isnan().all()
    keep = [0, 2]
    assert torch.equal(out[keep], want[keep]) and torch.equal(lse[keep], want_lse[keep])
    assert torch.equal(bad["k_cache"], fixed["k_cache"]) and torch.equal(bad["v_cache"], fixed["v_cache"])


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_every_sequence_out_of_range(device, paged):
    """With no valid sequence the device path leaves both caches exactly as they were."""
    ours, _ = make_case(device, torch.float32, paged=paged, len_new=2)
    ours["cache_seqlens"] = torch.tensor([-5, 63, 1000], dtype=torch.int32, device=device)
    before = ours["k_cache"].clone(), ours["v_cache"].clone()
    out, lse = _kvcache_compose.forward(_resolved(ours))
    assert out.isnan().all() and lse.isnan().all()
    assert torch.equal(ours["k_cache"], before[0]) and torch.equal(ours["v_cache"], before[1])


def _resolved(kwargs):
    """The resolved arguments of a public call with these keyword arguments (no value checks)."""
    bound = inspect.signature(flashattn_ext.flash_attn_with_kvcache).bind(**kwargs)
    bound.apply_defaults()
    bound.arguments.pop("return_softmax_lse")
    return _resolve(**bound.arguments)


# ---- CUDA graphs ----

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or not flashattn_ext.has_cuda_kernels(),
                                reason="needs CUDA")


@needs_cuda
@pytest.mark.parametrize("case", ["everything_paged", "batch_idx_rotary"])
def test_no_host_sync(case):
    """No call waits for the device (torch's sync debug mode turns a synchronisation into an error)."""
    ours, _ = make_case("cuda", torch.float16, **CASES[case])
    flashattn_ext.flash_attn_with_kvcache(**ours)  # lazy initialisation may synchronise once
    torch.cuda.set_sync_debug_mode("error")
    try:
        flashattn_ext.flash_attn_with_kvcache(**ours, return_softmax_lse=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@needs_cuda
def test_cuda_graph_capture_and_replay():
    """Captured once, replayed with new q, k, v and cache_seqlens: equal to eager calls."""
    static, _ = make_case("cuda", torch.bfloat16, paged=True, rotary=True, leftpad=True, causal=True, len_q=2,
                          len_new=2, seqlens=(5, 20, 40))
    eager_caches = (static["k_cache"].clone(), static["v_cache"].clone())
    flashattn_ext.flash_attn_with_kvcache(**static)  # warm-up outside the graph (lazy initialisation)
    static["k_cache"].copy_(eager_caches[0])
    static["v_cache"].copy_(eager_caches[1])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out, static_lse = flashattn_ext.flash_attn_with_kvcache(**static, return_softmax_lse=True)
    eager = dict(static, k_cache=eager_caches[0], v_cache=eager_caches[1])
    for step, seqlens in enumerate(([5, 20, 40], [7, 22, 42], [9, 3, 44])):
        for name in ("q", "k", "v"):
            static[name].copy_(torch.randn_like(static[name]))
        static["cache_seqlens"].copy_(torch.tensor(seqlens, dtype=torch.int32))
        graph.replay()
        eager = dict(eager, q=static["q"].clone(), k=static["k"].clone(), v=static["v"].clone(),
                     cache_seqlens=static["cache_seqlens"].clone())
        out, lse = flashattn_ext.flash_attn_with_kvcache(**eager, return_softmax_lse=True)
        torch.cuda.synchronize()
        assert torch.equal(static_out, out) and torch.equal(static_lse, lse), f"step {step}"
        assert torch.equal(static["k_cache"], eager["k_cache"]) and torch.equal(static["v_cache"], eager["v_cache"])


def test_strided_cache_seqlens(device):
    """cache_seqlens may be a strided view (a slice of a larger lengths tensor), on every path."""
    for len_new in (0, 1):
        ours, _ = make_case(device, torch.float32, len_new=len_new)
        ours = {n: t.to(device) if isinstance(t, torch.Tensor) else t for n, t in ours.items()}
        lengths = ours["cache_seqlens"]
        strided = torch.stack((lengths, lengths), 1)[:, 0]
        assert not strided.is_contiguous()
        want = flashattn_ext.flash_attn_with_kvcache(**{**ours, "k_cache": ours["k_cache"].clone(),
                                                        "v_cache": ours["v_cache"].clone()})
        got = flashattn_ext.flash_attn_with_kvcache(**{**ours, "cache_seqlens": strided})
        assert torch.equal(got, want)


def _poison_past_lengths(cache, seqlens, block_table=None, page=None):
    """NaN in every key row of `cache` past its sequence's length (through the block table where paged)."""
    for b, length in enumerate(seqlens):
        if block_table is None:
            cache[b, length:] = float("nan")
            continue
        for i, block in enumerate(block_table[b].tolist()):
            cache[block, max(length - i * page, 0):] = float("nan")


def _assert_sequence_matches(b, out, lse, **args):
    """Sequence b's out and lse rows of a bf16 step against the float64 reference of kvcache_ref's arguments for
    that sequence alone (a float64 copy of a whole large cache is GiBs), within the accuracy rule."""
    expected = kvcache_ref(**{n: t.double() if isinstance(t, torch.Tensor) else t for n, t in args.items()})
    same = kvcache_ref(**args)
    rows = slice(b, b + 1)
    for name, g, r, s in zip(("out", "lse"), (out[rows], lse[rows]), expected, same):
        assert_accurate(f"{name} of sequence {b}", g.cpu(), r.cpu(), s.cpu(),
                        REL_ATOL[lse_dtype(torch.bfloat16) if name == "lse" else torch.bfloat16])


def _cuda_caches(batch, heads_kv, dim, cache, page):
    """bf16 K and V caches on the GPU of `cache` keys a sequence, dense or (page) in pages of `page` keys in
    shuffled blocks: (their block table, or None, and the caches)."""
    make = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
    if not page:
        return None, (make(batch, cache, heads_kv, dim), make(batch, cache, heads_kv, dim))
    pages = cache // page
    table = torch.randperm(batch * pages, device="cuda").view(batch, pages).to(torch.int32)
    return table, (make(batch * pages, page, heads_kv, dim), make(batch * pages, page, heads_kv, dim))


def _check_cuda_step(batch, heads, heads_kv, dim, cache, seqlens, page=None):
    """One bf16 decode step (dense, or paged with pages of `page` keys in shuffled blocks) against the float64
    reference on the GPU, one sequence at a time (a float64 copy of a whole large cache is GiBs). The cache
    rows past each sequence's length are NaN in the call's caches (the reference reads clean copies): keys
    past the lengths must not reach the output, whatever the tiles that hold them are filled with."""
    q = torch.randn(batch, 1, heads, dim, device="cuda", dtype=torch.bfloat16)
    ours = dict(q=q, cache_seqlens=torch.tensor(seqlens, dtype=torch.int32, device="cuda"))
    table, clean = _cuda_caches(batch, heads_kv, dim, cache, page)
    pages = cache // page if page else None
    if page:
        ours["block_table"] = table
    ours["k_cache"], ours["v_cache"] = (c.clone() for c in clean)
    for c in (ours["k_cache"], ours["v_cache"]):
        _poison_past_lengths(c, seqlens, ours.get("block_table"), page)
    out, lse = flashattn_ext.flash_attn_with_kvcache(**ours, return_softmax_lse=True)
    for b in range(batch):
        rows = slice(b, b + 1)
        own = ours["block_table"][b].long() if page else rows  # (paged: the sequence's pages, in its order)
        _assert_sequence_matches(b, out, lse, q=ours["q"][rows], k_cache=clean[0][own], v_cache=clean[1][own],
                                 seqlens=seqlens[rows], block_table=[list(range(pages))] if page else None)


@needs_cuda
@pytest.mark.parametrize("paged", [False, True])
def test_cuda_decode_warp_pairs(paged):
    """An MQA decode step large enough for the decode kernel's 32-row chunks (its warps in pairs): 56 query
    heads in chunks of 32 and 24 rows, 10 sequences of up to 32k keys (10 x 4 walks of 16 rows x 512 tiles is
    over 96 tiles per SM on GPUs of up to 213 SMs), ragged lengths, a sequence shorter than one part."""
    seqlens = [32768, 3, 20000, 32767, 777, 32768, 12345, 1, 32768, 30000]
    _check_cuda_step(10, 56, 1, 128, 32768, seqlens, page=256 if paged else None)


@needs_cuda
@pytest.mark.parametrize("paged", [False, True])
def test_cuda_decode_combine_of_many_parts(paged):
    """MQA steps whose walks are cut into many parts, added by the combine kernel (its 8 warps taking several
    parts each), on a 132-SM GPU: one sequence of 32 query heads (two 16-row walks of 400 tiles in 100 parts),
    three of 64 query heads at dim 64 (twelve walks of 33 parts; ragged lengths, one shorter than a part, whose
    later parts see no key), and one of 32 query heads over 8k keys (two walks of 32 parts)."""
    _check_cuda_step(1, 32, 1, 128, 25600, [25600], page=256 if paged else None)
    _check_cuda_step(3, 64, 1, 64, 32768, [32768, 20001, 70], page=64 if paged else None)
    _check_cuda_step(1, 32, 1, 128, 8192, [8192], page=256 if paged else None)


@needs_cuda
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("page", [None, 64])
def test_cuda_decode_combine_of_few_parts(dim, page):
    """GQA steps whose walks are cut into few parts, on a 132-SM GPU: 20 sequences of 3 kv heads (groups of 3 rows:
    180 rows) over 133 tiles, in 4 parts at dim 128 (the combine kernel a warp a row, its last block half-filled)
    and 6 at dim 64 (a block a row), ragged lengths down to a sequence shorter than one part."""
    seqlens = [133 * 64, 8000, 1, 5000, 133 * 64 - 1, 64, 4097, 300, 8191, 2048,
               7777, 129, 6000, 133 * 64, 4000, 65, 8500, 3333, 1000, 8400]
    _check_cuda_step(20, 9, 3, dim, 133 * 64, seqlens, page=page)


@needs_cuda
@pytest.mark.parametrize("dim", [96, 128])
@pytest.mark.parametrize("page", [None, 256, 80])
def test_cuda_decode_deep_ring(dim, page):
    """Steps that run one block an SM with the decode kernel's deep ring of K / V buffers on sm_90 (a 132-SM GPU),
    dense, on whole-tile pages and on row-copied pages: 33 GQA walks (groups of 3) in 4 parts of 25 tiles added by
    the combine kernel, ragged down to a sequence of one key (parts without keys); 128 MHA walks of 40 tiles run
    whole, ragged."""
    _check_cuda_step(3, 33, 11, dim, 6400, [6400, 3001, 1], page=page)
    _check_cuda_step(4, 32, 32, dim, 2560, [2560, 2559, 1000, 65], page=page)


@needs_cuda
@pytest.mark.parametrize("dim", [64, 128, 192, 256])
@pytest.mark.parametrize("page", [None, 256, 32])
def test_cuda_short_steps(dim, page):
    """Short steps, dense, on whole-tile pages and on row-copied pages, each checked against float64, on a
    132-SM GPU: on sm_90 as thread block clusters (a cluster a walk, at most one block per SM in all) 32 MHA
    walks of 1k keys, one sequence far shorter than its cache (parts without keys), and 64 GQA walks of 2k (where
    only clusters of 2 fit), ragged; on the combine kernel GQA's 4-row walks over a ragged 2k (parts of 2 tiles)
    and MQA's 32 rows (16-row walks) over 4096 keys."""
    _check_cuda_step(2, 16, 16, dim, 1024, [1024, 77], page=page)
    _check_cuda_step(8, 32, 8, dim, 2048, [2048, 1999, 1, 64, 1500, 2048, 700, 2047], page=page)
    _check_cuda_step(1, 32, 8, dim, 2048, [1999], page=page)
    _check_cuda_step(1, 32, 1, dim, 4096, [4096], page=page)


@needs_cuda
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("page", [None, 64])
def test_cuda_decode_parts_of_uneven_tiles(dim, page):
    """GQA steps (walks of 4 rows) whose parts hold uneven counts of key tiles, odd ones among them: 133 tiles
    over the parts of a workspace merge (4 or 5 tiles a part on a 132-SM GPU), the last sequence's last tile
    partial; 13 tiles over a cluster's parts (2 or 3 tiles a part), the sequence ending inside a tile."""
    _check_cuda_step(2, 32, 8, dim, 133 * 64, [133 * 64 - 40, 133 * 64], page=page)
    _check_cuda_step(1, 32, 8, dim, 13 * 64, [13 * 64 - 31], page=page)


@needs_cuda
@pytest.mark.parametrize("dim", [40, 80, 120, 176, 200])
@pytest.mark.parametrize("page", [None, 64])
def test_cuda_decode_head_dims_below_their_tier(dim, page):
    """Steps at head dims below their kernel tier's (40 of 64, 80 of 96, 120 of 128, 176 of 192, 200 of 256): the
    columns of a K / V tile past the head dim are never copied from the cache and must read as zeros. GQA walks of 4
    rows on a cluster's parts (13 tiles, the sequence ending inside one) and on the workspace merge (133 tiles,
    ragged)."""
    _check_cuda_step(1, 32, 8, dim, 13 * 64, [13 * 64 - 31], page=page)
    _check_cuda_step(2, 32, 8, dim, 133 * 64, [133 * 64 - 40, 5000], page=page)


@needs_cuda
def test_cuda_paged_whole_walks_of_small_pages():
    """A paged step whose walks are not cut into parts (8 x 64 walks fill GPUs of up to 170 SMs), each over up to
    1024 pages of 16 keys in shuffled blocks, ragged lengths down to one page."""
    seqlens = [16384, 9000, 8192, 100, 16383, 4097, 12000, 16]
    _check_cuda_step(8, 64, 64, 64, 16384, seqlens, page=16)


@needs_cuda
@pytest.mark.parametrize("page", [None, 256])
@pytest.mark.parametrize("heads_kv,cache", [(1, 8192), (8, 2048)], ids=["mqa_8k", "gqa_2k"])
def test_cuda_steps_appending_beside_an_invalid_sequence(page, heads_kv, cache):
    """bf16 steps appending one row per sequence, whose decode kernel plans its parts and issues its first tiles
    before it waits for the append (from the lengths the append reads; a tile that holds the new row only after
    the wait): MQA over 8k keys and GQA over 2k (walks in parts of 4 and of 2 tiles, added by the combine
    kernel), dense and on pages of 256. Sequence 1's cache is full (no room for the new row): its rows are NaN and its cache is left as it was.
    Sequence 0's new row is its second tile's (the part that holds it waits first), sequence 2's the cache's last;
    both match the float64 reference."""
    batch, heads, dim, seqlens = 3, 32, 128, [100, cache, cache - 1]
    make = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
    q, k, v = make(batch, 1, heads, dim), make(batch, 1, heads_kv, dim), make(batch, 1, heads_kv, dim)
    call = dict(cache_seqlens=torch.tensor(seqlens, dtype=torch.int32, device="cuda"))
    table, clean = _cuda_caches(batch, heads_kv, dim, cache, page)
    pages = cache // page if page else None
    if page:
        call["block_table"] = table
    k_cache, v_cache = (c.clone() for c in clean)
    out, lse = flashattn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v, **call, return_softmax_lse=True)
    own = [call["block_table"][b].long() if page else slice(b, b + 1) for b in range(batch)]
    assert out[1].isnan().all() and lse[1].isnan().all()
    assert torch.equal(k_cache[own[1]], clean[0][own[1]]) and torch.equal(v_cache[own[1]], clean[1][own[1]])
    for b in (0, 2):
        rows = slice(b, b + 1)
        _assert_sequence_matches(b, out, lse, q=q[rows], k_cache=clean[0][own[b]], v_cache=clean[1][own[b]],
                                 k=k[rows], v=v[rows], seqlens=seqlens[rows],
                                 block_table=[list(range(pages))] if page else None)


@needs_cuda
@pytest.mark.parametrize("page", [256, 16])
@pytest.mark.parametrize("heads_kv,cache", [(1, 8192), (8, 2048)], ids=["mqa_8k", "gqa_2k"])
def test_cuda_read_only_paged_steps_check_their_pages(page, heads_kv, cache):
    """Read-only bf16 steps on pages, which the decode kernel serves with no append before it: it applies the
    append's rules itself (FwdParams::check_pages), on pages of 256 keys (a tile's block looked up once) and of 16
    (looked up row by row, as every step with left padding is), its walks' parts added by the combine kernel
    (MQA 8k, GQA 2k). A sequence gets NaN rows where its table names a block outside the cache for a
    page that holds its keys (its last page; the page of its first key after left padding), where its left padding
    is past its length, or its length past the cache. -1 on the pages past a sequence's keys or before its left
    padding is allowed: those sequences match the float64 reference, as the others do."""
    batch, heads, dim = 4, 32, 128
    pages = cache // page
    table, (k_cache, v_cache) = _cuda_caches(batch, heads_kv, dim, cache, page)
    q = torch.randn(batch, 1, heads, dim, device="cuda", dtype=torch.bfloat16)

    def check(seqlens, table, nan, leftpad=None):
        call = dict(cache_seqlens=torch.tensor(seqlens, dtype=torch.int32, device="cuda"), block_table=table)
        if leftpad is not None:
            call["cache_leftpad"] = torch.tensor(leftpad, dtype=torch.int32, device="cuda")
        plan = flashattn_ext.kernel_plan(q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2),
                                         block_table=table, seqused_k=call["cache_seqlens"],
                                         leftpad_k=call.get("cache_leftpad"))
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            out, lse = flashattn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, **call, return_softmax_lse=True)
            torch.cuda.synchronize()
        kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        decode = plan.startswith("sm80_decode")  # (FLASHATTN_CUDA_KERNELS=simt: the append, then SIMT on a copy)
        assert any("fwd_decode_kernel" in k for k in kernels) == decode, kernels
        assert any("append_kernel" in k for k in kernels) != decode, kernels
        for b in range(batch):
            if b in nan:
                assert out[b].isnan().all() and lse[b].isnan().all(), f"sequence {b}"
                continue
            rows, own = slice(b, b + 1), table[b].long()  # (a -1 reads the last block: keys no row sees)
            _assert_sequence_matches(b, out, lse, q=q[rows], k_cache=k_cache[own], v_cache=v_cache[own],
                                     seqlens=seqlens[rows], leftpad=None if leftpad is None else leftpad[rows],
                                     block_table=[list(range(pages))])

    # From each cache's first key: 1 names a block past the cache on its last page, 2 ends on a page's end with
    # -1 after it, 3's length is past the cache.
    seqlens = [cache, cache // 2 - 24, cache // 4, cache + 1]
    bad = table.clone()
    bad[1, (seqlens[1] - 1) // page] = batch * pages
    bad[2, seqlens[2] // page:] = -1
    check(seqlens, bad, nan={1, 3})
    # Left padded: 0 with -1 on its pages before the padding, 1 with -1 on the page of its first key, 2 padded
    # past its length, 3 unpadded with -1 past its keys.
    seqlens, leftpad = [cache, cache // 2 - 24, cache // 4 + 188, cache - 548], [page + 40, cache // 8 + 44, 0, 0]
    leftpad[2] = seqlens[2] + 1
    bad = table.clone()
    bad[0, :leftpad[0] // page] = -1
    bad[1, leftpad[1] // page] = -1
    bad[3, (seqlens[3] + page - 1) // page:] = -1
    check(seqlens, bad, nan={1, 2}, leftpad=leftpad)


@needs_cuda
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("paged", [False, True])
def test_cuda_rotary_steps_over_long_caches(interleaved, paged):
    """bf16 rotary steps appending one row over caches of up to 4096 keys, dense and on pages of 256: the append
    rotates q and the new key, and the decode kernel (a dependent launch) issues its first K / V tiles while the
    append runs and reads the rotated q and the new key only after it. Checked against float64: out, LSE and both
    caches."""
    run_and_check(*make_case("cuda", torch.bfloat16, rotary=True, interleaved=interleaved, causal=True, cache=4096,
                             seqlens=(3000, 1000, None), paged=paged, page=256))


@needs_cuda
@pytest.mark.parametrize("len_new", [1, 3])
@pytest.mark.parametrize("page", [None, 256, 16])
@pytest.mark.parametrize("heads_kv,cache", [(1, 8192), (8, 2048)], ids=["mqa_8k", "gqa_2k"])
def test_cuda_appending_steps_append_in_the_decode_kernel(heads_kv, cache, page, len_new):
    """bf16 steps appending rows without rotary tables, which the decode kernel appends itself (no append launch):
    each part that holds new keys writes them into the caches before it copies its tiles, once the sequence's rules
    hold. Sequence 0's new rows straddle a tile (and a part) boundary; 1 names a block past the cache on its first
    page (paged) or is valid (dense); 2's cache has no room for its rows. With left padding (pages then looked up
    row by row), 3's padding is past its length before the append though not after it. The valid sequences match
    the float64 reference and their caches hold the new rows; the others get NaN rows and their caches are left as
    they were."""
    batch, heads, dim = 4, 32, 128
    table, clean = _cuda_caches(batch, heads_kv, dim, cache, page)
    pages = cache // page if page else None
    make = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
    q, k, v = make(batch, len_new, heads, dim), make(batch, len_new, heads_kv, dim), make(batch, len_new, heads_kv, dim)

    def rows_of(b, length):  # (cache tensor index) of each of sequence b's first `length` key rows
        if not page:
            return [(b, j) for j in range(length)]
        return [(int(table[b, j // page]), j % page) for j in range(length)]

    def check(seqlens, nan, leftpad=None):
        call = dict(cache_seqlens=torch.tensor(seqlens, dtype=torch.int32, device="cuda"))
        if page:
            call["block_table"] = bad_table
        if leftpad is not None:
            call["cache_leftpad"] = torch.tensor(leftpad, dtype=torch.int32, device="cuda")
        k_cache, v_cache = (c.clone() for c in clean)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            out, lse = flashattn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v, **call,
                                                             return_softmax_lse=True, causal=True)
            torch.cuda.synchronize()
        kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        plan = flashattn_ext.kernel_plan(q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2),
                                         block_table=call.get("block_table"), seqused_k=call["cache_seqlens"],
                                         leftpad_k=call.get("cache_leftpad"))
        decode = plan.startswith("sm80_decode")  # (FLASHATTN_CUDA_KERNELS=simt: the append, then SIMT)
        assert any("append_kernel" in name for name in kernels) != decode, kernels
        for b in range(batch):
            own = rows_of(b, cache) if not page else [
                (blk, j % page) for j, blk in ((j, int(bad_table[b, j // page])) for j in range(cache))
                if 0 <= blk < batch * pages]
            expect_k, expect_v = clean[0].clone(), clean[1].clone()
            if b not in nan:
                for t, (blk, row) in enumerate(rows_of(b, seqlens[b] + len_new)[seqlens[b]:]):
                    expect_k[blk, row], expect_v[blk, row] = k[b, t], v[b, t]
            index = tuple(torch.tensor(i, device="cuda") for i in zip(*own))
            assert torch.equal(k_cache[index], expect_k[index]) and torch.equal(v_cache[index], expect_v[index]), b
            if b in nan:
                assert out[b].isnan().all() and lse[b].isnan().all(), f"sequence {b}"
                continue
            rows, whole = slice(b, b + 1), table[b].long() if page else slice(b, b + 1)
            _assert_sequence_matches(b, out, lse, q=q[rows], k_cache=clean[0][whole], v_cache=clean[1][whole],
                                     k=k[rows], v=v[rows], seqlens=seqlens[rows], causal=True,
                                     leftpad=None if leftpad is None else leftpad[rows],
                                     block_table=[list(range(pages))] if page else None)

    bad_table = table.clone() if page else None
    if page:
        bad_table[1, 0] = batch * pages
    seqlens = [cache // 2 - 1, cache // 4 + 5, cache - len_new + 1, cache // 8]
    check(seqlens, nan={1, 2} if page else {2})
    leftpad = [64, 0, 0, seqlens[3] + 1]
    check(seqlens, nan={1, 2, 3} if page else {2, 3}, leftpad=leftpad)

"""The common step of flash_attn_with_kvcache as one op call (flashattn::_kvcache_step): on the CPU,
value rules of pages and left padding checked on the host values with the general path's
messages, in its order, before anything is written; pages outside a sequence's keys may name no
block; the op's out has the layout the step returned before (a transpose of fwd's out), also for
strided q and caches."""
import pytest
import torch

import flashattn_ext
from flashattn_ext import _kvcache_compose, _kvcache_values, kvcache

BATCH, HEADS, HEADS_KV, DIM, PAGE, PAGES = 3, 2, 1, 8, 16, 3


def _i32(values):
    return torch.tensor(values, dtype=torch.int32)


def _call(lengths, table=None, leftpad=None, len_new=1, rotary=False):
    """A step on the CPU: paged where a table is given (3 pages of 16 keys per sequence), else dense."""
    gen = torch.Generator().manual_seed(0)
    make = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    rows = BATCH * PAGES + 1 if table is not None else BATCH
    keys = PAGE if table is not None else PAGE * PAGES
    call = dict(q=make(BATCH, 1, HEADS, DIM), k_cache=make(rows, keys, HEADS_KV, DIM),
                v_cache=make(rows, keys, HEADS_KV, DIM), causal=True,
                cache_seqlens=lengths if type(lengths) is int else _i32(lengths))
    if table is not None:
        call["block_table"] = _i32(table)
    if leftpad is not None:
        call["cache_leftpad"] = _i32(leftpad)
    if len_new:
        call["k"], call["v"] = make(BATCH, len_new, HEADS_KV, DIM), make(BATCH, len_new, HEADS_KV, DIM)
    if rotary:
        angle = torch.arange(40, dtype=torch.float32)[:, None] / 10000 ** (torch.arange(4) / 4)
        call["rotary_cos"], call["rotary_sin"] = angle.cos(), angle.sin()
    return call


def _general_error(call):
    """The general path's message for `call` (its resolution, then its rules on the values)."""
    args = kvcache._resolve(call["q"], call["k_cache"], call["v_cache"], call.get("k"), call.get("v"),
                            call.get("rotary_cos"), call.get("rotary_sin"), call["cache_seqlens"], None,
                            call.get("cache_leftpad"), call.get("block_table"), None, True, (-1, -1), 0.0, True, None,
                            0)
    with pytest.raises(ValueError) as error:
        _kvcache_values.raise_on_invalid(args)
    return str(error.value)


TABLE = [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
BAD = {
    "leftpad_past_length": dict(lengths=[5, 20, 7], leftpad=[0, 21, 0]),
    "leftpad_negative": dict(lengths=[5, 20, 7], leftpad=[0, 0, -1], table=TABLE),
    "page_past_blocks": dict(lengths=[5, 20, 7], table=[[0, 1, 2], [3, 10, 5], [6, 7, 8]]),
    "page_negative_first": dict(lengths=[5, 20, 7], table=[[0, 1, 2], [3, 4, 5], [-1, 7, 8]]),
    "page_of_the_new_key": dict(lengths=[5, 32, 7], table=[[0, 1, 2], [3, 4, -1], [6, 7, 8]]),
    "leftpad_before_page": dict(lengths=[5, 20, 7], leftpad=[0, 2, 8], table=[[-1, 1, 2], [3, 4, 5], [6, 7, 8]],
                                len_new=0),
    "page_after_leftpad": dict(lengths=[20, 20, 7], leftpad=[17, 0, 0], table=[[-1, -1, 2], [3, 4, 5], [6, 7, 8]]),
    "int_lengths_page": dict(lengths=20, table=[[0, 1, 2], [3, -1, 5], [6, 7, 8]]),
    "length_before_page": dict(lengths=[5, 48, 7], table=[[0, 1, 2], [3, -4, 5], [6, 7, 8]]),
    "page_then_rotary": dict(lengths=[5, 39, 7], table=[[0, 1, 2], [3, 4, 5], [90, 7, 8]], rotary=True),
    "rotary": dict(lengths=[5, 40, 7], leftpad=[0, 0, 0], rotary=True),
}
# Pages that hold none of a sequence's keys (past its end, before its left padding, all of them
# when it has none) may name no block.
VALID = {
    "pages_past_the_end": dict(lengths=[5, 20, 7], table=[[0, -1, -1], [3, 4, 99], [6, -1, 9]]),
    "pages_before_leftpad": dict(lengths=[5, 40, 20], leftpad=[0, 33, 16], table=[[0, 1, 2], [-1, -1, 5], [-1, 7, 8]]),
    "no_keys": dict(lengths=[5, 20, 7], leftpad=[0, 20, 0], table=[[0, 1, 2], [-1, -1, -1], [6, 7, 8]], len_new=0),
}


@pytest.mark.parametrize("case", list(BAD))
def test_cpu_value_errors_are_the_general_paths(case, monkeypatch):
    call = _call(**BAD[case])
    message = _general_error(call)
    before = (call["k_cache"].clone(), call["v_cache"].clone())
    resolve = kvcache._resolve
    monkeypatch.setattr(kvcache, "_resolve", lambda *a: pytest.fail("the common step went to the general path"))
    with pytest.raises(ValueError) as error:
        flashattn_ext.flash_attn_with_kvcache(**call)
    monkeypatch.setattr(kvcache, "_resolve", resolve)
    assert str(error.value) == message
    assert torch.equal(call["k_cache"], before[0]) and torch.equal(call["v_cache"], before[1])


@pytest.mark.parametrize("case", list(VALID))
def test_cpu_unused_pages_name_no_block(case):
    """The common step equals the general path (out, lse and caches bit for bit)."""
    call = _call(**VALID[case])
    general = dict(call, k_cache=call["k_cache"].clone(), v_cache=call["v_cache"].clone())
    args = kvcache._resolve(general["q"], general["k_cache"], general["v_cache"], general.get("k"), general.get("v"),
                            None, None, general["cache_seqlens"], None, general.get("cache_leftpad"),
                            general["block_table"], None, True, (-1, -1), 0.0, True, None, 0)
    _kvcache_values.raise_on_invalid(args)
    want_out, want_lse = _kvcache_compose.forward(args)
    out, lse = flashattn_ext.flash_attn_with_kvcache(**call, return_softmax_lse=True)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    assert torch.equal(call["k_cache"], general["k_cache"]) and torch.equal(call["v_cache"], general["v_cache"])


@pytest.mark.parametrize("q_layout", ["strided", "heads_outer"])
@pytest.mark.parametrize("rotary", [False, True], ids=["plain", "rotary"])
def test_step_layouts(device, rotary, q_layout):
    """Strided q (with gaps, or dense with heads outside rows), caches and new rows (last
    dimension contiguous): the op's out has the sizes and strides of the step as two op calls
    (fwd's out transposed, the rotated q laid out by torch.empty_like), and its values."""
    make = lambda *shape: torch.randn(*shape, device=device, dtype=torch.float32)  # noqa: E731
    q = make(2, 3, 2 * HEADS, 2 * DIM)[:, :, ::2, :DIM] if q_layout == "strided" else \
        make(2, HEADS, 3, DIM).transpose(1, 2)
    k_cache, v_cache = make(2, 40, HEADS_KV, 3 * DIM)[..., :DIM], make(2, 40, HEADS_KV, 3 * DIM)[..., DIM:2 * DIM]
    k, v = make(2, 3, HEADS_KV, 2 * DIM)[..., DIM:], make(2, 3, HEADS_KV, DIM)
    seqlens = torch.tensor([4, 30], dtype=torch.int32, device=device)
    tables = {}
    if rotary:
        angle = torch.arange(40, dtype=torch.float32, device=device)[:, None] / 10000 ** (
            torch.arange(3, device=device) / 3)
        tables = dict(rotary_cos=angle.cos(), rotary_sin=angle.sin())
    caches = (k_cache.clone(), v_cache.clone())
    out, lse = flashattn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, causal=True,
                                                     return_softmax_lse=True, **tables)
    args = kvcache._resolve(q, *caches, k, v, tables.get("rotary_cos"), tables.get("rotary_sin"), seqlens, None, None,
                            None, None, True, (-1, -1), 0.0, True, None, 0)
    want_out, want_lse = _kvcache_compose.forward(args)
    assert out.shape == want_out.shape and out.stride() == want_out.stride() and lse.stride() == want_lse.stride()
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    assert torch.equal(k_cache, caches[0]) and torch.equal(v_cache, caches[1])


def test_flag_truth_values(device):
    """causal may be any truth value (1, 0), as in the general path; rotary_interleaved without
    tables is not read."""
    q, k_cache, v_cache = (torch.randn(2, 1, 2, 8, device=device) if i == 0 else torch.randn(2, 20, 1, 8, device=device)
                           for i in range(3))
    seqlens = torch.tensor([3, 19], dtype=torch.int32, device=device)
    for causal in (1, 0):
        out = flashattn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=causal,
                                                    rotary_interleaved=0)
        want = flashattn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=bool(causal))
        assert torch.equal(out, want)

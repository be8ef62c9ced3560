"""The rotary embedding inside flashattn::kvcache_append: the new key rows written rotated into the
cache and q's rows written rotated into q_rotated, in the one op call of the append, equal bit for
bit to torch's elementwise composition in float32 (float64 for float64 inputs) rounded once
(kvcache_reference.rotate_rounded_once): every dtype, interleaved pairs and halves, rotary_dim
below and equal to head_dim, tables in the dtype or in float32, dense / cache-row / paged caches
with left padding, query rows consecutive or all at the length, no new rows. A sequence that
needs a position past the tables writes nothing, gets seqused -1 and q's rows unrotated. Then the
op's argument errors, and opcheck."""
import pytest
import torch

from flashattn_ext.ops import kvcache_append
from kvcache_reference import rotate_rounded_once

BATCH, HEADS, HEADS_KV, DIM, DIM_V, CACHE, PAGE, POSITIONS = 3, 4, 2, 16, 8, 48, 16, 40
DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Sequence 1 needs a position past the 40 rows of the tables when it uses 3 (38 + 3 > 40).
LAYOUTS = {
    "dense_consecutive": dict(half=DIM // 2, len_new=2, len_q=3, consecutive=True, seqlens=[5, 38, 30]),
    "rows_at_length": dict(half=3, len_new=1, len_q=2, consecutive=False, seqlens=[0, 38, 39], batch_idx=[4, 0, 2]),
    "paged_leftpad": dict(half=5, len_new=3, len_q=1, consecutive=True, seqlens=[14, 38, 20], paged=True,
                          leftpad=[2, 3, 16]),
    "no_new_rows": dict(half=DIM // 4, len_new=0, len_q=3, consecutive=True, seqlens=[7, 38, 37]),
}


def _i32(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


def _tables(half, dtype):
    angle = torch.arange(POSITIONS, dtype=torch.float64)[:, None] / 10000 ** (torch.arange(half) / half)
    return angle.cos().to(dtype), angle.sin().to(dtype)


def _case(device, dtype, table_dtype, interleaved, half, len_new, len_q, consecutive, seqlens, batch_idx=None,
          paged=False, leftpad=None):
    make = lambda *shape: torch.randn(*shape).to(dtype)  # noqa: E731
    cos, sin = _tables(half, table_dtype)
    args = dict(k=make(BATCH, len_new, HEADS_KV, DIM), v=make(BATCH, len_new, HEADS_KV, DIM_V),
                seqlens=_i32(seqlens, "cpu"), rotary_cos=cos, rotary_sin=sin, rotary_interleaved=interleaved,
                q=make(BATCH, len_q, HEADS, DIM), q_rows_consecutive=consecutive)
    if paged:
        pages = CACHE // PAGE
        args["block_table"] = torch.randperm(BATCH * pages).view(BATCH, pages).to(torch.int32)
        shape = (BATCH * pages, PAGE, HEADS_KV)
    else:
        shape = (5 if batch_idx else BATCH, CACHE, HEADS_KV)
    if batch_idx:
        args["batch_idx"] = _i32(batch_idx, "cpu")
    if leftpad:
        args["leftpad"] = _i32(leftpad, "cpu")
    args["k_cache"], args["v_cache"] = make(*shape, DIM), make(*shape, DIM_V)
    args["q_rotated"] = torch.full_like(args["q"], float("nan"))
    return {n: t.to(device) if isinstance(t, torch.Tensor) else t for n, t in args.items()}


def _expected(a):
    """The caches, q_rotated and seqused after the op, from CPU copies of its arguments."""
    a = {n: t.cpu().clone() if isinstance(t, torch.Tensor) else t for n, t in a.items()}
    len_new, len_q = a["k"].shape[1], a["q"].shape[1]
    span = max(len_new, len_q if a["q_rows_consecutive"] else 1)
    seqused, q_rotated = [], a["q"].clone()
    for b, s in enumerate(a["seqlens"].tolist()):
        if s + span > a["rotary_cos"].shape[0]:
            seqused.append(-1)
            continue
        seqused.append(s + len_new)
        rows = torch.arange(len_q) if a["q_rows_consecutive"] else torch.zeros(len_q, dtype=torch.long)
        q_rotated[b] = rotate_rounded_once(a["q"][b], a["rotary_cos"], a["rotary_sin"], s + rows,
                                           a["rotary_interleaved"])
        k = rotate_rounded_once(a["k"][b], a["rotary_cos"], a["rotary_sin"], s + torch.arange(len_new),
                                a["rotary_interleaved"])
        for t in range(len_new):
            key = s + t
            if "block_table" in a:
                slot = (int(a["block_table"][b, key // PAGE]), key % PAGE)
            else:
                slot = (int(a["batch_idx"][b]) if "batch_idx" in a else b, key)
            a["k_cache"][slot], a["v_cache"][slot] = k[t], a["v"][b, t]
    return a["k_cache"], a["v_cache"], q_rotated, seqused


@pytest.mark.parametrize("table", ["same", "fp32"])
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "halves"])
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_rotary_append_bits(device, layout, dtype, interleaved, table):
    args = _case(device, dtype, dtype if table == "same" else torch.float32, interleaved, **LAYOUTS[layout])
    want_k, want_v, want_q, want_used = _expected(args)
    used = kvcache_append(**args)
    assert used.tolist() == want_used
    assert torch.equal(args["q_rotated"].cpu(), want_q)
    assert torch.equal(args["k_cache"].cpu(), want_k) and torch.equal(args["v_cache"].cpu(), want_v)


def test_rotary_without_query(device):
    """Tables without q: only the new keys are rotated (their positions alone checked)."""
    args = _case(device, torch.float32, torch.float32, True, **LAYOUTS["dense_consecutive"])
    want_k, want_v, _, _ = _expected(dict(args, q=args["q"][:, :1], q_rows_consecutive=False))
    del args["q"], args["q_rotated"]
    used = kvcache_append(**args)
    assert used.tolist() == [7, 40, 32]  # 38 + 2 new keys fit the 40 positions
    assert torch.equal(args["k_cache"].cpu(), want_k) and torch.equal(args["v_cache"].cpu(), want_v)


def test_strided_query_and_tables(device):
    """q, q_rotated and the tables may be strided views (last dimension contiguous)."""
    args = _case(device, torch.bfloat16, torch.float32, False, **LAYOUTS["dense_consecutive"])
    for name in ("q", "rotary_cos", "rotary_sin"):
        wide = torch.cat((args[name], args[name]), dim=-1)
        args[name] = wide[..., :args[name].shape[-1]]
        assert not args[name].is_contiguous()
    args["q_rotated"] = torch.empty(BATCH, HEADS, args["q"].shape[1], DIM, dtype=torch.bfloat16,
                                    device=device).transpose(1, 2)
    want_k, _, want_q, want_used = _expected(args)
    assert kvcache_append(**args).tolist() == want_used
    assert torch.equal(args["q_rotated"].cpu(), want_q) and torch.equal(args["k_cache"].cpu(), want_k)


BAD = [
    (dict(rotary_sin=None), r"arguments 'rotary_cos' and 'rotary_sin' must be given together"),
    (dict(q_rotated=None), r"arguments 'q' and 'q_rotated' must be given together"),
    (dict(rotary_cos=None, rotary_sin=None), r"argument 'q' needs 'rotary_cos' and 'rotary_sin'"),
    (dict(rotary_cos=torch.ones(POSITIONS, 9), rotary_sin=torch.ones(POSITIONS, 9)),
     r"rotary_dim = 2 \* 9 between 2 and head_dim = 16, got shape \[40, 9\]"),
    (dict(rotary_cos=torch.ones(0, 4), rotary_sin=torch.ones(0, 4)), r"must hold at least one position"),
    (dict(rotary_sin=torch.ones(POSITIONS + 1, 8)), r"argument 'rotary_sin' has shape \[41, 8\] and dtype float32 but "
                                                    r"'rotary_cos' has \[40, 8\] and float32; they must match"),
    (dict(rotary_cos=torch.ones(POSITIONS, 8, dtype=torch.float64), rotary_sin=torch.ones(POSITIONS, 8,
                                                                                          dtype=torch.float64)),
     r"argument 'rotary_cos' has dtype float64; it must be k_cache's \(float32\) or float32"),
    (dict(rotary_cos=torch.ones(POSITIONS, 16)[:, ::2], rotary_sin=torch.ones(POSITIONS, 16)[:, ::2]),
     r"argument 'rotary_cos' must have 2 dimensions \(positions, rotary_dim / 2\) with a contiguous last one"),
    (dict(q=torch.ones(BATCH, 3, HEADS, DIM, dtype=torch.float64)),
     r"argument 'q' has dtype float64 but 'k_cache' has dtype float32; they must match"),
    (dict(q=torch.ones(BATCH, 3, HEADS, DIM + 2)), r"argument 'q' has head_dim \(must equal k_cache's\) 18"),
    (dict(q_rotated=torch.ones(BATCH, 2, HEADS, DIM)),
     r"argument 'q_rotated' has number of rows \(must equal q's\) 2 \(shape \[3, 2, 4, 16\]\) but 3 was expected"),
    (dict(q_rotated=torch.ones(BATCH - 1, 3, HEADS, DIM)), r"argument 'q_rotated' has batch size \(must equal k's\) 2"),
]


@pytest.mark.parametrize("change,match", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_arguments(change, match):
    args = dict(_case("cpu", torch.float32, torch.float32, True, **LAYOUTS["dense_consecutive"]), **change)
    before = args["k_cache"].clone()
    with pytest.raises(RuntimeError, match=match):
        kvcache_append(**args)
    assert torch.equal(args["k_cache"], before)


def test_opcheck(device):
    args = _case(device, torch.float32, torch.float32, False, **LAYOUTS["paged_leftpad"])
    names = ("k_cache", "v_cache", "k", "v", "seqlens", "batch_idx", "block_table", "leftpad", "rotary_cos",
             "rotary_sin", "rotary_interleaved", "q", "q_rotated", "q_rows_consecutive")
    torch.library.opcheck(torch.ops.flashattn.kvcache_append, tuple(args.get(n) for n in names))

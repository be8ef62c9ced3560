"""flashattn::fwd with per-sequence key ranges (seqused_k, leftpad_k) of a padded batch, and
with paged k / v (block_table): each sequence b attends to rows leftpad_k[b] <= j < seqused_k[b]
of its keys, with causal, window and ALiBi aligned against its own length. Compared, sequence by
sequence, with the float64 feature reference on exactly those keys (DESIGN §4): lengths 0, 1,
ragged and full, left padding, GQA / MQA, 1..16 query rows, pages of 16, 48, 64 and 256 keys,
every dtype. Plus argument errors, the refusal of the backward, opcheck, values out of range (NaN
rows on every device), and, on CUDA, block numbers out of range (never read on the host: clamped
by the kernels)."""
import pytest
import torch

from feature_reference import attention_ref
from flashattn_ext._measure import REL_ATOL
from flashattn_ext.functional import checked_fwd
from reference import BOTTOM_RIGHT, NONE, TOP_LEFT, assert_accurate, lse_dtype

op = torch.ops.flashattn.fwd
DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
LEN_K = 80  # rows of k / v: the longest possible sequence


def _make(device, dtype, batch, heads_q, heads_kv, len_q, dim=32, len_k=LEN_K):
    make = lambda *shape: torch.randn(*shape, dtype=torch.float32).to(dtype).to(device)  # noqa: E731
    # The flash-attn layout (batch, len, heads, dim) viewed as (batch, heads, len, dim), as callers pass it.
    return (make(batch, len_q, heads_q, dim).transpose(1, 2), make(batch, len_k, heads_kv, dim).transpose(1, 2),
            make(batch, len_k, heads_kv, dim).transpose(1, 2))


def _reference(q, k, v, used, pad, scale, causal, window, alibi, softcap):
    """(out, lse) in q's dtype, sequence by sequence on its keys only."""
    outs, lses = [], []
    for b, (end, lo) in enumerate(zip(used, pad)):
        slopes = None if alibi is None else (alibi if alibi.dim() == 1 else alibi[b])
        out, lse = attention_ref(q[b:b + 1], k[b:b + 1, :, lo:end], v[b:b + 1, :, lo:end], scale, causal,
                                 window=window, alibi=slopes, softcap=softcap)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def paged(k, v, page, used, pad):
    """k, v (batch, heads, len_k, dim) cut into pages of `page` keys, in shuffled blocks (two
    spare), as (blocks, heads, page, dim) views of (blocks, page, heads, dim) caches, and the
    block table; pages that hold no key of their sequence name block -1."""
    batch, heads, len_k, dim = k.shape
    pages = len_k // page
    table = torch.randperm(batch * pages + 2)[:batch * pages].view(batch, pages).to(torch.int32)
    caches = []
    for t in (k, v):
        cache = torch.zeros(batch * pages + 2, page, heads, t.shape[3], dtype=t.dtype)
        cache[table.flatten().long()] = t.cpu().transpose(1, 2).reshape(batch * pages, page, heads, t.shape[3])
        caches.append(cache.to(t.device).transpose(1, 2))
    for b, (end, lo) in enumerate(zip(used, pad)):
        held = torch.arange(pages)
        table[b, (held < lo // page) | (held * page >= end)] = -1
    return caches[0], caches[1], table.to(k.device)


def check(device, dtype, used, pad=None, heads_q=4, heads_kv=2, len_q=1, causal=BOTTOM_RIGHT, window=(-1, -1),
          alibi=False, softcap=0.0, len_k=LEN_K, page=None, dim=32):
    batch = len(used)
    q, k, v = _make(device, dtype, batch, heads_q, heads_kv, len_q, dim=dim, len_k=len_k)
    slopes = 0.3 * torch.rand(batch, heads_q, device=device) if alibi else None
    features = dict(seqused_k=torch.tensor(used, dtype=torch.int32, device=device),
                    window_left=window[0], window_right=window[1], alibi_slopes=slopes, softcap=softcap)
    if pad is not None:
        features["leftpad_k"] = torch.tensor(pad, dtype=torch.int32, device=device)
    if page is None:
        out, lse = checked_fwd(q, k, v, 0.25, causal, **features)
    else:
        k_pages, v_pages, features["block_table"] = paged(k, v, page, used, pad or [0] * batch)
        out, lse = checked_fwd(q, k_pages, v_pages, 0.25, causal, **features)
    pad = pad or [0] * batch
    cpu = [t.cpu() for t in (q, k, v)]
    slopes = None if slopes is None else slopes.cpu()
    expected = _reference(*(t.double() for t in cpu), used, pad, 0.25, causal, window, slopes, softcap)
    same = _reference(*cpu, used, pad, 0.25, causal, window, slopes, softcap)
    assert out.shape == q.shape and lse.shape == q.shape[:3]
    assert_accurate("out", out.cpu(), expected[0], same[0], REL_ATOL[dtype])
    assert_accurate("lse", lse.cpu(), expected[1], same[1], REL_ATOL[lse_dtype(dtype)])


CASES = {
    "ragged_decode": dict(used=[0, 1, 37, LEN_K]),
    "ragged_rows_causal": dict(used=[5, 64, 1, LEN_K], len_q=5),
    "leftpad": dict(used=[9, LEN_K, 30], pad=[3, 17, 30], len_q=2),
    "mqa_16_rows": dict(used=[16, 70], heads_q=4, heads_kv=1, len_q=16),
    "mha_no_causal": dict(used=[33, 2], heads_kv=4, len_q=3, causal=NONE),
    "top_left": dict(used=[20, 7], len_q=4, causal=TOP_LEFT),
    "window_alibi_softcap": dict(used=[50, 12, LEN_K], pad=[4, 0, 10], len_q=3, window=(9, 1), alibi=True,
                                 softcap=2.0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_key_ranges_fp32(device, case):
    check(device, torch.float32, **CASES[case])


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("case", ["ragged_decode", "leftpad", "mqa_16_rows"])
def test_key_ranges_dtypes(device, dtype, case):
    check(device, dtype, **CASES[case])


@pytest.mark.parametrize("page,len_k", [(16, 80), (48, 96), (64, 128), (256, 256)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64], ids=["bf16", "fp64"])
def test_paged(device, dtype, page, len_k):
    """Pages of 16 (a 64-key tile spans several), 48 (tiles start mid-page), 64 and 256, with left
    padding that starts sequences mid-page, GQA and several query rows."""
    check(device, dtype, used=[len_k, 1, 40, 0], pad=[0, 0, 21, 0], heads_q=4, heads_kv=1, len_q=3, len_k=len_k,
          page=page)


@pytest.mark.parametrize("dim", [64, 96, 128, 256])
def test_head_dims(device, dim):
    """The decode kernel's tile layouts on CUDA (swizzled at 64 / 128 / 256, padded at 96), dense and
    paged with pages of 16 and 48 keys (a thread's rows step across pages), sequences starting
    mid-page, a part of the keys past some sequences' ends."""
    for page in (None, 16, 48):
        check(device, torch.float16, used=[192, 100, 7, 130], pad=[0, 37, 0, 50], heads_q=4, heads_kv=2, len_q=2,
              len_k=192, page=page, dim=dim)


@pytest.mark.parametrize("case", ["window_alibi_softcap", "mha_no_causal"])
def test_paged_features(device, case):
    """A paged call with features the decode kernel lacks (its pages gathered first on CUDA)."""
    check(device, torch.float16, page=16, **CASES[case])


def test_long_keys_split(device):
    """Enough keys that the CUDA decode kernel cuts them into parts, some of which hold no key
    of the short sequences (sized from the rows of k, since the values are not read)."""
    for page in (None, 32):
        check(device, torch.bfloat16, used=[4096, 70, 0, 1500], pad=[0, 3, 0, 1000], heads_q=8, heads_kv=1,
              len_k=4096, page=page)


# ---- arguments ----

def _args(device="cpu", batch=2):
    q, k, v = _make(device, torch.float32, batch, 2, 2, 3)
    return q, k, v


def _i32(*values, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype)


BAD = [
    (dict(seqused_k=_i32(4, 5, dtype=torch.int64)), r"argument 'seqused_k' must have dtype int32, got int64"),
    (dict(seqused_k=_i32(4)), r"argument 'seqused_k' must be a contiguous 1-D tensor of shape \[2\] \(batch\), "
                              r"got shape \[1\]"),
    (dict(seqused_k=_i32(4, 5, 6)[::2]), r"argument 'seqused_k' must be a contiguous 1-D tensor"),
    (dict(seqused_k=_i32(4, 5), leftpad_k=_i32(1, 1, 1)), r"argument 'leftpad_k' must be a contiguous 1-D tensor of "
                                                         r"shape \[2\]"),
    (dict(seqused_k=torch.ones(2, dtype=torch.int32, device="meta")), r"argument 'seqused_k' is on device meta"),
    (dict(leftpad_k=_i32(1, 1)), r"argument 'leftpad_k' needs 'seqused_k'"),
    (dict(seqused_k=_i32(4, 5), attn_bias=torch.ones(2, 1, 3, LEN_K, dtype=torch.bool)),
     r"the combination attn_bias \+ seqused_k \(per-sequence key ranges\) is not supported"),
]


@pytest.mark.parametrize("features,match", BAD, ids=["int64", "shape", "strided", "pad_shape", "meta", "pad_alone",
                                                     "with_bias"])
@pytest.mark.parametrize("path", ["python", "op"])
def test_bad_arguments(features, match, path):
    """Through the public checks (Python) and the op itself (C++ checks, after the fake kernel's)."""
    q, k, v = _args()
    fn = checked_fwd if path == "python" else op
    with pytest.raises(RuntimeError, match=match):
        fn(q, k, v, 0.5, BOTTOM_RIGHT, **features)


def test_with_cu_seqlens_is_an_error():
    q, k, v = _args(batch=1)
    cu = _i32(0, 3)
    with pytest.raises(RuntimeError, match=r"'seqused_k' / 'leftpad_k' describe a padded batch; they cannot be "
                                           r"combined with cu_seqlens"):
        checked_fwd(q, k, v, 0.5, NONE, cu_seqlens_q=cu, cu_seqlens_k=_i32(0, LEN_K), max_seqlen_q=3,
                    max_seqlen_k=LEN_K, seqused_k=_i32(4))


# Sequences 0, 2 and 4 out of range (past the keys, negative, left padding past the end), 1 and 3 in range.
OUT_OF_RANGE_USED, OUT_OF_RANGE_PAD = [LEN_K + 1, 30, -1, LEN_K, 4], [0, 3, 0, 16, 5]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("page", [None, 16], ids=["dense", "paged"])
@pytest.mark.parametrize("len_q", [1, 3])
def test_out_of_range_values_give_nan_rows(device, dtype, page, len_q):
    """Values are read only where the kernels read them, on every device: a sequence outside
    0 <= leftpad_k <= seqused_k <= len_k reads no key and gets NaN out and lse rows (its pages
    may name any block); the others match the reference. fp16 with one or three rows takes the
    decode kernel on CUDA, fp32 the general forward."""
    used, pad = OUT_OF_RANGE_USED, OUT_OF_RANGE_PAD
    valid = [b for b, (u, p) in enumerate(zip(used, pad)) if 0 <= p <= u <= LEN_K]
    q, k, v = _make(device, dtype, len(used), 4, 2, len_q)
    features = dict(seqused_k=_i32(*used).to(device), leftpad_k=_i32(*pad).to(device))
    if page is None:
        out, lse = checked_fwd(q, k, v, 0.25, BOTTOM_RIGHT, **features)
    else:
        clamped = [min(max(u, 0), LEN_K) for u in used]
        k_pages, v_pages, table = paged(k, v, page, clamped, [min(max(p, 0), c) for p, c in zip(pad, clamped)])
        table[[b for b in range(len(used)) if b not in valid]] = 10**6  # never read
        out, lse = checked_fwd(q, k_pages, v_pages, 0.25, BOTTOM_RIGHT, block_table=table, **features)
    invalid = [b for b in range(len(used)) if b not in valid]
    assert out[invalid].isnan().all() and lse[invalid].isnan().all()
    cpu = [t[valid].cpu() for t in (q, k, v)]
    used_v, pad_v = [used[b] for b in valid], [pad[b] for b in valid]
    expected = _reference(*(t.double() for t in cpu), used_v, pad_v, 0.25, BOTTOM_RIGHT, (-1, -1), None, 0.0)
    same = _reference(*cpu, used_v, pad_v, 0.25, BOTTOM_RIGHT, (-1, -1), None, 0.0)
    assert_accurate("out", out[valid].cpu(), expected[0], same[0], REL_ATOL[dtype])
    assert_accurate("lse", lse[valid].cpu(), expected[1], same[1], REL_ATOL[lse_dtype(dtype)])


def test_backward_is_refused(device):
    q, k, v = (t.requires_grad_() for t in _make(device, torch.float64, 2, 2, 2, 3))
    out, _ = op(q, k, v, 0.5, BOTTOM_RIGHT, seqused_k=torch.tensor([5, 9], dtype=torch.int32, device=device))
    with pytest.raises(RuntimeError, match=r"the backward of a call with 'seqused_k' / 'leftpad_k' \(per-sequence "
                                           r"key ranges\) is not supported: such calls are forward only"):
        out.sum().backward()


def test_opcheck(device):
    q, k, v = _make(device, torch.float32, 2, 4, 2, 3)
    features = dict(seqused_k=torch.tensor([5, 70], dtype=torch.int32, device=device),
                    leftpad_k=torch.tensor([2, 0], dtype=torch.int32, device=device), window_left=8)
    torch.library.opcheck(op, (q, k, v, 0.3, BOTTOM_RIGHT, False), features)


# ---- paged arguments ----

def _paged_args(table=None, blocks=5, page=16):
    q = torch.randn(2, 2, 3, 8)
    k, v = (torch.randn(blocks, page, 2, 8).transpose(1, 2) for _ in range(2))
    if table is None:
        table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    return q, k, v, table


BAD_PAGED = [
    (dict(block_table=torch.zeros(2, 2, dtype=torch.int64)),
     r"argument 'block_table' must have dtype int32, got int64"),
    (dict(block_table=torch.zeros(3, 2, dtype=torch.int32)),
     r"argument 'block_table' must be a \(batch = 2, pages >= 1\) tensor with a contiguous last dimension, got shape "
     r"\[3, 2\]"),
    (dict(block_table=torch.zeros(2, 4, dtype=torch.int32)[:, ::2]), r"argument 'block_table' must be a \(batch = 2"),
    (dict(block_table=torch.zeros(2, 2, dtype=torch.int32, device="meta")),
     r"argument 'block_table' is on device meta"),
    (dict(v=torch.randn(4, 16, 2, 8).transpose(1, 2)),
     r"argument 'v' has number of blocks \(must equal k's\) 4 \(shape \[4, 2, 16, 8\]\) but 5 was expected"),
    (dict(cu_seqlens_q=_i32(0, 3), cu_seqlens_k=_i32(0, 32), max_seqlen_q=3, max_seqlen_k=32),
     r"a 'block_table' \(paged k / v\) cannot be combined with cu_seqlens"),
]


@pytest.mark.parametrize("change,match", BAD_PAGED, ids=["int64", "shape", "strided", "meta", "v_blocks", "varlen"])
@pytest.mark.parametrize("path", ["python", "op"])
def test_bad_paged_arguments(change, match, path):
    q, k, v, table = _paged_args()
    args = dict(dict(k=k, v=v, block_table=table), **change)
    if "cu_seqlens_q" in change:
        q = q[:1]
        args["block_table"] = table[:1]
    fn = checked_fwd if path == "python" else op
    with pytest.raises(RuntimeError, match=match):
        fn(q, args.pop("k"), args.pop("v"), 0.5, BOTTOM_RIGHT, **args)


def test_bad_cpu_block_values():
    """CPU blocks are checked where the page holds keys of its sequence; the others may be -1."""
    q, k, v, _ = _paged_args()
    table = torch.tensor([[0, -1], [2, 3]], dtype=torch.int32)
    used = _i32(16, 32)
    out, _ = checked_fwd(q, k, v, 0.5, BOTTOM_RIGHT, seqused_k=used, block_table=table)  # page 1 of 0 unused
    with pytest.raises(RuntimeError, match=r"argument 'block_table' has block -1 at \[0, 1\], which holds keys of "
                                           r"sequence 0; blocks must be in \[0, num_blocks = 5\)"):
        checked_fwd(q, k, v, 0.5, BOTTOM_RIGHT, seqused_k=_i32(17, 32), block_table=table)
    with pytest.raises(RuntimeError, match=r"has block 5 at \[1, 0\]"):
        checked_fwd(q, k, v, 0.5, BOTTOM_RIGHT, block_table=torch.tensor([[0, 1], [5, 3]], dtype=torch.int32))


def test_unchecked_device_blocks_are_clamped():
    """On CUDA block numbers are never read on the host: out of range, they are clamped into
    [0, num_blocks) where the kernels read them (no access outside k / v)."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA values only")
    q, k, v, _ = _paged_args(blocks=4)
    q, k, v = (t.half().cuda() for t in (q, k, v))
    table = torch.tensor([[10**6, 1], [-5, 2]], dtype=torch.int32)
    used = _i32(32, 20)
    out, lse = op(q, k, v, 0.5, BOTTOM_RIGHT, seqused_k=used.cuda(), block_table=table.cuda())
    # (batch, pages, heads, page, dim) -> (batch, heads, keys, dim)
    dense = [t.cpu()[table.clamp(0, 3).long()].transpose(1, 2).flatten(2, 3) for t in (k, v)]
    cpu_q = q.cpu()
    expected = _reference(cpu_q.double(), *(t.double() for t in dense), used.tolist(), [0, 0], 0.5, BOTTOM_RIGHT,
                          (-1, -1), None, 0.0)
    same = _reference(cpu_q, *dense, used.tolist(), [0, 0], 0.5, BOTTOM_RIGHT, (-1, -1), None, 0.0)
    assert_accurate("out", out.cpu(), expected[0], same[0], REL_ATOL[torch.float16])
    assert_accurate("lse", lse.cpu(), expected[1], same[1], REL_ATOL[torch.float32])


def test_paged_backward_is_refused(device):
    q, k, v, table = (t.to(device) for t in _paged_args())
    q = q.double().requires_grad_()
    out, _ = op(q, k.double(), v.double(), 0.5, BOTTOM_RIGHT, block_table=table)
    with pytest.raises(RuntimeError, match=r"the backward of a call with a 'block_table' \(paged k / v\) is not "
                                           r"supported"):
        out.sum().backward()


def test_paged_opcheck(device):
    q, k, v, table = (t.to(device) for t in _paged_args())
    used = _i32(20, 32).to(device)
    torch.library.opcheck(op, (q, k, v, 0.3, BOTTOM_RIGHT, False), dict(block_table=table, seqused_k=used))

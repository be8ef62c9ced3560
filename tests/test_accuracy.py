"""Numerics of flashattn::fwd / bwd against a float64 torch reference (DESIGN §4): out, lse,
dq, dk, dv over dtypes, lengths, causal alignments, GQA, head dims, strided views, empty
and fully masked problems, large logits."""
import math

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from reference import (BOTTOM_RIGHT, CAUSAL_IDS, CAUSAL_MODES, NONE, TOP_LEFT, check_against_reference,
                       dead_rows, lse_dtype, make_qkv, ours, run_with_grads)

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp64", "fp32", "bf16", "fp16"]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", CAUSAL_MODES, ids=CAUSAL_IDS)
@pytest.mark.parametrize("len_q,len_k", [(1, 1), (7, 7), (129, 129), (7, 129), (129, 7), (1, 129), (130, 1)])
def test_lengths(device, dtype, causal, len_q, len_k):
    q, k, v = make_qkv(2, 2, 2, len_q, len_k, 64, 64, dtype, device)
    check_against_reference(q, k, v, 1 / 8, causal)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("causal,len_q,len_k", [(NONE, 1000, 1000), (TOP_LEFT, 1000, 1000),
                                                 (BOTTOM_RIGHT, 1000, 257), (BOTTOM_RIGHT, 129, 1000)])
def test_long_sequences(device, dtype, causal, len_q, len_k):
    q, k, v = make_qkv(1, 2, 1, len_q, len_k, 64, 64, dtype, device)
    check_against_reference(q, k, v, 1 / 8, causal)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", CAUSAL_MODES, ids=CAUSAL_IDS)
@pytest.mark.parametrize("len_q", [1024, 1030])
def test_backward_kernels_by_length(device, dtype, causal, len_q):
    """The fp16 / bf16 dim-64 CUDA backward takes half-size blocks (two per SM) up to 1024 query rows
    and 8-warp blocks above (sm80 tile_config.h, Bwd2dConfig::kTwoBlocksMaxLen): both sides of the
    switch, ragged key tiles for both (64 and 128 keys), a ragged query tile above it."""
    q, k, v = make_qkv(1, 2, 1, len_q, 300, 64, 64, dtype, device)
    check_against_reference(q, k, v, 1 / 8, causal)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", CAUSAL_MODES, ids=CAUSAL_IDS)
@pytest.mark.parametrize("len_q,heads_kv,group", [(256, 2, 1), (320, 1, 3)], ids=["mha", "gqa"])
def test_backward_query_lengths_multiple_of_16(device, dtype, head_dim, causal, len_q, heads_kv, group):
    """Query lengths a multiple of 16 at dims 64 and 128: on sm_90 the warp-specialized dK/dV kernel
    (sm90/bwd_sm90.cuh) stages each dQ tile in smem and adds it with one bulk reduce-add (other
    lengths take its atomics); 4-5 query tiles per key tile, over a GQA group, and a ragged key tile."""
    q, k, v = make_qkv(1, heads_kv * group, heads_kv, len_q, 200, head_dim, head_dim, dtype, device)
    check_against_reference(q, k, v, head_dim**-0.5, causal)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("heads_q", [67, 134], ids=["mha", "gqa"])
def test_backward_split_last_wave(device, dtype, head_dim, heads_q):
    """A dK/dV grid of more blocks than one wave of the GPU, by a remainder: the fp16 / bf16 CUDA
    backward of plain non-causal calls takes the first blocks' walks whole and cuts each walk of
    the last wave into parts whose dK / dV add up in fp32 (sm80 tail_split.cuh). 67 kv heads x 300
    keys: 201 blocks of 128 keys or 335 of 64 (132 SMs: 69 or 71 walks split, into 3-11 parts);
    2100 query rows: 17 or 33 tiles per head with a ragged last one (GQA: the walk crosses two
    heads, and parts start in the second). The CPU backend has no waves: 1 kv head there, to
    keep it quick."""
    heads_kv = 67 if device == "cuda" else 1
    q, k, v = make_qkv(1, heads_q * heads_kv // 67, heads_kv, 2100, 300, head_dim, head_dim, dtype, device)
    check_against_reference(q, k, v, head_dim**-0.5, False)


HEAVY_LAST_CASES = ([(dt, d) for dt in (torch.bfloat16, torch.float16) for d in (32, 64, 96, 128, 192, 256)]
                    + [(torch.float64, 64), (torch.float64, 128)])


@pytest.mark.parametrize("dtype,head_dim", HEAVY_LAST_CASES,
                         ids=[f"{DTYPE_IDS[DTYPES.index(dt)]}-{d}" for dt, d in HEAVY_LAST_CASES])
@pytest.mark.parametrize("causal", [TOP_LEFT, BOTTOM_RIGHT], ids=["top_left", "bottom_right"])
@pytest.mark.parametrize("len_k,group", [(600, 1), (1300, 2)], ids=["600_keys_mha", "1300_keys_gqa"])
def test_causal_last_pairs_heaviest_first(device, dtype, head_dim, causal, len_k, group):
    """Causal grids of more than two waves, whose last (batch, head) pairs run tile slowest so that
    their heaviest tiles start first (sm80 causal_order.cuh), the pairs before in the plain order:
    the fp16 / bf16 CUDA backward (the 2-D dK/dV kernel at dims 64 - 256, the 1-D one at 32 / 192)
    and the forward with one query tile per block (fp16 / bf16 at 192 / 256, fp64 at 64 / 128;
    the fp64 backward is deterministic, in its rounds). 67 kv heads: with 132 SMs the 2-D kernel's
    last 53 / 27 pairs (600 keys, 5 / 10 key tiles) or 24 / 13 (1300 keys) are reordered, the
    dim-256 forward's last 30 heads of 18 query tiles; 1100 query rows keep dim 64 off the two-block
    kernel; 1300 keys under top-left masking leave the last key tiles without a walk. The CPU
    backend has no waves: there 1 kv head and a tenth of the rows and keys (the same masks' shapes),
    to keep it quick."""
    heads_kv, len_q = (67, 1100) if device == "cuda" else (1, 110)
    if device != "cuda":
        len_k //= 10
    q, k, v = make_qkv(1, heads_kv * group, heads_kv, len_q, len_k, head_dim, head_dim, dtype, device)
    check_against_reference(q, k, v, head_dim**-0.5, causal)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [NONE, BOTTOM_RIGHT], ids=["none", "bottom_right"])
@pytest.mark.parametrize("len_q,heads_kv,group", [(17, 3, 1), (45, 2, 4), (200, 1, 2)],
                         ids=["17_rows", "gqa_45_rows", "two_tiles"])
def test_forward_split_key_walks(device, dtype, head_dim, causal, len_q, heads_kv, group):
    """Grids of fewer blocks than the GPU holds, whose walks over 4200 keys (ragged: 66 tiles of
    64 keys at dims 128 / 256, 33 of 128 at dim 64) the fp16 / bf16 CUDA forward cuts into parts,
    a block each, merged by each walk's last part (sm80 key_split.cuh; at dims 64 / 256 in the
    split kernel that such grids take): 17 query rows (one more than the decode kernel takes), 45
    rows of a GQA group, two query tiles per head (non-causal; causal, whose walks differ, keeps
    whole walks). The backward then runs from the merged LSE."""
    q, k, v = make_qkv(1, heads_kv * group, heads_kv, len_q, 4200, head_dim, head_dim, dtype, device)
    check_against_reference(q, k, v, head_dim**-0.5, causal)


DECODE_CASES = {  # len_q, heads_kv, group, len_k
    "mha_4200_keys": (1, 2, 1, 4200),  # few walks: each cut into parts over the keys
    "gqa_8": (1, 2, 8, 3000),  # a group's 8 heads packed into one chunk
    "4_rows_gqa_4": (4, 1, 4, 2100),  # 16 packed rows, bands differing by row under causal masks
    "16_rows": (16, 2, 1, 700),  # the most rows the decode kernel takes
    "3_rows_gqa_20": (3, 1, 20, 1500),  # 60 packed rows: 4 chunks, each spanning heads
    "mqa_64": (1, 4, 64, 260),  # 4 chunks a kv head, a ragged last key tile
    "63_keys": (1, 3, 5, 63),  # less than one key tile
    "12_rows_5_keys": (12, 1, 2, 5),  # bottom-right: the first 7 rows of each head see no key
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 192, 256])
@pytest.mark.parametrize("causal", CAUSAL_MODES, ids=CAUSAL_IDS)
@pytest.mark.parametrize("case", DECODE_CASES.values(), ids=DECODE_CASES.keys())
def test_forward_decode_steps(device, dtype, head_dim, causal, case):
    """Calls of at most 16 query rows whose group packs into at most 4 chunks of 16 rows: the
    fp16 / bf16 CUDA forward's decode kernel at every head-dim tier (sm80 fwd_decode.cuh; swizzled
    tiles at 64 / 128 / 256, padded ones at 32 / 96 / 192; its 4 warps take 16 keys each
    of a tile and merge their rows at the end; grids smaller than the GPU in parts over the keys,
    merged by each walk's last part). Top-left causal masks leave the first rows a key or a few,
    in one tile. The backward runs from its LSE. CPU (no such kernel): a quarter of the keys, to
    keep it quick."""
    len_q, heads_kv, group, len_k = case
    if device != "cuda":
        len_k = (len_k + 3) // 4
    q, k, v = make_qkv(1, heads_kv * group, heads_kv, len_q, len_k, head_dim, head_dim, dtype, device)
    check_against_reference(q, k, v, head_dim**-0.5, causal)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim,head_dim_v", [(32, 32), (64, 64), (96, 96), (128, 128), (192, 128), (256, 256),
                                                 (128, 64), (72, 120)])
def test_forward_decode_whole_walks(device, dtype, head_dim, head_dim_v):
    """A decode grid of more walks than the GPU holds (3 x 400 kv heads, GQA groups of 2): every
    walk whole, no parts; value head dims other than the query's (zero-padded columns of the
    tier). CPU: 2 kv heads."""
    heads_kv = 400 if device == "cuda" else 2
    q, k, v = make_qkv(3, 2 * heads_kv, heads_kv, 1, 300, head_dim, head_dim_v, dtype, device)
    check_against_reference(q, k, v, head_dim**-0.5, BOTTOM_RIGHT)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_forward_split_last_wave(device, dtype):
    """A grid of two waves and 3 blocks (the fp16 / bf16 forward at dim 128 holds 2 blocks per SM):
    the last 3 walks (47 key tiles) cut into 5 parts, the blocks before them whole. CPU: 3 heads."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device == "cuda" else 0
    q, k, v = make_qkv(1, 4 * sms + 3, 1, 60, 3000, 128, 128, dtype, device)
    check_against_reference(q, k, v, 128**-0.5, NONE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", CAUSAL_MODES, ids=CAUSAL_IDS)
@pytest.mark.parametrize("len_q,heads_kv,group", [(2100, 20, 1), (2200, 4, 4)], ids=["mha", "gqa"])
def test_forward_long_key_walks(device, dtype, head_dim, causal, len_q, heads_kv, group):
    """The calls the wgmma forward (fwd_ws_sm90.cuh) takes on sm_90 (the sm80/ kernels elsewhere): at
    dims 64 / 128 / 256, non-causal grids of 288-340 blocks persistent (2-3 query tiles per block),
    causal ones a block per tile. 2100 / 4200 keys: a ragged last key tile. At dim 64 the three-consumer
    form (192-row items): 2200 rows leave the last consumer of a head's last item no row. CPU: one kv
    head, 130 rows."""
    heads_kv, len_q = (heads_kv, len_q) if device == "cuda" else (1, 130)
    len_k = 4200 if head_dim == 64 else 2100
    q, k, v = make_qkv(1, heads_kv * group, heads_kv, len_q, len_k, head_dim, head_dim, dtype, device)
    check_against_reference(q, k, v, head_dim**-0.5, causal)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [TOP_LEFT, BOTTOM_RIGHT], ids=["top_left", "bottom_right"])
@pytest.mark.parametrize("heads,heads_kv,len_q,len_k", [(0, 0, 100, 100), (0, 0, 300, 300), (33, 11, 1100, 1100),
                                                        (45, 45, 600, 900)],
                         ids=["one_tile", "three_tiles", "gqa_nine_tiles", "five_tiles_more_keys"])
def test_forward_causal_paired_walk(device, head_dim, causal, heads, heads_kv, len_q, len_k):
    """Causal grids larger than the GPU whose heads have few query tiles: on sm_90 the wgmma forward's
    persistent grid pairs each head's heavy and light tiles (schedule/causal_order.cuh: fwd_paired_block),
    two heads of an odd tile count (1, 3, 9, 5 at 128 rows) their middle tiles, and an odd head count
    (SMs + 3, 33, 45) leaves a last head of single tiles after the pairs' rounds. (Below the Hopper forward's
    causal bars, 256 mean keys at dims 64 and 256, the sm80/ kernels run these unless the wgmma
    forward is forced.) CPU: two heads, 130 rows."""
    if device == "cuda":
        heads = heads or torch.cuda.get_device_properties(device).multi_processor_count + 3
        heads_kv = heads_kv or heads
    else:
        heads, heads_kv, len_q, len_k = 2, (1 if heads_kv != heads else 2), 130, 130 + len_k - len_q
    q, k, v = make_qkv(1, heads, heads_kv, len_q, len_k, head_dim, head_dim, torch.bfloat16, device)
    check_against_reference(q, k, v, head_dim**-0.5, causal)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("heads_q,len_q", [(2, 20), (8, 1)], ids=["split_walks", "decode"])
def test_forward_split_is_deterministic_and_keeps_nan(device, head_dim, heads_q, len_q):
    """The merges add a walk's parts in part order whichever part finishes last (and the decode
    kernel's warps in warp order): the same call gives the same bits. A NaN key in one part's
    tiles makes every row of the query heads reading its kv head NaN, as in torch, and leaves the
    other kv head's finite. 20 rows: the plain kernels' split (key_split.cuh); one row of a GQA
    group of 4: the decode kernel (fwd_decode.cuh)."""
    q, k, v = make_qkv(1, heads_q, 2, len_q, 6000, head_dim, head_dim, torch.bfloat16, device)
    first, _ = ours(q, k, v, 0.125, NONE)
    for _ in range(3):
        again, _ = ours(q, k, v, 0.125, NONE)
        assert torch.equal(first, again)
    k[0, 1, 3717, 5] = float("nan")
    out, lse = ours(q, k, v, 0.125, NONE)
    nan_heads = heads_q // 2  # the second kv head's group
    assert out[0, nan_heads:].isnan().all() and lse[0, nan_heads:].isnan().all()
    assert out[0, :nan_heads].isfinite().all() and lse[0, :nan_heads].isfinite().all()


@pytest.mark.parametrize("causal", CAUSAL_MODES, ids=CAUSAL_IDS)
def test_many_query_tiles(device, causal):
    """A grid of at least 4 query tiles per SM: the fp32 dim-128 CUDA forward then gives each block
    a pair of 128-row tiles (the last and the first, ..., the middle one alone, a ragged last one)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device == "cuda" else 8
    tiles = 3  # per head: 300 rows
    batch = -(-4 * sms // (8 * tiles))
    q, k, v = make_qkv(batch, 8, 4, 300, 260, 128, 128, torch.float32, device)
    check_against_reference(q, k, v, 128**-0.5, causal)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16], ids=["fp64", "bf16", "fp16"])
@pytest.mark.parametrize("causal", CAUSAL_MODES, ids=CAUSAL_IDS)
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 192, 256])
@pytest.mark.parametrize("len_q,len_k", [(300, 190), (200, 330)])
def test_several_query_tiles(device, dtype, causal, head_dim, len_q, len_k):
    """Several query tiles per head at every tile shape of the tensor-core forward (one tile per
    block, the last first). 300 rows: 3 tiles of 128 rows (fp16/bf16 up to dim 128, fp64 at 96
    and 128) or 5 of 64 (fp16/bf16 at 192 and 256, fp64 at 32), an odd count; 200 rows: 2 or 4,
    even; both with a ragged last tile. Bottom-right at 300 x 190: the first 110 rows see no key."""
    q, k, v = make_qkv(1, 2, 1, len_q, len_k, head_dim, head_dim, dtype, device)
    check_against_reference(q, k, v, head_dim**-0.5, causal)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("causal", CAUSAL_MODES, ids=CAUSAL_IDS)
@pytest.mark.parametrize("heads_kv", [2, 1], ids=["gqa", "mqa"])
@pytest.mark.parametrize("len_q,len_k", [(65, 130), (130, 65)])
def test_grouped_query(device, dtype, causal, heads_kv, len_q, len_k):
    q, k, v = make_qkv(2, 4, heads_kv, len_q, len_k, 32, 32, dtype, device)
    check_against_reference(q, k, v, 32**-0.5, causal)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", [NONE, BOTTOM_RIGHT], ids=["none", "bottom_right"])
@pytest.mark.parametrize("head_dim,head_dim_v", [(1, 1), (8, 8), (24, 24), (32, 32), (64, 64), (80, 80), (96, 96),
                                                 (128, 128), (192, 192), (192, 128), (256, 256), (64, 32), (32, 128),
                                                 (256, 8), (1, 256)])
def test_head_dims(device, dtype, causal, head_dim, head_dim_v):
    q, k, v = make_qkv(1, 2, 2, 33, 70, head_dim, head_dim_v, dtype, device)
    check_against_reference(q, k, v, head_dim**-0.5, causal)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("scale", [-0.5, 0.0, 1e-3, 1.0, 3.7])
def test_custom_scale(device, dtype, scale):
    q, k, v = make_qkv(1, 2, 2, 20, 33, 16, 16, dtype, device)
    check_against_reference(q, k, v, scale, TOP_LEFT)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", CAUSAL_MODES, ids=CAUSAL_IDS)
def test_gradient_through_lse(device, dtype, causal):
    q, k, v = make_qkv(2, 4, 2, 40, 23, 32, 16, dtype, device)
    dlse = torch.randn(2, 4, 40, dtype=lse_dtype(dtype), device=device)
    check_against_reference(q, k, v, 32**-0.5, causal, dlse=dlse)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("len_q,len_k", [(9, 4), (130, 7), (5, 1)])
@pytest.mark.parametrize("with_dlse", [False, True], ids=["out", "out_and_lse"])
def test_fully_masked_rows(device, dtype, len_q, len_k, with_dlse):
    """Bottom-right alignment with len_q > len_k: the first len_q - len_k rows see no key."""
    q, k, v = make_qkv(2, 2, 1, len_q, len_k, 32, 32, dtype, device)
    dlse = torch.randn(2, 2, len_q, dtype=lse_dtype(dtype), device=device) if with_dlse else None
    got = check_against_reference(q, k, v, 32**-0.5, BOTTOM_RIGHT, dlse=dlse)
    dead = dead_rows(len_q, len_k, BOTTOM_RIGHT, device)
    assert dead.sum() == len_q - len_k
    assert torch.all(got["out"][:, :, dead] == 0)
    assert torch.all(got["lse"][:, :, dead] == float("-inf"))
    assert torch.all(got["dq"][:, :, dead] == 0)
    assert torch.isfinite(got["lse"][:, :, ~dead]).all()
    for name in ("out", "dq", "dk", "dv"):
        assert torch.isfinite(got[name]).all(), name


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", CAUSAL_MODES, ids=CAUSAL_IDS)
def test_large_logits(device, dtype, causal):
    """|scale * q.k| up to ~1e4: the online softmax must not overflow."""
    _check_large_logits(device, dtype, causal, 24, 16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", CAUSAL_MODES, ids=CAUSAL_IDS)
@pytest.mark.parametrize("head_dim", [64, 128])  # 64: the backward's FMA-pipe exponentials see scores near -1e4
def test_large_logits_over_tiles(device, dtype, causal, head_dim):
    """Large logits over several key tiles at a tensor-core head dim: rows close to one-hot,
    where O = V (and so dS = 0) only if P's largest element and the row sum agree as P V rounds
    them, and the backward's scores must match the forward's to the ulp (both on the tensor
    cores: fp16 missed the rule when GPUs with 99 KB of smem ran this backward on the SIMT kernel).
    (fp32 meets the rule at the small shape only: the backward recomputes P from the LSE, an fp32
    value near 1e4 here whose rounding alone (~5e-4) moves P by more than twice the error of
    torch, which keeps P.)"""
    _check_large_logits(device, dtype, causal, 300, head_dim)


def _check_large_logits(device, dtype, causal, length, head_dim):
    q, k, v = make_qkv(1, 2, 2, length, length, head_dim, head_dim, dtype, device)
    q, k = q * 30, k * 30
    logits = (q.double() @ k.double().transpose(-1, -2)).abs().max()
    assert logits > 5e3
    # Gradients carry rounding of terms 30x the unit scale (|q|, |k|): measure errors
    # absolutely below that magnitude.
    got = check_against_reference(q, k, v, 1.0, causal, atol_floor=30.0)
    for name in ("out", "lse", "dq", "dk", "dv"):
        assert torch.isfinite(got[name]).all(), name


# ---- strided inputs: the op reads views in place and lays its outputs out as documented ----

def _grads_of_op(q, k, v, scale, causal, dout):
    return run_with_grads(lambda *t: ours(*t, scale, causal), q, k, v, dout)


def _assert_same_results(a, b):
    for name in ("out", "lse", "dq", "dk", "dv"):
        assert torch.equal(a[name], b[name]), name


def _assert_no_copies(fn):
    """No hidden copy of the inputs: the op's call tree holds no copy/contiguous/clone."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    names = {e.name for e in prof.events()}
    assert any(n.startswith("flashattn::") for n in names), names
    copies = names & {"aten::copy_", "aten::clone", "aten::contiguous", "aten::_to_copy", "aten::to"}
    assert not copies, f"the op copied its inputs: {sorted(copies)}"


def _is_blhe(t):
    """(batch, heads, len, dim) view of a contiguous (batch, len, heads, dim) tensor."""
    return t.transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["fp64", "bf16"])
@pytest.mark.parametrize("causal", CAUSAL_MODES, ids=CAUSAL_IDS)
def test_transposed_blhe_inputs(device, dtype, causal):
    b, lq, lk, h, e = 2, 37, 50, 3, 32
    q = torch.randn(b, lq, h, e, dtype=dtype, device=device).transpose(1, 2)
    k = torch.randn(b, lk, h, e, dtype=dtype, device=device).transpose(1, 2)
    v = torch.randn(b, lk, h, 16, dtype=dtype, device=device).transpose(1, 2)
    dout = torch.randn(b, lq, h, 16, dtype=dtype, device=device).transpose(1, 2)
    strided = _grads_of_op(q, k, v, 0.2, causal, dout)
    contiguous = _grads_of_op(q.contiguous(), k.contiguous(), v.contiguous(), 0.2, causal, dout.contiguous())
    _assert_same_results(strided, contiguous)
    # Outputs follow the inputs' (batch, len, heads, dim) memory order; lse is contiguous.
    for name in ("out", "dq", "dk", "dv"):
        assert _is_blhe(strided[name]), (name, strided[name].stride())
        assert contiguous[name].is_contiguous(), (name, contiguous[name].stride())
    assert strided["lse"].is_contiguous()
    check_against_reference(q, k, v, 0.2, causal)
    out, lse = ours(q, k, v, 0.2, causal)
    _assert_no_copies(lambda: ours(q, k, v, 0.2, causal))
    _assert_no_copies(lambda: torch.ops.flashattn.bwd(dout, q, k, v, out, lse, None, 0.2, causal, False))


@pytest.mark.parametrize("dtype,head_dim", [(torch.bfloat16, 64), (torch.float16, 128)], ids=["bf16-64", "fp16-128"])
@pytest.mark.parametrize("causal", [NONE, BOTTOM_RIGHT], ids=["none", "bottom_right"])
def test_strided_views_at_hopper_dims(device, dtype, head_dim, causal):
    """Views read in place at the head dims of the warp-specialized Hopper forward, whose copies address
    the operands through tensor maps (sm90/tma_map.h; on sm_90 FLASHATTN_CUDA_KERNELS=wgmma sends these
    small grids to it): (batch, len, heads, dim) queries, keys / values a slice of a longer cache in that
    layout (GQA). The forward gives the bits of contiguous copies, and the reference's answers."""
    b, h, hk, lq, lk, e = 2, 4, 2, 200, 300, head_dim
    q = torch.randn(b, lq, h, e, dtype=dtype, device=device).transpose(1, 2)
    cache_k, cache_v = (torch.randn(b, 512, hk, e, dtype=dtype, device=device) for _ in range(2))
    k, v = (c[:, 100:100 + lk].transpose(1, 2) for c in (cache_k, cache_v))
    out, lse = ours(q, k, v, e**-0.5, causal)
    out_c, lse_c = ours(q.contiguous(), k.contiguous(), v.contiguous(), e**-0.5, causal)
    assert torch.equal(out, out_c) and torch.equal(lse, lse_c)
    check_against_reference(q, k, v, e**-0.5, causal)


@pytest.mark.parametrize("head_dim", [96, 128])
def test_decode_from_a_cache_slice(device, head_dim):
    """A decode step as a server runs it: one query row per head of (batch, len, heads, dim) tensors,
    K / V the first 3000 positions of a preallocated 4096-position cache in the same layout, a GQA
    group of 4 (the fp16 / bf16 CUDA forward's decode kernel, swizzled at 128 and padded at 96).
    The views are read in place and give the forward bits of contiguous copies (the backward's dQ
    adds over key tiles with atomics: checked against the reference only)."""
    b, h, hk, e = 2, 8, 2, head_dim
    q = torch.randn(b, 1, h, e, dtype=torch.bfloat16, device=device).transpose(1, 2)
    cache_k, cache_v = (torch.randn(b, 4096, hk, e, dtype=torch.bfloat16, device=device) for _ in range(2))
    k, v = cache_k[:, :3000].transpose(1, 2), cache_v[:, :3000].transpose(1, 2)
    out, lse = ours(q, k, v, e**-0.5, BOTTOM_RIGHT)
    out_c, lse_c = ours(q.contiguous(), k.contiguous(), v.contiguous(), e**-0.5, BOTTOM_RIGHT)
    assert torch.equal(out, out_c) and torch.equal(lse, lse_c)
    assert _is_blhe(out) and lse.is_contiguous()
    check_against_reference(q, k, v, e**-0.5, BOTTOM_RIGHT)
    _assert_no_copies(lambda: ours(q, k, v, e**-0.5, BOTTOM_RIGHT))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("causal", [NONE, BOTTOM_RIGHT], ids=["none", "bottom_right"])
def test_packed_qkv_slices(device, dtype, causal):
    b, l, h, e = 2, 45, 4, 32
    qkv = torch.randn(b, l, 3, h, e, dtype=dtype, device=device, requires_grad=True)
    q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
    assert q.stride() == (l * 3 * h * e, e, 3 * h * e, 1)
    out, lse = ours(q, k, v, e**-0.5, causal)
    assert _is_blhe(out) and lse.is_contiguous()
    dout = torch.randn_like(out)
    out.backward(dout)
    _assert_no_copies(lambda: ours(q.detach(), k.detach(), v.detach(), e**-0.5, causal))

    ref = _grads_of_op(q.contiguous(), k.contiguous(), v.contiguous(), e**-0.5, causal, dout.contiguous())
    assert torch.equal(out, ref["out"]) and torch.equal(lse, ref["lse"])
    expected_grad = torch.stack([ref[n].transpose(1, 2) for n in ("dq", "dk", "dv")], dim=2)
    assert torch.equal(qkv.grad, expected_grad)
    check_against_reference(q.detach(), k.detach(), v.detach(), e**-0.5, causal)


def test_other_strides(device):
    """Sequence slices of a longer buffer, every other head, and a batch-broadcast key/value."""
    big = torch.randn(2, 6, 80, 32, dtype=torch.float32, device=device)
    q = big[:, ::2, 5:45]                       # head stride 2 * 80 * 32, offset storage
    k1 = torch.randn(1, 3, 60, 32, dtype=torch.float32, device=device)
    v1 = torch.randn(1, 3, 60, 24, dtype=torch.float32, device=device)
    k, v = k1.expand(2, -1, -1, -1), v1.expand(2, -1, -1, -1)   # batch stride 0
    dout = torch.randn(2, 3, 40, 24, device=device)
    for causal in CAUSAL_MODES:
        strided = _grads_of_op(q, k, v, 0.3, causal, dout)
        contiguous = _grads_of_op(q.contiguous(), k.contiguous(), v.contiguous(), 0.3, causal, dout)
        _assert_same_results(strided, contiguous)
        check_against_reference(q, k, v, 0.3, causal)
        _assert_no_copies(lambda: ours(q, k, v, 0.3, causal))


# ---- empty problems ----

@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", CAUSAL_MODES, ids=CAUSAL_IDS)
@pytest.mark.parametrize("shape_q,shape_k", [((0, 2, 5, 16), (0, 2, 7, 16)),   # batch 0
                                             ((2, 0, 5, 16), (2, 0, 7, 16)),   # heads 0
                                             ((2, 2, 0, 16), (2, 2, 7, 16)),   # len_q 0
                                             ((2, 2, 5, 16), (2, 1, 0, 16)),   # len_k 0
                                             ((2, 2, 0, 16), (2, 2, 0, 16))])
def test_empty(device, dtype, causal, shape_q, shape_k):
    q = torch.randn(shape_q, dtype=dtype, device=device, requires_grad=True)
    k = torch.randn(shape_k, dtype=dtype, device=device, requires_grad=True)
    v = torch.randn(shape_k[:3] + (8,), dtype=dtype, device=device, requires_grad=True)
    out, lse = ours(q, k, v, 0.25, causal)
    assert out.shape == shape_q[:3] + (8,) and out.dtype == dtype
    assert lse.shape == shape_q[:3] and lse.dtype == lse_dtype(dtype)
    # With no keys every row is fully masked.
    assert torch.all(out == 0)
    if shape_k[2] == 0:
        assert torch.all(lse == float("-inf"))
    (out.sum() + lse.clamp(min=-1).sum()).backward()
    for t in (q, k, v):
        assert t.grad.shape == t.shape and torch.all(t.grad == 0)


def test_lse_is_natural_log(device):
    """lse = log(sum_j exp(scale * q.k_j)), checked on a case computable by hand."""
    q = torch.ones(1, 1, 1, 4, dtype=torch.float64, device=device)
    k = torch.zeros(1, 1, 3, 4, dtype=torch.float64, device=device)
    k[0, 0, 0] = 1.0
    v = torch.eye(3, dtype=torch.float64, device=device).view(1, 1, 3, 3)
    out, lse = ours(q, k, v, 0.5, NONE)
    expected_lse = math.log(math.exp(2.0) + 2.0)
    assert lse.item() == pytest.approx(expected_lse, rel=1e-14)
    expected = torch.tensor([math.exp(2.0), 1.0, 1.0], dtype=torch.float64) / (math.exp(2.0) + 2.0)
    torch.testing.assert_close(out.view(3).cpu(), expected, rtol=1e-14, atol=0)

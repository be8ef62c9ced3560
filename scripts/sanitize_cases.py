"""A small representative set of CUDA forward and backward calls for compute-sanitizer
(memcheck, racecheck): ragged lengths, both causal alignments, GQA, every dtype, and both the
tensor-core (sm80/, sm90/) and the SIMT kernels (run it again with FLASHATTN_CUDA_KERNELS=simt), plain
and with the optional features. Arguments FIRST [LAST]: only CASES[FIRST:LAST]; "fp8": only the float8 forward's
calls; "kvcache": only flash_attn_with_kvcache steps."""
import sys

import torch

import flashattn_ext  # noqa: F401

CASES = [  # (dtype, batch, heads_q, heads_kv, len_q, len_k, head_dim, head_dim_v, causal)
    (torch.float32, 1, 2, 1, 77, 129, 64, 64, 0),
    (torch.float32, 1, 2, 2, 150, 200, 100, 128, 1),  # fp32 dim 128: warp-specialized forward, ragged, E < 128
    (torch.bfloat16, 2, 2, 2, 130, 65, 128, 128, 2),
    (torch.float16, 1, 4, 2, 200, 150, 64, 64, 1),  # the 2-D dK/dV kernel at dim 64, two blocks per SM (GQA, ragged)
    (torch.bfloat16, 1, 2, 1, 1030, 150, 64, 64, 2),  # ... and its 8-warp form (more than 1024 query rows)
    (torch.float16, 1, 4, 2, 33, 33, 80, 80, 1),
    (torch.float16, 1, 2, 1, 77, 100, 64, 48, 0),  # forward output staged through smem, E_v < the tier's dim
    (torch.bfloat16, 1, 2, 2, 140, 190, 96, 96, 1),  # the 2-D dK/dV kernel at dim 96
    (torch.bfloat16, 2, 2, 1, 100, 75, 24, 32, 0),
    (torch.bfloat16, 1, 2, 1, 150, 97, 176, 192, 1),
    (torch.bfloat16, 1, 2, 1, 90, 150, 256, 256, 1),  # the 2-D dK/dV kernel at dim 256 (3 key tiles)
    # One barrier per query tile (Bwd2dConfig::kOneSync), each key tile walking 6+ query tiles
    # over a GQA group: the ring of three at 96 and 128, the mbarrier-tracked copies at 256.
    (torch.bfloat16, 1, 2, 1, 200, 450, 96, 96, 2),
    (torch.float16, 1, 4, 2, 300, 200, 128, 128, 0),
    (torch.bfloat16, 1, 2, 1, 333, 333, 256, 256, 1),
    # The last wave split (sm80 tail_split.cuh): grids of 2 blocks, each walk cut into parts over a
    # GQA group, dK / dV through the fp32 tail area; 8-warp dim 64, the ring of three at 128, the
    # tracked copies at 256.
    (torch.bfloat16, 1, 2, 1, 2100, 150, 64, 64, 0),
    (torch.bfloat16, 1, 2, 1, 1100, 130, 128, 128, 0),
    (torch.float16, 1, 2, 1, 1100, 100, 256, 256, 0),
    # The forward's split key walks (sm80 key_split.cuh): at dim 128 4 walks of 66 key tiles cut
    # into parts over a GQA group, and 17 rows (bottom-right) with E_v below the tier's dim.
    (torch.bfloat16, 1, 4, 2, 45, 4200, 128, 128, 0),
    (torch.float16, 1, 2, 2, 17, 4200, 128, 100, 2),
    (torch.bfloat16, 1, 2, 1, 20, 5000, 256, 256, 0),  # ... at dims 256 and 64: the split kernels
    (torch.float16, 1, 2, 2, 17, 5000, 64, 48, 2),
    (torch.float64, 1, 2, 2, 50, 70, 128, 128, 0),  # warp pairs (fp64 dim 128)
    # The decode kernel (sm80 fwd_decode.cuh): a GQA decode step in parts over 5000 keys; 3 rows of
    # 20 heads in 2 chunks that span heads (warp pairs), E_v below the tier's dim; top-left rows at dim 256;
    # the padded tiles at dims 96 and 192 (an MQA step in warp pairs: the last case).
    (torch.bfloat16, 1, 8, 2, 1, 5000, 128, 128, 0),
    (torch.float16, 1, 20, 1, 3, 1500, 64, 48, 2),
    (torch.bfloat16, 1, 4, 4, 5, 3000, 256, 256, 1),
    (torch.float16, 1, 6, 2, 2, 2500, 96, 96, 2),
    (torch.bfloat16, 1, 4, 1, 1, 3000, 192, 128, 0),
    (torch.float64, 1, 1, 1, 17, 40, 256, 32, 2),
    (torch.float64, 1, 2, 1, 70, 45, 64, 48, 1),
    (torch.float64, 1, 2, 1, 150, 260, 64, 64, 2),  # fp64 dim 64: 8 warps, several key tiles
    # The wgmma forward on sm_90 (sm90/fwd_ws_sm90.cuh; run with FLASHATTN_CUDA_KERNELS=wgmma, which
    # sends these small grids to it): ragged query and key tiles, GQA, both causal alignments. (On sm_90
    # every plain dim-64 / 96 / 128 / 256 case above runs the wgmma dK/dV kernel, sm90/bwd_sm90.cuh, by default;
    # FLASHATTN_CUDA_KERNELS=sm80 sends them to the sm80/ kernels their comments name.)
    (torch.bfloat16, 1, 4, 2, 200, 300, 128, 128, 1),
    (torch.float16, 1, 2, 1, 150, 333, 256, 256, 2),
    (torch.bfloat16, 1, 4, 2, 300, 700, 64, 64, 1),  # the warp-specialized one at dim 64 (fwd_ws_sm90.cuh)
    # ... persistent (non-causal grids of more blocks than SMs: 2-3 items per block, the Q buffers reused)
    (torch.bfloat16, 1, 100, 50, 400, 300, 128, 128, 0),
    (torch.float16, 1, 70, 10, 390, 1030, 64, 64, 0),
    # ... at dim 256 (one Q buffer, released after an item's last S): persistent, and rows that see no key
    # (bottom-right causal, 400 rows against 100 keys: two items without a key tile).
    (torch.float16, 1, 140, 20, 300, 200, 256, 256, 0),
    (torch.bfloat16, 1, 4, 2, 400, 100, 256, 256, 2),
    # ... with three consumers (dim 64, rows that see >= 2048 keys): 200 rows leave two consumers no row in
    # the second 192-row item; persistent with 400 rows (the third item: one consumer's rows).
    (torch.bfloat16, 1, 4, 2, 200, 2500, 64, 64, 2),
    (torch.float16, 1, 150, 50, 400, 2100, 64, 64, 0),
    # ... causal grids larger than the GPU with few query tiles per head, persistent in pairs of a heavy and
    # a light tile (schedule/causal_order.cuh): 3 tiles (two heads' middle tiles paired) of an odd head count,
    # 5 bottom-right over GQA, 16 at dim 64 (items carried into each other); forward only.
    (torch.bfloat16, 1, 135, 135, 300, 300, 128, 128, 1, "forward"),
    (torch.float16, 1, 45, 15, 600, 900, 128, 128, 2, "forward"),
    (torch.bfloat16, 1, 20, 10, 2000, 2100, 64, 64, 2, "forward"),
    # The warp-specialized dK/dV kernel on sm_90 (sm90/bwd_sm90.cuh) with query lengths a multiple
    # of 16: dQ tiles through smem and the bulk reduce-add (other lengths: the consumers' atomics), GQA,
    # ragged key tiles; dims 128 and 64.
    (torch.bfloat16, 2, 4, 2, 256, 200, 128, 128, 1),
    (torch.float16, 1, 2, 1, 320, 150, 64, 64, 0),
    # ... bottom-right causal with 416 more rows than keys: whole query tiles that no key tile visits, then
    # tiles visited by one and two key tiles, over a GQA group.
    (torch.bfloat16, 1, 4, 2, 544, 128, 128, 128, 2),
    (torch.float16, 1, 4, 2, 544, 200, 64, 64, 2),
    # ... at dim 256 (the consumers split the dims, P^T and dS^T through smem, dQ by atomics): GQA, ragged,
    # bottom-right causal; a key tile that walks 6 query tiles of each head.
    (torch.bfloat16, 1, 4, 2, 200, 330, 256, 256, 2),
    (torch.float16, 2, 2, 2, 384, 100, 256, 256, 0),
    # ... at dim 96 (two 64-dim panels, the second half TMA's zero fill): dQ by atomics (200 rows), staged (256).
    (torch.bfloat16, 1, 4, 2, 200, 330, 96, 96, 2),
    (torch.float16, 2, 2, 2, 256, 150, 96, 96, 0),
    # A key padding mask (a bias (batch or 1, 1, 1, len_k), its last field: bool, float in the dtype, float32;
    # "1": broadcast over the batch) on the Hopper kernels (sm90/key_bias.cuh; the forward with
    # FLASHATTN_CUDA_KERNELS=wgmma): ragged key tiles, GQA, rows that see no key (batch 0's first keys masked),
    # the forward's bias ring carried over persistent items (dims 128, 64 with items carried), three consumers
    # at dim 64 with an idle one, dQ staged (256 rows) and by atomics.
    (torch.bfloat16, 2, 4, 2, 200, 330, 128, 128, 2, "bool"),
    (torch.float16, 1, 2, 1, 150, 333, 256, 256, 0, "float32"),
    (torch.bfloat16, 1, 4, 2, 300, 2500, 64, 64, 2, "float"),
    (torch.float16, 2, 4, 2, 256, 150, 96, 96, 0, "bool1"),
    (torch.bfloat16, 1, 100, 50, 400, 300, 128, 128, 0, "bool"),
    (torch.float16, 1, 70, 10, 390, 1030, 64, 64, 0, "float"),
    # Any other bias ("rows-<dtype>-<form>": the form's batch / heads broadcast, 1 where broadcast; BH1 without
    # query rows) on the Hopper kernels' row forms (the forward's bias tiles by TMA at dims 128 and 256, one Q
    # buffer released early, and at 64; the backward's register loads at 128 and 256): ragged query and key
    # tiles, rows whose keys are all masked (5 and 6), GQA, both causal alignments, broadcast heads or batch,
    # bools at 64 keys a tile (dim 256: 64-byte swizzled boxes), persistent items at 128 and 256; float32 and a bias
    # without query rows (the forward on sm80/, the backward's row form).
    (torch.bfloat16, 2, 4, 2, 200, 330, 128, 128, 2, "rows-bool-1H"),
    (torch.float16, 1, 2, 1, 150, 334, 256, 256, 0, "rows-float-BH"),
    (torch.bfloat16, 1, 4, 2, 130, 333, 256, 256, 1, "rows-bool-B1"),
    (torch.bfloat16, 1, 100, 50, 400, 300, 128, 128, 0, "rows-float-B1"),
    (torch.float16, 1, 140, 20, 300, 200, 256, 256, 0, "rows-bool-11"),
    (torch.bfloat16, 2, 2, 2, 130, 333, 128, 128, 0, "rows-float32-BH"),
    (torch.float16, 1, 4, 2, 200, 300, 128, 128, 2, "rows-bool-BH1"),
    # ... at dim 64 (two Q buffers, an item's last P V issued with the next item's first S): persistent items.
    (torch.bfloat16, 1, 4, 2, 130, 333, 64, 64, 1, "rows-bool-B1"),
    (torch.float16, 1, 140, 20, 300, 200, 64, 64, 0, "rows-float-BH"),
    # (the decode kernel's warp pairs: an MQA step of 56 query heads, 24 rows of a second chunk, enough key
    # tiles for 32-row chunks: 4 x 4 walks of 16 rows x 938 tiles, over 96 per SM up to 156 SMs; forward only)
    (torch.bfloat16, 4, 56, 1, 1, 60000, 128, 128, 0, "forward"),
]


def key_mask(kind, b, lq, lk, dtype):
    """A (b or 1, 1, 1, lk) key mask of `kind` (see CASES) whose batch 0 masks its first lk - lq / 2 keys:
    under a bottom-right causal mask its first rows see no key."""
    keep = torch.rand(1 if kind.endswith("1") else b, 1, 1, lk, device="cuda") > 0.3
    keep[0, ..., : max(lk - lq // 2, 0)] = False
    if kind.startswith("bool"):
        return keep
    bias = torch.randn(keep.shape, device="cuda", dtype=torch.float32 if kind == "float32" else dtype)
    return bias.masked_fill(~keep, float("-inf"))


def row_bias(kind, b, hq, lq, lk, dtype):
    """A bias of kind "rows-<dtype>-<form>" (see CASES): keys kept at random (70%), rows 5 and 6 of each head
    masked whole (forms with query rows); rows of lk keys stored 16 elements apart at most (padded to a
    multiple of 16: the Hopper forward's tensor map steps them)."""
    _, dt, form = kind.split("-")
    shape = (b if "B" in form else 1, hq if "H" in form else 1, 1 if form == "BH1" else lq, -(-lk // 16) * 16)
    keep = (torch.rand(shape, device="cuda") > 0.3)[..., :lk]
    if shape[2] > 1:
        keep[:, :, 5:7] = False
    if dt == "bool":
        return keep
    bias = torch.randn(shape, device="cuda", dtype=torch.float32 if dt == "float32" else dtype)[..., :lk]
    return bias.masked_fill_(~keep, float("-inf"))  # (in place: the view's strides kept)


def float8_cases():
    """The sm_90 float8 forward (e4m3, dim 128): ragged lengths, bottom-right causal with rows that see
    no key, GQA, per-head descales, and a non-causal grid larger than the GPU (persistent blocks)."""
    from flashattn_ext.functional import flash_attn_func

    def fp8(*shape):
        return torch.randn(*shape, device="cuda").clamp(-8, 8).to(torch.float8_e4m3fn)
    for b, lq, lk, hq, hk, causal in ((1, 200, 150, 4, 2, True), (2, 130, 333, 2, 1, False), (8, 1024, 700, 32, 8, False)):
        descale = torch.rand(b, hk, device="cuda") + 0.5
        flash_attn_func(fp8(b, lq, hq, 128), fp8(b, lk, hk, 128), fp8(b, lk, hk, 128), causal=causal,
                        q_descale=descale, k_descale=0.5, v_descale=descale)


def kvcache_cases(device="cuda"):
    """flash_attn_with_kvcache steps: the decode kernel appending the new rows itself (steps without rotary
    tables), or after the append's launch (rotary: a warp per head; the decode kernel a dependent launch), its walks
    in parts (on sm_90 a cluster a walk in the third and fifth steps, caches of at most 16 tiles;
    elsewhere the parts added by the combine kernel, a dependent launch too, a warp a row in the last step's 4
    parts; on sm_90 the last two steps' 33 walks in 4 parts of a block an SM with the deep ring;
    FLASHATTN_CUDA_KERNELS=sm80 keeps every step off clusters and the deep ring): GQA and MHA dense steps, paged steps
    with a ragged batch and left padding (row copies) and from each cache's first key (pages of 256, whole-tile
    copies, and of 16, four to a tile), rotary tables (q rotated in the append), head dim 40, two rows per step,
    read-only steps (no append: the decode kernel checks the pages), and steps whose last sequence has no room for
    its rows."""
    from flashattn_ext import flash_attn_with_kvcache
    gen = torch.Generator(device=device).manual_seed(0)
    # (batch, heads_q, heads_kv, head dim, cache, rows, paged: None, "leftpad", "from 0" or "pages of 16", rotary)
    steps = ((2, 8, 2, 128, 3000, 1, None, False), (1, 4, 4, 64, 5000, 1, None, True),
             (3, 6, 2, 128, 1024, 2, "leftpad", False), (2, 8, 1, 128, 4096, 1, "from 0", False),
             (2, 4, 1, 40, 700, 1, None, False), (8, 16, 8, 128, 3000, 1, None, False),
             (3, 33, 11, 128, 6400, 1, None, True), (3, 33, 11, 96, 6400, 1, "leftpad", False),
             (3, 16, 4, 128, 2048, 1, "pages of 16", False))
    for b, hq, hk, e, cache, lq, paged, rotary in steps:
        randn = lambda *s: torch.randn(*s, generator=gen, device=device, dtype=torch.bfloat16)
        q, k, v = randn(b, lq, hq, e), randn(b, lq, hk, e), randn(b, lq, hk, e)
        seqlens = torch.tensor([cache - lq - 7 * i for i in range(b)], dtype=torch.int32, device=device)
        kw = {}
        if paged:
            page = 16 if paged == "pages of 16" else 256
            k_cache, v_cache = randn(b * cache // page, page, hk, e), randn(b * cache // page, page, hk, e)
            kw["block_table"] = torch.randperm(b * cache // page, device=device).view(b, -1).to(torch.int32)
            if paged == "leftpad":
                kw["cache_leftpad"] = torch.tensor([0] + [100] * (b - 1), dtype=torch.int32, device=device)
        else:
            k_cache, v_cache = randn(b, cache, hk, e), randn(b, cache, hk, e)
        if rotary:
            angle = torch.rand(cache, e // 2, generator=gen, device=device)
            kw.update(rotary_cos=angle.cos(), rotary_sin=angle.sin(), causal=True)
        flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, **kw)
        if not rotary:  # a read-only step: no append (paged: the decode kernel checks the pages itself)
            flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, **kw)
        if not rotary and b > 1:  # the last sequence refused (no room for its rows): it must write nothing
            seqlens[-1] = cache - lq + 1
            flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, **kw)


if sys.argv[1:] in (["fp8"], ["kvcache"]):
    float8_cases() if sys.argv[1] == "fp8" else kvcache_cases()
    torch.cuda.synchronize()
    sys.exit(0)

bounds = [int(x) for x in sys.argv[1:3]]
for dtype, b, hq, hk, lq, lk, e, ev, causal, *mask in CASES[slice(*bounds) if bounds else slice(None)]:
    q = torch.randn(b, hq, lq, e, device="cuda", dtype=dtype)
    k = torch.randn(b, hk, lk, e, device="cuda", dtype=dtype)
    v = torch.randn(b, hk, lk, ev, device="cuda", dtype=dtype)
    forward_only = mask == ["forward"]
    if forward_only or not mask:
        bias = None
    elif mask[0].startswith("rows"):
        bias = row_bias(mask[0], b, hq, lq, lk, dtype)
    else:
        bias = key_mask(mask[0], b, lq, lk, dtype)
    out, lse = torch.ops.flashattn.fwd(q, k, v, e ** -0.5, causal, attn_bias=bias)
    if forward_only:
        continue
    dout = torch.randn_like(out)
    for deterministic in (False, True):
        torch.ops.flashattn.bwd(dout, q, k, v, out, lse, None, e ** -0.5, causal, deterministic, attn_bias=bias)
if bounds:
    sys.exit(0)

# The fp32 dim-128 forward with two query tiles per block (a grid of >= 4 x 132 query tiles); forward
# only, since racecheck takes minutes over the backward of so many heads.
q, k, v = (torch.randn(33, 8, 129, 128, device="cuda") for _ in range(3))
torch.ops.flashattn.fwd(q, k, v, 128 ** -0.5, 1)

# The optional features (tensor-core kFeatures variants for fp16/bf16/fp64, SIMT for fp32):
# float bias with its gradient + dropout + window + softcap + ALiBi, and a varlen batch.
from flashattn_ext import flash_attn_varlen_func, scaled_dot_product_attention  # noqa: E402
from flashattn_ext.functional import flash_attn_func  # noqa: E402

for dtype in (torch.bfloat16, torch.float64, torch.float32):
    q, k, v = (torch.randn(1, 2, 70, 64, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    bias = torch.randn(1, 2, 70, 70, device="cuda", dtype=dtype, requires_grad=True)
    scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=0.2).sum().backward()
    q4, k4, v4 = (torch.randn(2, 90, 2, 128, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    slopes = torch.rand(2, device="cuda", dtype=torch.float32)
    flash_attn_func(q4, k4, v4, causal=True, window_size=(40, 0), softcap=5.0, alibi_slopes=slopes,
                    deterministic=True).sum().backward()
    cu = torch.tensor([0, 33, 33, 130], device="cuda", dtype=torch.int32)
    qv, kv, vv = (torch.randn(130, 2, 64, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    flash_attn_varlen_func(qv, kv, vv, cu, cu, 97, 97, causal=True).sum().backward()
    if dtype == torch.bfloat16:  # the 2-D dK/dV kernel with a bool mask, then with a window
        q6, k6, v6 = (torch.randn(1, 2, 150, 128, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
        keep = torch.rand(1, 1, 150, 150, device="cuda") > 0.2
        scaled_dot_product_attention(q6, k6, v6, attn_mask=keep).sum().backward()
        flash_attn_func(q6.transpose(1, 2), k6.transpose(1, 2), v6.transpose(1, 2), window_size=(50, 20)).sum().backward()
    if dtype == torch.bfloat16:  # the general variant above dim 128: warp pairs
        q5, k5, v5 = (torch.randn(1, 75, 2, 160, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
        flash_attn_func(q5, k5, v5, causal=True, softcap=5.0).sum().backward()
if torch.cuda.get_device_capability() == (9, 0):
    float8_cases()
torch.cuda.synchronize()
print("sanitize_cases: done")

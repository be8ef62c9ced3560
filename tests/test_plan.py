"""The kernel plan (csrc/cuda/plan.cpp): which CUDA kernel each call runs on, asked on CPU tensors with
faked GPUs through flashattn_ext.kernel_plan. The table is the one docs/architecture.md documents."""
import pytest
import torch

from flashattn_ext import kernel_plan
from flashattn_ext.ops import CAUSAL_BOTTOM_RIGHT, CAUSAL_NONE, CAUSAL_TOP_LEFT

H100 = {"arch": (9, 0), "sms": 132, "smem": 232448}
H100_NO_SM90A = dict(H100, sm90a=False)  # a build without sm_90a code
A100 = {"arch": (8, 0), "sms": 108, "smem": 166912}
RTX = {"arch": (8, 6), "sms": 84, "smem": 101376}
T4 = {"arch": (7, 5), "sms": 40, "smem": 65536}
B200 = {"arch": (10, 0), "sms": 148, "smem": 232448}
GPUS = {"sm90": H100, "sm90_no_sm90a": H100_NO_SM90A, "sm80": A100, "sm86": RTX, "sm75": T4, "sm100": B200}


def qkv(dim, dtype=torch.bfloat16, batch=4, heads=16, len_q=4096, len_k=None, heads_kv=None, dim_v=None):
    """Uninitialised (batch, heads, len, dim) tensors: the plan reads shapes, strides and addresses only."""
    q = torch.empty(batch, heads, len_q, dim, dtype=dtype)
    k = torch.empty(batch, heads_kv or heads, len_k or len_q, dim, dtype=dtype)
    v = torch.empty(batch, heads_kv or heads, len_k or len_q, dim_v or dim, dtype=dtype)
    return q, k, v


def plan(dim, gpu, causal=CAUSAL_NONE, backward=False, dtype=torch.bfloat16, shape=None, **kw):
    q, k, v = qkv(dim, dtype, **(shape or {}))
    return kernel_plan(q, k, v, causal, backward=backward, device=GPUS[gpu], kernels=kw.pop("kernels", ""),
                       smem_limit=kw.pop("smem_limit", ""), **kw)


# Forward, bf16 (fp16 plans the same), B=4, H=16, L=4096 (a grid larger than every GPU), per head dim.
FWD_HALF = {
    #      sm90                sm90 without sm_90a sm80 (163 KB)    sm86 (99 KB)     sm75        sm100
    32: ("sm80_plain/32", "sm80_plain/32", "sm80_plain/32", "sm80_plain/32", "simt/32", "sm80_plain/32"),
    64: ("sm90_wgmma_ws3/64", "sm80_plain/64", "sm80_plain/64", "sm80_plain/64", "simt/64", "sm80_plain/64"),
    96: ("sm90_wgmma_ws/96", "sm80_plain/96", "sm80_plain/96", "sm80_plain/96", "simt/128", "sm80_plain/96"),
    128: ("sm90_wgmma_ws/128", "sm80_plain/128", "sm80_plain/128", "sm80_plain/128", "simt/128", "sm80_plain/128"),
    192: ("sm80_plain/192", "sm80_plain/192", "sm80_plain/192", "sm80_plain/192", "simt/256", "sm80_plain/192"),
    256: ("sm90_wgmma_ws/256", "sm80_plain/256", "sm80_plain/256", "sm80_plain/256", "simt/256", "sm80_plain/256"),
}
# The dK/dV step of the backward, same calls.
BWD_HALF = {
    32: ("sm80_plain/32", "sm80_plain/32", "sm80_plain/32", "sm80_plain/32", "simt/32", "sm80_plain/32"),
    64: ("sm90_wgmma/64", "sm80_2d/64", "sm80_plain/64", "sm80_plain/64", "simt/64", "sm80_2d/64"),
    96: ("sm90_wgmma/96", "sm80_2d_one_sync/96", "sm80_2d/96", "sm80_general/96", "simt/128",
         "sm80_2d_one_sync/96"),
    128: ("sm90_wgmma/128", "sm80_2d_one_sync/128", "sm80_2d/128", "sm80_compact/128", "simt/128",
          "sm80_2d_one_sync/128"),
    192: ("sm80_plain/192", "sm80_plain/192", "sm80_plain/192", "sm80_compact/192", "simt/128x2", "sm80_plain/192"),
    256: ("sm90_wgmma/256", "sm80_2d_one_sync/256", "sm80_compact/256", "sm80_compact/256", "simt/128x2",
          "sm80_2d_one_sync/256"),
}


@pytest.mark.parametrize("dim", sorted(FWD_HALF))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_routing(dim, dtype):
    for gpu, fwd, bwd in zip(GPUS, FWD_HALF[dim], BWD_HALF[dim]):
        assert plan(dim, gpu, dtype=dtype) == fwd, (gpu, "forward")
        assert plan(dim, gpu, dtype=dtype, backward=True) == bwd, (gpu, "backward")


def test_dims_between_tiers_run_the_upper_tier():
    assert plan(80, "sm80") == "sm80_plain/96"
    assert plan(72, "sm80", backward=True) == "sm80_2d/96"
    assert plan(160, "sm90") == "sm80_plain/192"
    # E != E_v: the tier of the larger; the Hopper kernels take E == E_v only.
    assert plan(64, "sm90", shape=dict(dim_v=128)) == "sm80_plain/128"
    assert plan(128, "sm90", shape=dict(dim_v=64)) == "sm80_plain/128"


def test_fp32_stays_on_simt():
    # TF32x3 P V on sm_80+: the warp-specialized kernel at 128 where 202 KB fit, Q-resident with 128-key
    # tiles at 64 where 209 KB fit, else 64-key tiles; FMA where the tensor cores are off.
    assert plan(128, "sm90", dtype=torch.float32) == "simt_ws/128"
    assert plan(64, "sm90", dtype=torch.float32) == "simt_qres/64 tf32x128"
    assert plan(64, "sm80", dtype=torch.float32) == "simt_qres/64 tf32x64"
    assert plan(64, "sm90", dtype=torch.float32, kernels="simt") == "simt_qres/64"
    assert plan(64, "sm86", dtype=torch.float32) == "simt/64"
    assert plan(256, "sm90", dtype=torch.float32) == "simt/256"
    assert plan(64, "sm90", dtype=torch.float32, backward=True) == "simt_kvres/64"
    assert plan(128, "sm80", dtype=torch.float32, backward=True) == "simt/128"
    assert plan(256, "sm90", dtype=torch.float32, backward=True) == "simt/128x2"


def test_fp64():
    # Forward 108 / 204 KB at dims 64 / 128: on 163 KB the dim-128 forward runs SIMT, on 99 KB every fp64 kernel.
    # The fp64 SIMT kernels have one tier each way: the forward's 128, the backward's 64.
    assert [plan(64, g, dtype=torch.float64) for g in ("sm90", "sm80", "sm86")] == ["sm80_plain/64", "sm80_plain/64",
                                                                                      "simt/128"]
    assert plan(32, "sm86", dtype=torch.float64) == "simt/128"
    assert plan(32, "sm86", dtype=torch.float64, backward=True) == "simt/64"
    assert [plan(128, g, dtype=torch.float64) for g in ("sm90", "sm80", "sm86")] == ["sm80_plain/128", "simt/128",
                                                                                       "simt/128"]
    # dK/dV 204.5 / 159 KB: at 64 on 163 KB the general variant's smaller tiles.
    assert [plan(64, g, dtype=torch.float64, backward=True) for g in ("sm90", "sm80", "sm86")] == [
        "sm80_plain/64", "sm80_general/64", "simt/64"]
    assert plan(128, "sm80", dtype=torch.float64, backward=True) == "sm80_plain/128"
    assert plan(256, "sm90", dtype=torch.float64) == "simt/128x2"
    assert plan(256, "sm90", dtype=torch.float64, backward=True) == "simt/64x4"


def test_hopper_forward_by_shape():
    small = dict(batch=1, heads=1)
    assert plan(128, "sm90", shape=dict(len_q=512)) == "sm90_wgmma_ws/128"
    assert plan(128, "sm90", shape=dict(len_q=256)) == "sm80_plain/128"  # rows see < 512 keys
    assert plan(128, "sm90", shape=dict(small, len_q=4096)) == "sm80_plain/128"  # fewer blocks than SMs
    assert plan(128, "sm90", CAUSAL_TOP_LEFT) == "sm90_wgmma_ws/128"
    # Dim 64: two consumer warpgroups below 2048 keys per row, three from there.
    assert plan(64, "sm90", shape=dict(len_q=1024)) == "sm90_wgmma_ws/64"
    assert plan(64, "sm90", shape=dict(len_q=1024, len_k=2048)) == "sm90_wgmma_ws3/64"
    assert plan(64, "sm90", shape=dict(small, len_q=300, len_k=3000), kernels="wgmma") == "sm90_wgmma_ws3/64"
    assert plan(64, "sm90", shape=dict(small, len_q=300, len_k=1000), kernels="wgmma") == "sm90_wgmma_ws/64"
    # Causal at 64: the warp-specialized kernel from 256 mean visible keys, three consumers from 2048.
    assert plan(64, "sm90", CAUSAL_TOP_LEFT, shape=dict(len_q=256, heads=32)) == "sm80_plain/64"  # 128 on average
    assert plan(64, "sm90", CAUSAL_TOP_LEFT, shape=dict(len_q=512)) == "sm90_wgmma_ws/64"  # 256 on average
    assert plan(64, "sm90", CAUSAL_TOP_LEFT, shape=dict(len_q=1024)) == "sm90_wgmma_ws/64"  # 512 on average
    assert plan(64, "sm90", CAUSAL_TOP_LEFT, shape=dict(len_q=2048)) == "sm90_wgmma_ws/64"  # 1024 on average
    assert plan(64, "sm90", CAUSAL_TOP_LEFT, shape=dict(len_q=4096)) == "sm90_wgmma_ws3/64"
    assert plan(64, "sm90", CAUSAL_TOP_LEFT, shape=dict(len_q=1024, len_k=8192)) == "sm90_wgmma_ws/64"
    assert plan(64, "sm90", CAUSAL_BOTTOM_RIGHT, shape=dict(len_q=2048, len_k=8192)) == "sm90_wgmma_ws3/64"
    # Dim 256: from 512 keys per row, under a causal mask from 256 mean visible keys.
    assert plan(256, "sm90", shape=dict(len_q=512)) == "sm90_wgmma_ws/256"
    assert plan(256, "sm90", shape=dict(len_q=256)) == "sm80_plain/256"
    assert plan(256, "sm90", CAUSAL_TOP_LEFT, shape=dict(len_q=256, heads=32)) == "sm80_plain/256"  # 128 on average
    assert plan(256, "sm90", CAUSAL_TOP_LEFT, shape=dict(len_q=512)) == "sm90_wgmma_ws/256"  # 256 on average


def test_decode_steps():
    decode = dict(batch=2, heads=32, heads_kv=8, len_q=1, len_k=8192)
    for gpu in ("sm90", "sm80", "sm100"):
        assert plan(128, gpu, shape=decode) == "sm80_decode/128"
    # Three stages of 64-key tiles at dim 128 take 100 KB: not on a 99 KB GPU.
    assert plan(128, "sm86", shape=decode) == "sm80_plain/128"
    assert plan(64, "sm86", shape=decode) == "sm80_decode/64"
    assert plan(256, "sm80", shape=decode) == "sm80_decode/256"
    assert plan(64, "sm90", shape=dict(decode, len_q=16, heads_kv=16, heads=32)) == "sm80_decode/64"
    # More than 64 packed rows (len_q x group): the plain kernel.
    assert plan(64, "sm90", shape=dict(decode, len_q=16)) == "sm80_decode/64"  # 16 x 4 = 64
    assert plan(64, "sm90", shape=dict(decode, len_q=16, heads_kv=4)) == "sm80_plain/64"
    assert plan(64, "sm90", shape=dict(decode, len_q=17, heads_kv=32)) == "sm80_plain/64"
    assert plan(128, "sm90", shape=decode, window_left=64) == "sm80_features/128"
    assert plan(128, "sm75", shape=decode) == "simt/128"
    assert plan(128, "sm90", dtype=torch.float64, shape=decode) == "sm80_plain/128"


def test_kv_cache_calls():
    # Per-sequence key ranges: the decode kernel takes them; elsewhere they count as a feature.
    q, k, v = qkv(128, batch=4, heads=32, heads_kv=8, len_q=1, len_k=4096)
    used = torch.full((4,), 3000, dtype=torch.int32)
    assert kernel_plan(q, k, v, CAUSAL_BOTTOM_RIGHT, device=H100, kernels="", seqused_k=used) == "sm80_decode/128"
    q = torch.empty(4, 32, 2048, 128, dtype=torch.bfloat16)
    assert kernel_plan(q, k, v, CAUSAL_BOTTOM_RIGHT, device=H100, kernels="", seqused_k=used) == "sm80_features/128"
    # Pages (block_table): read in place by the decode kernel; every other kernel reads them gathered.
    pages = torch.empty(64, 8, 256, 128, dtype=torch.bfloat16)
    table = (torch.arange(4 * 16, dtype=torch.int32) % 64).reshape(4, 16)
    step = torch.empty(4, 32, 1, 128, dtype=torch.bfloat16)
    assert kernel_plan(step, pages, pages, CAUSAL_BOTTOM_RIGHT, device=H100, kernels="",
                       block_table=table) == "sm80_decode/128"
    assert kernel_plan(q, pages, pages, CAUSAL_BOTTOM_RIGHT, device=H100, kernels="",
                       block_table=table) == "sm90_wgmma_ws/128 on gathered pages"
    assert kernel_plan(step.float(), pages.float(), pages.float(), CAUSAL_BOTTOM_RIGHT, device=H100, kernels="",
                       block_table=table) == "simt_ws/128 on gathered pages"


def test_features():
    assert plan(128, "sm90", window_left=128, window_right=0) == "sm80_features/128"
    assert plan(128, "sm90", softcap=30.0) == "sm80_features/128"
    # A band or a bias: the 2-D backward's variant with them; softcap, ALiBi, dropout: the general step.
    assert plan(128, "sm90", backward=True, window_left=128) == "sm80_2d/128"
    assert plan(128, "sm90", backward=True, softcap=30.0) == "sm80_general/128"
    assert plan(128, "sm90", backward=True, dropout_p=0.1) == "sm80_general/128"
    assert plan(192, "sm90", backward=True, window_left=128) == "sm80_features/192"
    assert plan(128, "sm86", backward=True, softcap=30.0) == "sm80_compact/128"
    bias = torch.zeros(4, 16, 4096, 4096, dtype=torch.bfloat16)
    assert plan(128, "sm100", attn_bias=bias) == "sm80_features/128"
    assert plan(128, "sm100", backward=True, attn_bias=bias) == "sm80_2d/128"
    assert plan(128, "sm90", attn_bias=bias) == "sm90_wgmma_ws/128"  # (test_full_bias_on_sm90)
    assert plan(128, "sm90", backward=True, attn_bias=bias, bias_requires_grad=True) == "sm80_general/128"
    assert plan(64, "sm90", dtype=torch.float32, window_left=3) == "simt/64"
    assert plan(64, "sm90", dtype=torch.float32, backward=True, window_left=3) == "simt/64"


def test_key_vector_bias_on_sm90():
    # A key padding mask (a bias broadcast over the heads and query rows: (batch or 1, 1, 1, len_k)), bool or
    # float in the inputs' dtype or float32, without a bias gradient: the Hopper kernels at every dim they
    # serve, causal or not; elsewhere, or with any other feature, the sm80/ kernels' feature variants.
    masks = [torch.ones(4, 1, 1, 4096, dtype=torch.bool), torch.zeros(1, 1, 1, 4096, dtype=torch.bfloat16),
             torch.zeros(4, 1, 1, 4096, dtype=torch.float32)]
    for m in masks:
        for dim, fwd in [(64, "sm90_wgmma_ws3/64"), (96, "sm90_wgmma_ws/96"), (128, "sm90_wgmma_ws/128"),
                         (256, "sm90_wgmma_ws/256")]:
            assert plan(dim, "sm90", attn_bias=m) == fwd, (dim, m.shape, m.dtype)
            assert plan(dim, "sm90", backward=True, attn_bias=m) == f"sm90_wgmma/{dim}", (dim, m.shape, m.dtype)
        assert plan(128, "sm90", CAUSAL_TOP_LEFT, attn_bias=m) == "sm90_wgmma_ws/128"
        assert plan(128, "sm90", CAUSAL_BOTTOM_RIGHT, backward=True, attn_bias=m) == "sm90_wgmma/128"
        assert plan(128, "sm90", backward=True, deterministic=True, attn_bias=m) == "sm90_wgmma/128"
        assert plan(128, "sm90", shape=dict(heads_kv=4), attn_bias=m) == "sm90_wgmma_ws/128"  # GQA
        # the plain path's limits: rows that see fewer than 512 keys go to the sm80/ kernels
        assert plan(128, "sm90", shape=dict(len_k=256), attn_bias=m[..., :256]) == "sm80_features/128"
        assert plan(128, "sm80", attn_bias=m) == "sm80_features/128"
        assert plan(128, "sm90", attn_bias=m, kernels="sm80") == "sm80_features/128"
        assert plan(128, "sm90", attn_bias=m, window_left=100) == "sm80_features/128"
        assert plan(128, "sm90", backward=True, attn_bias=m, softcap=30.0) == "sm80_general/128"
        assert plan(192, "sm90", attn_bias=m) == "sm80_features/192"
    # float key masks with their gradient: the backward's general step
    for m in masks[1:]:
        assert plan(128, "sm90", backward=True, attn_bias=m, bias_requires_grad=True) == "sm80_general/128"
    # a bias per head, or per query row, is not a key vector (test_full_bias_on_sm90)
    per_head = torch.ones(4, 16, 1, 4096, dtype=torch.bool)
    per_row = torch.ones(4, 1, 4096, 4096, dtype=torch.bool)
    for m in (per_head, per_row):
        assert plan(96, "sm90", attn_bias=m) == "sm80_features/96"
        assert plan(96, "sm90", backward=True, attn_bias=m) == "sm80_2d/96"
    # a broadcast view of a key vector (stride 0 over heads and rows) is one
    assert plan(128, "sm90", attn_bias=masks[0].expand(4, 16, 4096, 4096)) == "sm90_wgmma_ws/128"


def test_full_bias_on_sm90():
    # Any other bias without a gradient (per head, per query row, both; bool, the inputs' dtype, float32). The
    # forward: the Hopper kernel's row form (its tiles copied by TMA) at dims 64, 128, 256 for bool or 16-bit
    # rows that a tensor map steps (a row dimension of its own, keys contiguous, base and strides 16-byte
    # aligned); anything else the sm80/ kernels. The backward: the Hopper kernel's row form at 128 and 256
    # whatever the bias's dtype and strides, sm80/ at 64 and 96.
    L = 4096
    rows = [torch.zeros(1, 16, L, L, dtype=torch.bool), torch.zeros(4, 1, L, L, dtype=torch.bfloat16),
            torch.zeros(1, 1, L, L, dtype=torch.float16)]
    others = [torch.zeros(1, 1, L, L, dtype=torch.float32), torch.zeros(4, 16, 1, L, dtype=torch.bfloat16)]
    for m in rows + others:
        dtype = torch.float16 if m.dtype == torch.float16 else torch.bfloat16
        for dim in (128, 256):
            fwd = f"sm90_wgmma_ws/{dim}" if any(m is r for r in rows) else f"sm80_features/{dim}"
            assert plan(dim, "sm90", dtype=dtype, attn_bias=m) == fwd, (dim, m.shape, m.dtype)
            assert plan(dim, "sm90", dtype=dtype, backward=True, attn_bias=m) == f"sm90_wgmma/{dim}", (dim, m.shape)
        # (dim 64: two consumers, whose tiles leave room for the bias tiles, also where a plain call of this length
        # takes three)
        fwd64 = "sm90_wgmma_ws/64" if any(m is r for r in rows) else "sm80_features/64"
        assert plan(64, "sm90", dtype=dtype, attn_bias=m) == fwd64, m.shape
        assert plan(96, "sm90", dtype=dtype, attn_bias=m) == "sm80_features/96"
        for dim in (64, 96):
            assert plan(dim, "sm90", dtype=dtype, backward=True, attn_bias=m).startswith("sm80_"), (dim, m.shape)
        assert plan(128, "sm90", CAUSAL_BOTTOM_RIGHT, dtype=dtype, backward=True, attn_bias=m) == "sm90_wgmma/128"
        assert plan(128, "sm80", dtype=dtype, attn_bias=m) == "sm80_features/128"
        assert plan(128, "sm90", dtype=dtype, attn_bias=m, kernels="sm80") == "sm80_features/128"
        assert plan(128, "sm90", dtype=dtype, attn_bias=m, softcap=30.0) == "sm80_features/128"
        assert plan(128, "sm90", dtype=dtype, backward=True, attn_bias=m, window_left=100).startswith("sm80_")
    for m in rows:
        dtype = torch.float16 if m.dtype == torch.float16 else torch.bfloat16
        assert plan(128, "sm90", CAUSAL_BOTTOM_RIGHT, dtype=dtype, attn_bias=m) == "sm90_wgmma_ws/128"
        assert plan(256, "sm90", shape=dict(heads_kv=4), dtype=dtype, attn_bias=m) == "sm90_wgmma_ws/256"  # GQA
        # the plain path's limits: rows that see fewer than 512 keys go to the sm80/ kernels
        assert plan(128, "sm90", shape=dict(len_k=256), dtype=dtype, attn_bias=m[..., :256]) == "sm80_features/128"
    # with its gradient: the backward's general step
    assert plan(128, "sm90", backward=True, attn_bias=rows[1], bias_requires_grad=True) == "sm80_general/128"
    # rows a tensor map cannot step (the forward to sm80/, the backward's loads take them): a row stride of 8
    # bytes past 16, a base 2 bytes past 16, a key stride other than 1
    odd_rows = torch.zeros(1, 16, L, L + 4, dtype=torch.bfloat16)[..., :L]
    odd_start = torch.zeros(1, 16, L, L + 8, dtype=torch.bfloat16)[..., 1:L + 1]
    transposed = torch.zeros(1, 16, L, L, dtype=torch.bfloat16).transpose(-1, -2)
    for m in (odd_rows, odd_start, transposed):
        assert plan(128, "sm90", attn_bias=m) == "sm80_features/128", (m.stride(), m.storage_offset())
        assert plan(128, "sm90", backward=True, attn_bias=m) == "sm90_wgmma/128"
    # a 16-byte aligned view whose rows are aligned too: the row form
    aligned = torch.zeros(1, 16, L, L + 8, dtype=torch.bfloat16)[..., 8:L + 8]
    assert plan(128, "sm90", attn_bias=aligned) == "sm90_wgmma_ws/128"


def test_varlen_takes_the_feature_variants():
    q = torch.empty(1, 8, 300, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 100, 300], dtype=torch.int32)
    varlen = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=200, max_seqlen_k=200)
    assert kernel_plan(q, q, q, device=H100, kernels="", **varlen) == "sm80_features/64"
    assert kernel_plan(q, q, q, backward=True, device=H100, kernels="", **varlen) == "sm80_2d/64"


def test_short_backward_two_blocks_on_sm90():
    # Dim 64, at most 1024 query rows, sm_90+: two 4-warp blocks per SM (stmatrix stores); on sm_90 the
    # wgmma kernel unless FLASHATTN_CUDA_KERNELS=sm80.
    assert plan(64, "sm90", backward=True, shape=dict(len_q=1024)) == "sm90_wgmma/64"
    assert plan(64, "sm90", backward=True, shape=dict(len_q=1024), kernels="sm80") == "sm80_2d_two_blocks/64"
    assert plan(64, "sm100", backward=True, shape=dict(len_q=1024)) == "sm80_2d_two_blocks/64"
    assert plan(64, "sm100", backward=True, shape=dict(len_q=2048)) == "sm80_2d/64"
    assert plan(64, "sm80", backward=True, shape=dict(len_q=1024)) == "sm80_plain/64"


def test_deterministic():
    # The deterministic backward runs the same kernels (in rounds); before sm_80 it has no dQ accumulators
    # for them, and the SIMT kernels take it.
    assert plan(128, "sm90", backward=True, deterministic=True) == "sm90_wgmma/128"
    assert plan(128, "sm80", backward=True, deterministic=True) == "sm80_2d/128"
    assert plan(64, "sm75", backward=True, deterministic=True) == "simt/64"
    assert plan(128, "sm90", backward=True, deterministic=True, dtype=torch.float64) == "sm80_plain/128"


def test_unaligned_operands_take_simt():
    # Rows of 40 bf16 columns (80 bytes) are not copied in 16-byte chunks by every row: dims not a multiple
    # of 8 leave the tensor-core kernels. fp16 / bf16 take the general SIMT forward at dims <= 64 (faster than
    # the Q-resident one there), the Q-resident one at dims <= 128 where its smem fits.
    assert plan(36, "sm90") == "simt/64"
    assert plan(100, "sm90") == "simt_qres/128"
    assert plan(36, "sm90", dtype=torch.float16) == "simt/64"
    assert plan(36, "sm90", backward=True) == "simt_kvres/64"
    q, k, v = qkv(64)
    view = torch.empty(4, 16, 4096, 65, dtype=torch.bfloat16)[..., 1:]  # rows start 2 bytes in
    assert kernel_plan(view, k, v, device=H100, kernels="") == "simt/64"


@pytest.mark.parametrize("gpu", ["sm90", "sm86"])
def test_overrides(gpu):
    # =simt: every dtype on the SIMT kernels (the Q / K-resident ones where their 176 / 200 KB fit).
    assert plan(128, gpu, kernels="simt") == ("simt_qres/128" if gpu == "sm90" else "simt/128")
    assert plan(128, gpu, kernels="simt", backward=True) == ("simt_kvres/128" if gpu == "sm90" else "simt/128")
    assert plan(128, gpu, kernels="sm80") == "sm80_plain/128"
    assert plan(128, "sm90", kernels="sm80", backward=True) == "sm80_2d_one_sync/128"
    # =wgmma: the Hopper forwards whatever the shape (on sm_90 only).
    tiny = dict(batch=1, heads=1, len_q=64)
    assert plan(128, gpu, kernels="wgmma", shape=tiny) == ("sm90_wgmma_ws/128" if gpu == "sm90" else "sm80_plain/128")
    assert plan(128, gpu, kernels="auto", shape=tiny) == "sm80_plain/128"  # a value it does not name: unset


def test_smem_limit_override():
    # A cap takes an H100 down the paths of an A100 (166912) or an RTX card (101376); larger or invalid: none.
    assert plan(128, "sm90", smem_limit="166912") == "sm80_plain/128"  # the 193 KB Hopper forward does not fit
    assert plan(64, "sm90", smem_limit="166912") == "sm90_wgmma_ws3/64"  # 97 KB
    # The Hopper backward takes 194 KB.
    assert plan(128, "sm90", backward=True, smem_limit="166912") == "sm80_2d/128"
    assert plan(64, "sm90", backward=True, smem_limit="201000") == "sm90_wgmma/64"
    assert plan(128, "sm90", dtype=torch.float64, smem_limit="166912") == "simt/128"
    assert plan(128, "sm90", backward=True, smem_limit="101376") == "sm80_compact/128"
    assert plan(64, "sm90", dtype=torch.float64, smem_limit="101376") == "simt/128"
    assert plan(128, "sm90", dtype=torch.float64, smem_limit="300000") == "sm80_plain/128"
    assert plan(128, "sm90", dtype=torch.float64, smem_limit="-5") == "sm80_plain/128"
    assert plan(128, "sm90", dtype=torch.float64, smem_limit="cap") == "sm80_plain/128"


def test_backward_forms_no_gpu_runs_are_not_planned():
    # Without features, the 1-D dK/dV kernel at dims 96 / 128 / 256 and the 2-D two-barrier form at 256 fit
    # no GPU that lacks room for a 2-D form before them (sm80/bwd_forms.h): they are not compiled, and a cap
    # between two GPUs' sizes gives the call the general variant instead. With a band they are compiled.
    window = dict(window_left=64, window_right=0)
    for dim, caps in ((96, (126000, 142000)), (128, (159000, 166000)), (256, (174000, 216000, 230000))):
        for cap in caps:
            for dtype in (torch.bfloat16, torch.float16):
                assert plan(dim, "sm90", backward=True, dtype=dtype, kernels="sm80", smem_limit=str(cap)) == \
                    f"sm80_general/{dim}", (dim, cap)
        assert plan(dim, "sm90", backward=True, kernels="sm80", smem_limit=str(caps[0]), **window) == \
            f"sm80_features/{dim}"
    assert plan(256, "sm90", backward=True, kernels="sm80", smem_limit="220000", **window) == "sm80_2d/256"
    # Where a GPU runs them they stay: the 1-D kernel at 64 on 99 KB, the two-barrier form at 96 / 128 on 163 KB.
    assert plan(64, "sm86", backward=True) == "sm80_plain/64"
    assert plan(96, "sm80", backward=True) == "sm80_2d/96"
    # No cap makes the plan name an uncompiled form for a plain call.
    for dim in (96, 128, 256):
        for cap in range(60000, 232449, 4096):
            got = plan(dim, "sm90", backward=True, kernels="sm80", smem_limit=str(cap))
            assert got != f"sm80_plain/{dim}" and (dim != 256 or got != "sm80_2d/256"), (dim, cap, got)


def test_device_argument_errors():
    q, k, v = qkv(64)
    with pytest.raises(ValueError, match="'device' must be a dict"):
        kernel_plan(q, k, v, device={"arch": (9, 0), "sms": 132})
    with pytest.raises(ValueError, match=r"'arch' must be \(major, minor\).*got 9"):
        kernel_plan(q, k, v, device={"arch": 9, "sms": 132, "smem": 1})
    with pytest.raises(ValueError, match="'sms' must be an int >= 1, got 0"):
        kernel_plan(q, k, v, device={"arch": (9, 0), "sms": 0, "smem": 1})
    with pytest.raises(ValueError, match="'sm90a' must be a bool, got 1"):
        kernel_plan(q, k, v, device=dict(H100, sm90a=1))
    with pytest.raises(RuntimeError, match="kernel_plan of tensors on cpu needs argument 'device'"):
        kernel_plan(q, k, v)
    with pytest.raises(RuntimeError, match="empty problem"):
        kernel_plan(*qkv(64, len_q=0), device=H100)
    with pytest.raises(RuntimeError, match="argument 'k' has head_dim"):
        kernel_plan(q, k[..., :32], v, device=H100)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="plans for the CUDA device present")
def test_plan_of_the_cuda_device():
    q, k, v = (t.cuda() for t in qkv(64, batch=1, heads=2, len_q=128))
    got = kernel_plan(q, k, v)
    # The same call planned for a GPU faked with the limits torch reports (a build with sm_90a code).
    props = torch.cuda.get_device_properties(q.device)
    fake = {"arch": (props.major, props.minor), "sms": props.multi_processor_count,
            "smem": props.shared_memory_per_block_optin}
    assert got == kernel_plan(q.cpu(), k.cpu(), v.cpu(), device=fake)

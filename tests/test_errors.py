"""Bad input gets a clear error naming the argument and the rule (DESIGN §3); NaN/Inf inputs
propagate as in torch and never crash."""
import re

import pytest
import torch
import torch.nn.functional as F

import flashattn_ext
from flashattn_ext.functional import checked_fwd
from reference import BOTTOM_RIGHT, NONE, TOP_LEFT, attention, make_qkv, ours

bwd = torch.ops.flashattn.bwd

# torch 2.11 segfaults on any exception thrown by a stable-ABI kernel (scripts/probe shows it
# with a three-line op); torch 2.13 raises it. The C++ checks are tested where torch can
# carry their errors; the Python checks, which the public API runs first, everywhere.
STABLE_ABI_RAISES = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 13)
needs_stable_abi_raises = pytest.mark.skipif(
    not STABLE_ABI_RAISES, reason="this torch crashes on exceptions from stable-ABI kernels (scripts/probe)")


@pytest.fixture(params=["op", "python"])
def fwd(request):
    """The op's C++ checks, and the Python checks of the public API (flashattn_ext._checks)."""
    if request.param == "op":
        if not STABLE_ABI_RAISES:
            pytest.skip("this torch crashes on exceptions from stable-ABI kernels (scripts/probe)")
        return torch.ops.flashattn.fwd
    return lambda q, k, v, scale, causal, **features: checked_fwd(q, k, v, scale, causal, **features)


def _qkv(device, dtype=torch.float32, hq=2, hkv=2, lq=5, lk=6, e=8, ev=8, b=1):
    return make_qkv(b, hq, hkv, lq, lk, e, ev, dtype, device)


# ---- flashattn::fwd argument checks ----

def test_wrong_rank(fwd, device):
    q, k, v = _qkv(device)
    with pytest.raises(RuntimeError, match=r"argument 'q' must have 4 dimensions .*got shape \[2, 5, 8\]"):
        fwd(q[0], k, v, 1.0, NONE)
    with pytest.raises(RuntimeError, match=r"argument 'v' must have 4 dimensions .*got shape \[1, 1, 2, 6, 8\]"):
        fwd(q, k, v[None], 1.0, NONE)


def test_dtype_mismatch(fwd, device):
    q, k, v = _qkv(device)
    with pytest.raises(RuntimeError, match="argument 'k' has dtype float64 but 'q' has dtype float32; they must match"):
        fwd(q, k.double(), v, 1.0, NONE)
    with pytest.raises(RuntimeError, match="argument 'v' has dtype bfloat16 but 'q' has dtype float32"):
        fwd(q, k, v.bfloat16(), 1.0, NONE)


@pytest.mark.parametrize("dtype,name", [(torch.int32, "int32"), (torch.int64, "int64"), (torch.bool, "bool")])
def test_non_float_dtype(fwd, device, dtype, name):
    q = torch.ones(1, 2, 5, 8, dtype=dtype, device=device)
    with pytest.raises(RuntimeError, match=f"argument 'q' has dtype {name}; supported dtypes are float64, "
                                           f"float32, bfloat16 and float16"):
        fwd(q, q, q, 1.0, NONE)


def test_device_mismatch(fwd, device):
    if not torch.cuda.is_available() or not flashattn_ext.has_cuda_kernels():
        pytest.skip("needs a CUDA device with the CUDA kernels built to mix cpu and cuda tensors")
    q, k, v = _qkv(device)
    other = "cpu" if device == "cuda" else "cuda"
    with pytest.raises(RuntimeError, match=r"argument 'k' is on device .* but 'q' is on .*must be on the same device"):
        fwd(q, k.to(other), v, 1.0, NONE)


def test_device_mismatch_with_meta(fwd, device):
    """A meta tensor among real ones must be rejected, not answered with uninitialized memory."""
    q, k, v = _qkv(device)
    with pytest.raises(RuntimeError, match="device"):
        fwd(q, k.to("meta"), v, 1.0, NONE)
    with pytest.raises(RuntimeError, match="device"):
        fwd(q, k, v.to("meta"), 1.0, NONE)


@pytest.mark.parametrize("head_dim", [0, 257])
def test_head_dim_limits(fwd, device, head_dim):
    q, k, _ = _qkv(device, e=head_dim)
    _, _, v = _qkv(device)
    with pytest.raises(RuntimeError, match=f"head_dim of q and k must be between 1 and 256, got {head_dim}"):
        fwd(q, k, v, 1.0, NONE)
    q, k, _ = _qkv(device)
    _, _, v = _qkv(device, ev=head_dim)
    with pytest.raises(RuntimeError, match=f"head_dim of v must be between 1 and 256, got {head_dim}"):
        fwd(q, k, v, 1.0, NONE)


def test_mismatched_sizes(fwd, device):
    q, k, v = _qkv(device)
    k2, v2 = _qkv(device, b=2)[1:]
    with pytest.raises(RuntimeError, match=r"argument 'k' has batch size 2 \(shape \[2, 2, 6, 8\]\) but 1 was expected"):
        fwd(q, k2, v2, 1.0, NONE)
    with pytest.raises(RuntimeError, match=r"argument 'v' has batch size 2 .* but 1 was expected"):
        fwd(q, k, v2, 1.0, NONE)
    with pytest.raises(RuntimeError, match=r"argument 'v' has sequence length \(must equal k's\) 5"):
        fwd(q, k, v[:, :, :5], 1.0, NONE)
    with pytest.raises(RuntimeError, match=r"argument 'v' has number of heads \(must equal k's\) 1"):
        fwd(q, k, v[:, :1], 1.0, NONE)
    with pytest.raises(RuntimeError, match=r"argument 'k' has head_dim \(must equal q's\) 4"):
        fwd(q, k[..., :4], v, 1.0, NONE)


@pytest.mark.parametrize("hq,hkv", [(3, 2), (2, 4), (2, 0)])
def test_heads_not_multiple(fwd, device, hq, hkv):
    q, k, v = _qkv(device, hq=hq, hkv=hkv)
    with pytest.raises(RuntimeError, match=re.escape(f"the number of query heads ({hq}) must be a multiple of the "
                                                     f"number of key/value heads ({hkv})")):
        fwd(q, k, v, 1.0, NONE)


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_non_contiguous_last_dim(fwd, device, name):
    args = dict(zip("qkv", _qkv(device)))
    args[name] = torch.randn(args[name].shape[:-1] + (16,), device=device)[..., ::2]
    with pytest.raises(RuntimeError, match=f"argument '{name}' must have a contiguous last dimension \\(stride 1\\), "
                                           f"got stride 2"):
        fwd(args["q"], args["k"], args["v"], 1.0, NONE)


@pytest.mark.parametrize("causal", [-1, 3, 100])
def test_bad_causal(fwd, device, causal):
    q, k, v = _qkv(device)
    with pytest.raises(RuntimeError, match=f"argument 'causal' must be 0 \\(none\\), 1 \\(top-left\\) or 2 "
                                           f"\\(bottom-right\\), got {causal}"):
        fwd(q, k, v, 1.0, causal)


# ---- flashattn::bwd argument checks ----

def _bwd_args(device):
    q, k, v = _qkv(device)
    out, lse = torch.ops.flashattn.fwd(q, k, v, 0.5, NONE)
    return dict(dout=torch.randn_like(out), q=q, k=k, v=v, out=out, lse=lse, dlse=None)


def _call_bwd(a):
    return bwd(a["dout"], a["q"], a["k"], a["v"], a["out"], a["lse"], a["dlse"], 0.5, NONE, False)


def test_bwd_accepts_its_forward(device):
    dq, dk, dv, dbias = _call_bwd(_bwd_args(device))
    assert dq.shape == (1, 2, 5, 8) and dk.shape == dv.shape == (1, 2, 6, 8) and dbias.numel() == 0


@pytest.mark.parametrize("name,bad,match", [
    ("lse", lambda a: a["lse"][:, :1], r"argument 'lse' must have shape \[1, 2, 5\], got \[1, 1, 5\]"),
    ("lse", lambda a: a["lse"][..., None], r"argument 'lse' must have shape \[1, 2, 5\], got \[1, 2, 5, 1\]"),
    ("lse", lambda a: a["lse"].double(), "argument 'lse' must have dtype float32, got float64"),
    ("lse", lambda a: a["lse"].transpose(1, 2).contiguous().transpose(1, 2), "argument 'lse' must be contiguous"),
    ("dout", lambda a: a["dout"][:, :, :4], r"argument 'dout' has dimension size 4 \(shape \[1, 2, 4, 8\]\) but 5"),
    ("dout", lambda a: a["dout"][0], r"argument 'dout' must have 4 dimensions"),
    ("dout", lambda a: a["dout"].double(), "argument 'dout' has dtype float64 but 'q' has dtype float32"),
    ("out", lambda a: a["out"][..., :4], r"argument 'out' has dimension size 4 \(shape \[1, 2, 5, 4\]\) but 8"),
    ("dlse", lambda a: a["lse"][:, :, :2].contiguous(), r"argument 'dlse' must be a contiguous tensor shaped, "
                                                        r"typed and placed like 'lse' \[1, 2, 5\], got shape \[1, 2, 2\]"),
    ("dlse", lambda a: a["lse"].double(), r"argument 'dlse' .* dtype float64"),
])
@needs_stable_abi_raises
def test_bwd_bad_arguments(device, name, bad, match):
    a = _bwd_args(device)
    a[name] = bad(a)
    with pytest.raises(RuntimeError, match=match):
        _call_bwd(a)


# ---- NaN / Inf inputs ----

def _poisoned_case(device, where, value, causal, e):
    q, k, v = (t.double() for t in _qkv(device, lq=6, lk=6, e=e, ev=e))
    # Keys with alternating signs in column 2, so that a poisoned query element makes the row's
    # scores a mix of +inf and -inf (a NaN row in torch) whatever the random draw on the device.
    k[..., 2] = k[..., 2].abs() * torch.tensor([1.0, -1.0], device=device).repeat(3)
    {"q": q, "k": k, "v": v}[where][0, 1, 3, 2] = value
    return q, k, v


@pytest.mark.parametrize("where,value,causal", [
    ("q", float("nan"), NONE), ("q", float("nan"), TOP_LEFT), ("q", float("inf"), NONE),
    ("q", float("-inf"), BOTTOM_RIGHT), ("k", float("nan"), NONE), ("v", float("nan"), NONE),
    ("v", float("inf"), NONE),
])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=["fp64", "fp32", "bf16"])
@pytest.mark.parametrize("e", [8, 100])  # the CUDA kernels of head-dim tiers 64 and 128
def test_nan_inf_propagate_like_torch(device, where, value, causal, dtype, e):
    q, k, v = _poisoned_case(device, where, value, causal, e)
    ref_out, ref_lse = attention(q, k, v, 0.5, causal)
    q, k, v = (t.to(dtype).requires_grad_() for t in (q, k, v))
    out, lse = ours(q, k, v, 0.5, causal)
    assert torch.equal(out.isnan(), ref_out.isnan()), (out.isnan().nonzero(), ref_out.isnan().nonzero())
    # torch has no lse output; torch.logsumexp gives +inf where a row's scores hold +inf and
    # NaN where they hold NaN. lse must be non-finite exactly there (NaN or inf).
    assert torch.equal(lse.isfinite(), ref_lse.isfinite()), (lse, ref_lse)
    if where == "q":  # a poisoned query row poisons that row only
        assert out[0, 1, 3].isnan().all() and out.isnan().sum() == out.shape[-1]
    (out.nan_to_num().sum() + lse.nan_to_num().sum()).backward()  # must not crash
    for t in (q, k, v):
        assert t.grad.shape == t.shape


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=["fp64", "fp32", "bf16"])
@pytest.mark.parametrize("e", [8, 100])
def test_query_inf_with_every_score_minus_inf_gives_zero_row(device, dtype, e):
    # A query element of -inf against keys all positive there: every score of that row is -inf,
    # and torch's SDPA (its safe softmax, torch >= 2.5) then treats the row as fully masked
    # (out 0), not as NaN; so do we.
    q, k, v = (t.double() for t in _qkv(device, lq=6, lk=6, e=e, ev=e))
    k[..., 2] = k[..., 2].abs() + 0.1
    q[0, 1, 3, 2] = float("-inf")
    ref = F.scaled_dot_product_attention(q, k, v, scale=0.5)
    assert ref[0, 1, 3].eq(0).all() and ref.isfinite().all()
    out, lse = ours(q.to(dtype), k.to(dtype), v.to(dtype), 0.5, NONE)
    assert out[0, 1, 3].eq(0).all() and out.isfinite().all()
    assert lse[0, 1, 3] == float("-inf") and lse.isfinite().sum() == lse.numel() - 1


# ---- wrapper checks ----

def test_sdpa_enable_gqa_required(device):
    q, k, v = _qkv(device, hq=4, hkv=2)
    with pytest.raises(ValueError, match=r"query has 4 heads and key has 2; pass enable_gqa=True"):
        flashattn_ext.scaled_dot_product_attention(q, k, v)
    # torch refuses it too
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q, k, v)


def test_wrapper_shapes(device):
    q, k, v = _qkv(device)
    with pytest.raises(ValueError, match=r"query must have at least 3 dimensions .*got shape \(5, 8\)"):
        flashattn_ext.scaled_dot_product_attention(q[0, 0], k, v)
    with pytest.raises(ValueError, match=r"key has leading \(batch\) dimensions \(2,\) but query has \(1,\)"):
        flashattn_ext.scaled_dot_product_attention(q, k.expand(2, -1, -1, -1), v)
    with pytest.raises(ValueError, match=r"v must have 4 dimensions \(batch, seq_len, heads, head_dim\)"):
        flashattn_ext.flash_attn_func(q, k, v[0])
    with pytest.raises(TypeError, match="k must be a torch.Tensor"):
        flashattn_ext.flash_attn_func(q, k.tolist(), v)


# ---- the optional features (flashattn::fwd's checks, and the public functions') ----

def _cu(*values, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype)


@pytest.mark.parametrize("features,match", [
    (dict(attn_bias=torch.ones(1, 2, 5, 7, dtype=torch.bool)),
     r"argument 'attn_bias' must have shape \[1, 2, 5, 6\] \(batch, heads, len_q, len_k\), each dimension "
     r"possibly 1 \(broadcast\), got \[1, 2, 5, 7\]"),
    (dict(attn_bias=torch.ones(5, 6, dtype=torch.bool)), r"argument 'attn_bias' must have shape .*got \[5, 6\]"),
    (dict(attn_bias=torch.ones(1, 1, 5, 6, dtype=torch.int32)),
     r"argument 'attn_bias' has dtype int32; it must be bool \(True = take part\), or float in the query's dtype "
     r"\(float32\) or float32"),
    (dict(attn_bias=torch.ones(1, 1, 5, 6, dtype=torch.float64)), r"argument 'attn_bias' has dtype float64"),
    (dict(attn_bias=torch.ones(1, 1, 5, 6, device="meta")), r"argument 'attn_bias' is on device meta"),
    (dict(dropout_p=-0.1), r"argument 'dropout_p' must be in \[0, 1\), got -0.1"),
    (dict(dropout_p=1.0), r"argument 'dropout_p' must be in \[0, 1\), got 1"),
    (dict(dropout_p=0.5), r"dropout_p > 0 needs argument 'rng_state'"),
    (dict(dropout_p=0.5, rng_state=torch.zeros(3, dtype=torch.int64)),
     r"argument 'rng_state' must be a contiguous int64 tensor \[seed, offset\] on the CPU or on q's device, got shape \[3\]"),
    (dict(dropout_p=0.5, rng_state=torch.zeros(4, dtype=torch.int64)[::2]),
     r"argument 'rng_state' must be a contiguous int64 tensor .*got shape \[2\]"),
    (dict(window_left=-2), r"argument 'window_size' must be \(left, right\) with each >= 0, or -1 for unbounded, "
                           r"got \(-2, -1\)"),
    (dict(window_right=-5), r"argument 'window_size' .*got \(-1, -5\)"),
    (dict(softcap=-1.0), r"argument 'softcap' must be >= 0 \(0 = off\), got -1"),
    (dict(alibi_slopes=torch.ones(3)), r"argument 'alibi_slopes' must have shape \[2\] \(heads\) or \[1, 2\] "
                                       r"\(batch, heads\), got \[3\]"),
    (dict(alibi_slopes=torch.ones(2, 2)), r"argument 'alibi_slopes' must have shape .*got \[2, 2\]"),
    (dict(alibi_slopes=torch.ones(2, dtype=torch.float64)),
     r"argument 'alibi_slopes' must have dtype float32, got float64"),
], ids=["bias_shape", "bias_rank", "bias_int", "bias_float64", "bias_meta", "p_negative", "p_one", "no_rng",
        "rng_shape", "rng_strided", "window_left", "window_right", "softcap", "slopes_shape", "slopes_batch",
        "slopes_dtype"])
def test_feature_arguments(fwd, features, match):
    q, k, v = _qkv("cpu")
    with pytest.raises(RuntimeError, match=match):
        fwd(q, k, v, 1.0, NONE, **features)


def _varlen(cu_q=(0, 2, 5), cu_k=(0, 4, 6), max_q=3, max_k=4, **features):
    """q, k, v packed as (1, heads, total, dim) views with two sequences, and the varlen
    arguments of the op (`features` override or add to them)."""
    q, k, v = (t.transpose(1, 2).reshape(1, -1, 2, 8).transpose(1, 2) for t in _qkv("cpu", b=1))
    return (q, k, v), dict(dict(cu_seqlens_q=_cu(*cu_q), cu_seqlens_k=_cu(*cu_k), max_seqlen_q=max_q,
                                max_seqlen_k=max_k), **features)


def test_varlen_accepts_valid_arguments(fwd):
    (q, k, v), features = _varlen()
    out, lse = fwd(q, k, v, 1.0, NONE, **features)
    assert out.shape == (1, 2, 5, 8) and lse.shape == (1, 2, 5)


@pytest.mark.parametrize("change,match", [
    (dict(cu_seqlens_q=_cu(0, 2, 5, dtype=torch.int64)), r"argument 'cu_seqlens_q' must have dtype int32, got int64"),
    (dict(cu_seqlens_k=_cu(0, 4, 6, dtype=torch.int64)), r"argument 'cu_seqlens_k' must have dtype int32, got int64"),
    (dict(cu_q=(0, 3, 2, 5), cu_k=(0, 1, 2, 6)),
     r"argument 'cu_seqlens_q' must be non-decreasing, got 3 then 2 at index 2"),
    (dict(cu_k=(0, 2)), r"arguments 'cu_seqlens_q' and 'cu_seqlens_k' must have the same length \(batch \+ 1\), "
                        r"got 3 and 2"),
    (dict(cu_q=(0, 2, 4)), r"argument 'cu_seqlens_q' must end at the total number of rows 5, got 4"),
    (dict(cu_k=(1, 4, 6)), r"argument 'cu_seqlens_k' must start at 0, got 1"),
    (dict(max_q=2), r"argument 'max_seqlen_q' \(2\) is smaller than the longest sequence in 'cu_seqlens_q' \(3\)"),
    (dict(cu_seqlens_k=None), r"'cu_seqlens_q' and 'cu_seqlens_k' must be given together"),
    (dict(attn_bias=torch.ones(1, 2, 5, 6, dtype=torch.bool)),
     r"the combination attn_bias \+ cu_seqlens \(variable-length batches\) is not supported"),
    (dict(alibi_slopes=torch.ones(3, 2)), r"argument 'alibi_slopes' must have shape \[2\] \(heads\) or \[2, 2\]"),
], ids=["q_int64", "k_int64", "decreasing", "lengths_differ", "wrong_total", "k_start", "max_too_small",
        "k_missing", "with_bias", "slopes_batch"])
def test_varlen_arguments(fwd, change, match):
    (q, k, v), features = _varlen(**change)
    with pytest.raises(RuntimeError, match=match):
        fwd(q, k, v, 1.0, NONE, **features)


def test_varlen_batch_must_be_one(fwd):
    q, k, v = _qkv("cpu", b=2)
    with pytest.raises(RuntimeError, match=r"with cu_seqlens, q, k and v must be \(1, heads, total, head_dim\) views "
                                           r"of packed \(total, heads, head_dim\) tensors, got batch size 2"):
        fwd(q, k, v, 1.0, NONE, cu_seqlens_q=_cu(0, 5), cu_seqlens_k=_cu(0, 6), max_seqlen_q=5, max_seqlen_k=6)


def test_bias_requires_grad_needs_float_bias(device):
    if not STABLE_ABI_RAISES:
        pytest.skip("this torch crashes on exceptions from stable-ABI kernels (scripts/probe)")
    a = _bwd_args("cpu")
    with pytest.raises(RuntimeError, match="bias_requires_grad needs a float 'attn_bias'"):
        bwd(a["dout"], a["q"], a["k"], a["v"], a["out"], a["lse"], None, 0.5, NONE, False,
            attn_bias=torch.ones(1, 2, 5, 6, dtype=torch.bool), bias_requires_grad=True)


def test_public_feature_arguments(device):
    q, k, v = _qkv(device)
    with pytest.raises(RuntimeError, match="attn_mask and is_causal=True cannot be given together"):
        flashattn_ext.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(5, 6, dtype=torch.bool,
                                                                                 device=device), is_causal=True)
    with pytest.raises(ValueError, match=r"attn_mask of shape \(4, 6\) does not broadcast to \(\*batch, heads, L, S\) "
                                         r"= \(1, 2, 5, 6\)"):
        flashattn_ext.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(4, 6, device=device))
    for dtype in (torch.int64, torch.float64):
        with pytest.raises(ValueError, match=r"attn_mask must be bool \(True = take part\) or float \(added to the "
                                             rf"scores\) in the query's dtype \(torch.float32\) or float32, got "
                                             rf"dtype {dtype}"):
            flashattn_ext.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(5, 6, dtype=dtype, device=device))
    with pytest.raises(RuntimeError, match=r"argument 'dropout_p' must be in \[0, 1\), got 1.5"):
        flashattn_ext.scaled_dot_product_attention(q, k, v, dropout_p=1.5)
    ql, kl, vl = (t.transpose(1, 2) for t in (q, k, v))
    with pytest.raises(ValueError, match=r"window_size must be a pair \(left, right\) of ints \(-1 = unbounded\), got 3"):
        flashattn_ext.flash_attn_func(ql, kl, vl, window_size=3)
    with pytest.raises(ValueError, match=r"q must have 3 dimensions \(total, heads, head_dim\)"):
        flashattn_ext.flash_attn_varlen_func(ql, kl[0], vl[0], _cu(0, 5), _cu(0, 6), 5, 6)
    with pytest.raises(TypeError, match="cu_seqlens_k must be a torch.Tensor"):
        flashattn_ext.flash_attn_varlen_func(ql[0], kl[0], vl[0], _cu(0, 5), [0, 6], 5, 6)

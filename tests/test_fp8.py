"""Float8 inputs of flash_attn_func / flash_attn_varlen_func with q_descale, k_descale,
v_descale (FlashAttention-3's conventions): against a float64 reference on the float8 values
times their descales, with the accuracy rule of DESIGN §4 (torch in bfloat16 on the dequantized
tensors as the same-dtype baseline), and every error the float8 rules raise."""
import pytest
import torch

import flashattn_ext

from feature_reference import attention_ref
from flashattn_ext import flash_attn_interface
from flashattn_ext._measure import REL_ATOL
from flashattn_ext.functional import flash_attn_func, flash_attn_varlen_func
from reference import BOTTOM_RIGHT, NONE, assert_accurate, attention, expand_kv, same_dtype_backend

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
BF16 = torch.bfloat16
# The output is rounded to bfloat16 twice where v_descale != 1 (by the kernel, then after the
# product with v_descale): one more half ulp than the rule's one rounding.
OUT_ATOL = 2 * REL_ATOL[BF16]
LSE_ATOL = REL_ATOL[torch.float32]
AMAX = 64.0  # float8 values spread up to ~AMAX; descales near 1 / AMAX give unit-scale tensors


def quantized(shape, dtype, device, amax=AMAX):
    return (torch.randn(shape, device=device) * amax).clamp(-448, 448).to(dtype)


def quantized_qkv(batch, len_q, len_k, heads, heads_kv, dim, dtype, device, amax=AMAX, dim_v=None):
    """q (batch, len_q, heads, dim), k and v (batch, len_k, heads_kv, dim / dim_v), quantized()."""
    return (quantized((batch, len_q, heads, dim), dtype, device, amax),
            quantized((batch, len_k, heads_kv, dim), dtype, device, amax),
            quantized((batch, len_k, heads_kv, dim_v or dim), dtype, device, amax))


def descales(kind, groups, heads_kv, device):
    """(q_descale, k_descale, v_descale) of one kind: None, Python floats, 0-d tensors,
    (groups, heads_kv) tensors, or one of each form."""
    def per_head():
        return (torch.rand(groups, heads_kv, device=device) + 0.5) / AMAX
    if kind == "none":
        return None, None, None
    if kind == "float":
        return 0.9 / AMAX, 1.1 / AMAX, 1.3 / AMAX
    if kind == "tensor":
        return tuple(torch.tensor(x / AMAX, device=device) for x in (0.9, 1.1, 1.3))
    if kind == "per_head":
        return per_head(), per_head(), per_head()
    return per_head(), 1.1 / AMAX, torch.tensor([1.3 / AMAX], device=device)  # "mixed"


def dequantized(x, descale, head_dim=2):
    """x (float8) times its descale in float64; a (groups, heads_kv) descale applies to the
    heads of x (dimension head_dim) in groups of heads // heads_kv, and to dimension 0."""
    x = x.double()
    if descale is None:
        return x
    if not isinstance(descale, torch.Tensor) or descale.numel() == 1:
        return x * float(descale)
    d = descale.double().repeat_interleave(x.shape[head_dim] // descale.shape[1], dim=1)
    return x * (d[:, None, :, None] if head_dim == 2 else d[:, :, None])


def bhld(*tensors):
    return [t.transpose(1, 2) for t in tensors]


def folded(q, k, qd, kd):
    """Where q_descale * k_descale is per head, the call folds it into q before one bfloat16 rounding
    and leaves k exact: (q * q_descale * k_descale, k) in float64, the other bfloat16 dequantization
    of the same scores; else None."""
    qd_t, kd_t = (isinstance(d, torch.Tensor) and d.numel() > 1 for d in (qd, kd))
    if not (qd_t or kd_t):
        return None
    ones = torch.ones(q.shape[0], k.shape[2], dtype=torch.float32, device=q.device)
    qk = (qd if qd_t else ones * (1.0 if qd is None else float(qd))) * (kd if kd_t else ones * (1.0 if kd is None
                                                                                                 else float(kd)))
    return dequantized(q, qk), k.double()


def bf16_baseline(q64, k64, v64, scale, causal, features, device):
    q16, k16, v16 = (t.to(BF16) for t in (q64, k64, v64))
    if features:
        return attention_ref(q16, k16, v16, scale, causal, **features)
    return attention(q16, k16, v16, scale, causal, same_dtype_backend(device, q16.shape[2], k16.shape[2], causal))


def check_out_lse(out, lse, qr, kr, vr, scale, causal, features, fold=None):
    """out (B, L, H, Ev) and lse (B, H, L) against attention on the float64 dequantized
    tensors qr, kr, vr (B, L, H, E), torch in bfloat16 on them as the same-dtype baseline. `fold`:
    folded()'s (q, k), whose bfloat16 rounding is the call's; the baseline is then the one of the two
    dequantizations further from the reference (each is one rounding of the same scores)."""
    q64, k64, v64 = bhld(qr, kr, vr)
    ref_out, ref_lse = attention_ref(q64, k64, v64, scale, causal, **features)
    same_out, same_lse = bf16_baseline(q64, k64, v64, scale, causal, features, out.device)
    if fold is not None:
        fold_out, fold_lse = bf16_baseline(*bhld(*fold), v64, scale, causal, features, out.device)
        def worse(a, b, ref):
            err = lambda x: (x.double() - ref).nan_to_num(nan=0.0).abs().amax() if ref.numel() else 0
            return a if err(a) >= err(b) else b
        same_out, same_lse = worse(same_out, fold_out, ref_out), worse(same_lse, fold_lse, ref_lse)
    assert out.dtype == BF16 and lse.dtype == torch.float32
    assert_accurate("out", out.transpose(1, 2), ref_out, same_out, OUT_ATOL)
    assert_accurate("lse", lse, ref_lse, same_lse, LSE_ATOL)


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("kind", ["none", "float", "tensor", "per_head", "mixed"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_against_reference(device, dtype, kind, causal):
    batch, heads, heads_kv, len_q, len_k, dim = 2, 4, 2, 5, 9, 32  # GQA: two query heads per kv head
    amax = 1.0 if kind == "none" else AMAX
    q, k, v = quantized_qkv(batch, len_q, len_k, heads, heads_kv, dim, dtype, device, amax)
    qd, kd, vd = descales(kind, batch, heads_kv, device)
    out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True, q_descale=qd, k_descale=kd, v_descale=vd)
    check_out_lse(out, lse, dequantized(q, qd), dequantized(k, kd), dequantized(v, vd), dim ** -0.5,
                  BOTTOM_RIGHT if causal else NONE, {}, folded(q, k, qd, kd))


@pytest.mark.parametrize("kind", ["float", "per_head"])
def test_features(device, kind):
    """A window, softcap and ALiBi act on the dequantized scores (softmax_scale given)."""
    batch, heads, heads_kv, len_q, len_k, dim, dim_v = 2, 4, 1, 7, 6, 16, 24
    q, k, v = quantized_qkv(batch, len_q, len_k, heads, heads_kv, dim, E4M3, device, dim_v=dim_v)
    qd, kd, vd = descales(kind, batch, heads_kv, device)
    slopes = torch.rand(heads, device=device)
    window, softcap, scale = (3, 1), 2.0, 0.4
    out, lse = flash_attn_func(q, k, v, softmax_scale=scale, causal=True, window_size=window, softcap=softcap,
                               alibi_slopes=slopes, return_lse=True, q_descale=qd, k_descale=kd, v_descale=vd)
    check_out_lse(out, lse, dequantized(q, qd), dequantized(k, kd), dequantized(v, vd), scale, BOTTOM_RIGHT,
                  dict(window=window, softcap=softcap, alibi=slopes), folded(q, k, qd, kd))


@pytest.mark.parametrize("kind", ["tensor", "per_head"])
def test_varlen(device, kind):
    """Per-sequence descales; a sequence with no query rows, GQA, causal within each sequence."""
    lens_q, lens_k = [3, 0, 5], [4, 2, 6]
    heads, heads_kv, dim = 4, 2, 16
    cu_q, cu_k = (torch.tensor([0] + lens, device=device).cumsum(0).to(torch.int32) for lens in (lens_q, lens_k))
    q = quantized((sum(lens_q), heads, dim), E4M3, device)
    k = quantized((sum(lens_k), heads_kv, dim), E4M3, device)
    v = quantized((sum(lens_k), heads_kv, dim), E4M3, device)
    qd, kd, vd = descales(kind, len(lens_q), heads_kv, device)
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True, return_lse=True,
                                      q_descale=qd, k_descale=kd, v_descale=vd)
    assert out.shape == (sum(lens_q), heads, dim) and lse.shape == (heads, sum(lens_q))
    with_probs = flash_attn_interface.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                                             causal=True, return_attn_probs=True, q_descale=qd,
                                                             k_descale=kd, v_descale=vd)
    assert torch.equal(with_probs[0], out) and torch.equal(with_probs[1], lse)
    assert with_probs[2].shape == (len(lens_q), heads, max(lens_q), max(lens_k)) and with_probs[2].dtype == BF16
    for b, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        rows_q, rows_k = slice(cu_q[b], cu_q[b] + lq), slice(cu_k[b], cu_k[b] + lk)

        def seq(x, d, rows):
            d = d[b:b + 1] if isinstance(d, torch.Tensor) and d.numel() > 1 else d
            return dequantized(x[rows][None], d)
        qd_b, kd_b = (d[b:b + 1] if isinstance(d, torch.Tensor) and d.numel() > 1 else d for d in (qd, kd))
        check_out_lse(out[rows_q][None], lse[:, rows_q][None], seq(q, qd, rows_q), seq(k, kd, rows_k),
                      seq(v, vd, rows_k), dim ** -0.5, BOTTOM_RIGHT, {},
                      folded(q[rows_q][None], k[rows_k][None], qd_b, kd_b))


def test_exact_where_it_can_be(device):
    """Float8 converts to bfloat16 exactly and per-tensor descales go into the softmax scale:
    without descales the call is the bfloat16 call on q, k, v as they are, bit for bit; a
    per-tensor descale as a number or a 0-d tensor gives the same bits, and its lse is the
    bfloat16 call's with softmax_scale * q_descale * k_descale."""
    q, k, v = (quantized((2, 6, 2, 32), E4M3, device) for _ in range(3))
    plain = flash_attn_func(q, k, v, causal=True, return_lse=True)
    as_bf16 = flash_attn_func(q.to(BF16), k.to(BF16), v.to(BF16), causal=True, return_lse=True)
    assert all(torch.equal(a, b) for a, b in zip(plain, as_bf16))
    qd, kd = 0.75 / AMAX, 1.25 / AMAX
    number = flash_attn_func(q, k, v, return_lse=True, q_descale=qd, k_descale=kd, v_descale=0.5)
    tensor = flash_attn_func(q, k, v, return_lse=True, q_descale=torch.tensor(qd, device=device),
                             k_descale=torch.tensor([kd], device=device), v_descale=torch.tensor(0.5, device=device))
    assert all(torch.equal(a, b) for a, b in zip(number, tensor))
    folded = flash_attn_func(q.to(BF16), k.to(BF16), v.to(BF16), softmax_scale=32 ** -0.5 * qd * kd,
                             return_lse=True)
    assert torch.equal(number[1], folded[1])
    assert torch.equal(number[0], folded[0] * 0.5)  # a power of two: exact


def test_output_is_bfloat16_under_autocast(device):
    q, k, v = (quantized((1, 4, 2, 16), E5M2, device) for _ in range(3))
    d = torch.full((1, 2), 1 / AMAX, device=device)
    expected = flash_attn_func(q, k, v, q_descale=d, k_descale=d, v_descale=d)
    with torch.autocast(torch.device(device).type, dtype=torch.float16):
        out = flash_attn_func(q, k, v, q_descale=d, k_descale=d, v_descale=d)
    assert out.dtype == BF16 and torch.equal(out, expected)


def test_flash_attn_interface(device):
    """The flash-attn names pass the descales on; return_attn_probs gives the probabilities of
    the dequantized scores (bfloat16) with the same out and lse."""
    qkv = quantized((2, 5, 3, 2, 16), E4M3, device)
    qd, kd, vd = descales("per_head", 2, 2, device)
    expected = flash_attn_func(*qkv.unbind(2), causal=True, return_lse=True, q_descale=qd, k_descale=kd,
                               v_descale=vd)
    out, lse, probs = flash_attn_interface.flash_attn_qkvpacked_func(qkv, causal=True, return_attn_probs=True,
                                                                      q_descale=qd, k_descale=kd, v_descale=vd)
    assert torch.equal(out, expected[0]) and torch.equal(lse, expected[1])
    q, k = bhld(*(dequantized(t, d) for t, d in zip(qkv.unbind(2), (qd, kd))))
    scores = (q @ k.transpose(-1, -2)) * 16 ** -0.5
    visible = torch.ones(5, 5, dtype=torch.bool, device=device).tril()
    ref = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    same = torch.softmax((q.to(BF16) @ k.to(BF16).transpose(-1, -2) * 16 ** -0.5).masked_fill(~visible,
                         float("-inf")).float(), dim=-1).to(BF16)
    assert probs.dtype == BF16
    assert_accurate("probs", probs, ref, same, REL_ATOL[BF16])
    packed = flash_attn_interface.flash_attn_kvpacked_func(qkv[:, :, 0], qkv[:, :, 1:], causal=True, q_descale=qd,
                                                           k_descale=kd, v_descale=vd)
    assert torch.equal(packed, expected[0])


def _call(device, q_dtype=E4M3, k_dtype=E4M3, grad=None, varlen=False, **kwargs):
    """flash_attn_func (or the varlen one, three sequences) on batch 2, two kv heads."""
    if varlen:
        q, k, v = (quantized((6, 2, 8), E4M3, device) for _ in range(3))
        cu = torch.tensor([0, 2, 4, 6], dtype=torch.int32, device=device)
        return flash_attn_varlen_func(q, k, v, cu, cu, 2, 2, **kwargs)
    def make(shape, dtype):
        return quantized(shape, dtype, device) if dtype in (E4M3, E5M2) else torch.randn(shape, dtype=dtype,
                                                                                         device=device)
    q, k = make((2, 3, 4, 8), q_dtype), make((2, 3, 2, 8), k_dtype)
    v = k.clone()
    if grad is not None:
        {"q": q, "k": k}.get(grad, kwargs.get(grad)).requires_grad_()
    return flash_attn_func(q, k, v, **kwargs)


def _errors(device):
    full = lambda shape: torch.full(shape, 0.01, device=device)  # noqa: E731
    return [
        (dict(q_dtype=BF16, k_dtype=BF16, q_descale=0.5), ValueError,
         ["q_descale", "float8", "bfloat16", "must be None"]),
        (dict(q_dtype=BF16, k_dtype=BF16, v_descale=full((2, 2))), ValueError, ["v_descale", "bfloat16"]),
        (dict(k_dtype=E5M2), ValueError, ["one float8 dtype", "q float8_e4m3fn", "k float8_e5m2"]),
        (dict(k_dtype=BF16), ValueError, ["one float8 dtype", "k bfloat16"]),
        (dict(grad="q"), RuntimeError, ["forward only", "'q' requires grad"]),
        (dict(grad="k_descale", k_descale=full((2, 2))), RuntimeError, ["forward only", "'k_descale' requires grad"]),
        (dict(dropout_p=0.1), ValueError, ["dropout_p must be 0", "float8", "0.1"]),
        (dict(k_descale=full((2, 2)).half()), ValueError, ["k_descale", "float32", "got dtype float16"]),
        (dict(q_descale=full((2, 2)).double()), ValueError, ["q_descale", "float32", "got dtype float64"]),
        (dict(v_descale=full((3,))), ValueError, ["v_descale", "(batch, heads_kv) = (2, 2)", "got shape (3,)"]),
        (dict(v_descale=full((2, 4))), ValueError, ["v_descale", "(2, 2)", "one element", "got shape (2, 4)"]),
        (dict(varlen=True, q_descale=full((2, 2))), ValueError,
         ["q_descale", "(num_sequences, heads_kv) = (3, 2)", "got shape (2, 2)"]),
        (dict(q_descale=torch.ones(2, 2, device="meta")), ValueError, ["q_descale", "device meta", "same device"]),
        (dict(k_descale="0.5"), TypeError, ["k_descale", "'0.5'", "real number"]),
        (dict(k_descale=True), TypeError, ["k_descale", "True", "real number"]),
        (dict(softmax_scale="x"), TypeError, ["softmax_scale", "'x'"]),
    ]


@pytest.mark.parametrize("case", range(16))
def test_errors(device, case):
    kwargs, error, words = _errors(device)[case]
    with pytest.raises(error) as info:
        _call(device, **kwargs)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_shape_errors_keep_their_messages(device):
    """Shape rules of every call hold for float8 calls, with the shapes the user passed."""
    q = quantized((2, 3, 3, 8), E4M3, device)
    k = quantized((2, 3, 2, 8), E4M3, device)
    with pytest.raises(RuntimeError, match=r"number of query heads \(3\) must be a multiple .* \(2\)"):
        flash_attn_func(q, k, k, q_descale=torch.ones(2, 2, device=device))
    with pytest.raises(ValueError, match="q must have 4 dimensions"):
        flash_attn_func(q[0], k, k)


def fp8_kernel_runs(device):
    device = torch.device(device)
    return (device.type == "cuda" and flashattn_ext.has_cuda_kernels()
            and torch.cuda.get_device_capability(device) == (9, 0))


def emulated_kernel(q, k, v, scale, causal):
    """out of the float8 kernel's arithmetic on float64 (batch, heads, len, dim) tensors: P = 2^8 x the
    unnormalized probabilities rounded to e4m3 in P V (the row sums from P unrounded), out rounded to
    bfloat16; rows that see no key give 0."""
    lq, lk = q.shape[2], k.shape[2]
    k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
    s = q @ k.transpose(-1, -2) * scale
    if causal:
        visible = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
        s = s.masked_fill(~visible, float("-inf"))
    m = s.amax(-1, keepdim=True).nan_to_num(neginf=0.0)
    p = torch.exp(s - m) * 256
    out = (p.to(E4M3).double() @ v) / p.sum(-1, keepdim=True)
    return out.nan_to_num(nan=0.0).to(BF16)


@pytest.mark.parametrize("kind", ["none", "tensor", "per_head", "mixed"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("lens", [(200, 333), (384, 256), (1, 1031)], ids=lambda x: f"{x[0]}x{x[1]}")
def test_kernel(device, kind, causal, lens, monkeypatch):
    """The sm_90 float8 kernel (e4m3, head_dim 128): out against the float64 reference within twice
    the error of its own arithmetic emulated in float64 (P rounded to e4m3), lse within the float8
    tensor cores' accumulation error of the scores; GQA, ragged key tiles, bottom-right causal with
    rows that see no key."""
    check_kernel(device, kind, causal, lens, (2, 4, 2), monkeypatch)


@pytest.mark.parametrize("kind", ["per_head", "mixed"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_kernel_persistent_grid(device, kind, causal, monkeypatch):
    """More work items than SMs: each block of the persistent grid walks several items of different (batch,
    kv head), each with its own descales (taken with the item, its output scaled by its own v_descale)."""
    check_kernel(device, kind, causal, (384, 640), (3, 48, 24), monkeypatch)


def check_kernel(device, kind, causal, lens, heads_shape, monkeypatch):
    if not fp8_kernel_runs(device):
        pytest.skip("the float8 kernel runs on sm_90 GPUs")
    calls = []
    kernel = flashattn_ext.ops.fwd_fp8_kernel()
    monkeypatch.setattr(flashattn_ext.ops, "fwd_fp8_kernel", lambda: lambda *a: calls.append(1) or kernel(*a))
    (len_q, len_k), (batch, heads, heads_kv), dim = lens, heads_shape, 128
    amax = 1.0 if kind == "none" else AMAX
    q, k, v = quantized_qkv(batch, len_q, len_k, heads, heads_kv, dim, E4M3, device, amax)
    qd, kd, vd = descales(kind, batch, heads_kv, device)
    out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True, q_descale=qd, k_descale=kd, v_descale=vd)
    assert calls, "the call did not run on the float8 kernel"
    q64, k64, v64 = bhld(dequantized(q, qd), dequantized(k, kd), dequantized(v, vd))
    ref_out, ref_lse = attention_ref(q64, k64, v64, dim ** -0.5, BOTTOM_RIGHT if causal else NONE)
    emulated = emulated_kernel(q64, k64, v64, dim ** -0.5, causal)
    assert out.dtype == BF16 and lse.dtype == torch.float32
    assert_accurate("out", out.transpose(1, 2), ref_out, emulated, OUT_ATOL)
    inf = ref_lse.isinf()
    assert torch.equal(lse.isinf(), inf) and not out.transpose(1, 2)[inf].any()
    # float8 tensor cores add the products of one S = Q K^T at ~14 bits of the sum's magnitude: a score
    # is off by up to ~2^-11 of sum |q_d k_d| x scale, and the lse by no more than the row's worst score.
    scale_bound = (q64.abs() @ expand_kv(k64.abs(), heads).transpose(-1, -2)).amax().item() * dim ** -0.5
    err = (lse.double() - ref_lse)[~inf].abs().max().item()
    assert err <= 2 ** -11 * scale_bound, f"lse: max error {err:.3e}, bound {2 ** -11 * scale_bound:.3e}"


@pytest.mark.skipif(not torch.cuda.is_available() or not flashattn_ext.has_cuda_kernels(), reason="CUDA graphs")
@pytest.mark.parametrize("dim", [32, 128])
def test_one_element_descales_under_cuda_graph_capture(dim):
    """Under capture a one-element descale is not read on the host: each replay uses the value it then
    holds, as a (batch, heads_kv) descale of that value does in an eager call (dim 128: the float8
    kernel on sm_90)."""
    q, k, v = (quantized((2, 8, 4, dim), E4M3, "cuda") for _ in range(3))
    qd, kd, vd = (torch.tensor(1 / AMAX, device="cuda") for _ in range(3))
    flash_attn_func(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd)  # warm-up outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attn_func(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd)
    for values in ((1 / AMAX, 1 / AMAX, 1 / AMAX), (0.5 / AMAX, 2 / AMAX, 0.25)):
        for d, x in zip((qd, kd, vd), values):
            d.fill_(x)
        graph.replay()
        full = [torch.full((2, 4), x, device="cuda") for x in values]
        eager = flash_attn_func(q, k, v, q_descale=full[0], k_descale=full[1], v_descale=full[2])
        torch.cuda.synchronize()
        assert torch.equal(out, eager), values

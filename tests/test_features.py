"""The optional features against a float64 plain-torch reference (feature_reference.py),
forward and backward, with the accuracy rule of DESIGN §4: attn_mask / attn_bias (bool and
float, broadcast, with the bias gradient), sliding window, ALiBi, softcap, dropout,
variable-length batches, and their combinations with causal, GQA and each other."""
import pytest
import torch
import torch.nn.functional as F

import flashattn_ext
from feature_reference import attention_ref, check_features
from flashattn_ext.ops import dropout_mask
from reference import BOTTOM_RIGHT, CAUSAL_IDS, CAUSAL_MODES, NONE, TOP_LEFT

DTYPES = [torch.float64, torch.float32, torch.bfloat16]
DTYPE_IDS = ["fp64", "fp32", "bf16"]
ALL_DTYPES = DTYPES + [torch.float16]  # for the combination tests
ALL_DTYPE_IDS = DTYPE_IDS + ["fp16"]
op = torch.ops.flashattn.fwd


def _qkv(dtype, device, b=2, hq=4, hkv=2, lq=70, lk=150, e=16, ev=16, mult=1.0):
    make = lambda *s: (mult * torch.randn(*s, dtype=torch.float32)).to(dtype=dtype, device=device).requires_grad_()
    return make(b, hq, lq, e), make(b, hkv, lk, e), make(b, hkv, lk, ev)


def _op(scale, causal, deterministic=False, **features):
    """fn(q, k, v, *extra) for check_features: extra leaves fill the features named in
    `features` whose value is None, in order (a differentiable bias)."""
    def fn(q, k, v, *extra):
        f = dict(features)
        for name, t in zip([n for n, x in features.items() if x is None], extra):
            f[name] = t
        return op(q, k, v, scale, causal, deterministic, **f)
    return fn


def _ref(scale, causal, **features):
    def fn(q, k, v, *extra):
        f = dict(features)
        for name, t in zip([n for n, x in features.items() if x is None], extra):
            f[name] = t
        return attention_ref(q, k, v, scale, causal, **f)
    return fn


# ---- attn_mask / attn_bias ----

MASK_SHAPES = {"LqLk": (1, 1, 70, 150), "B1LqLk": (2, 1, 70, 150), "1H1Lk": (1, 4, 1, 150), "full": (2, 4, 70, 150)}


def _mask(kind, shape, dtype, device):
    """A mask of `kind` with some fully masked rows (where the shape has rows)."""
    dead = (..., 3, slice(None)) if shape[2] > 1 else (slice(None), 1)  # a row, or a whole head
    if kind == "bool":
        m = torch.rand(shape, device=device) > 0.3
        m[dead] = False
        return m
    m = torch.randn(shape, device=device, dtype=torch.float32 if kind == "float32" else dtype)
    m = m.masked_fill(torch.rand(shape, device=device) < 0.2, float("-inf"))
    m[dead] = float("-inf")
    return m.requires_grad_()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("shape", list(MASK_SHAPES.values()), ids=list(MASK_SHAPES))
def test_attn_bias(device, dtype, kind, shape):
    """Through the op, broadcast dimensions given as size 1; the float bias gets its gradient
    (summed over those dimensions)."""
    q, k, v = _qkv(dtype, device)
    m = _mask(kind, shape, dtype, device)
    if kind == "bool":
        got = check_features(_op(0.3, NONE, attn_bias=m), _ref(0.3, NONE, bias=m), [q, k, v])
    else:
        got = check_features(_op(0.3, NONE, attn_bias=None), _ref(0.3, NONE, bias=None), [q, k, v, m])
        assert got["grad3"].shape == m.shape and got["grad3"].dtype == m.dtype
    dead = (~m if kind == "bool" else m == float("-inf")).all(-1).expand(2, 4, 70)
    assert dead.any() and torch.all(got["lse"][dead] == float("-inf")) and torch.all(got["out"][dead] == 0)


def test_float32_bias_with_bfloat16_inputs(device):
    q, k, v = _qkv(torch.bfloat16, device)
    m = _mask("float32", (2, 1, 70, 150), torch.bfloat16, device)
    got = check_features(_op(0.3, NONE, attn_bias=None), _ref(0.3, NONE, bias=None), [q, k, v, m])
    assert got["grad3"].dtype == torch.float32


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=ALL_DTYPE_IDS)
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("layout", ["rows_aligned", "key_padding", "keys_strided"])
@pytest.mark.parametrize("e", [16, 96, 192], ids=["e16", "e96", "e192"])
def test_attn_bias_layouts(device, dtype, kind, layout, e):
    """A (2, 4, 70, 150) bias as a view: of a buffer 160 keys wide (rows start 16-byte aligned,
    so the CUDA kernels copy them in 16-byte chunks, each row's last one in part), the same for
    a per-head key mask broadcast over the query rows (one row staged per tile), or of a
    transposed buffer (keys not contiguous: copied element by element). Head dims of three
    CUDA tiers."""
    q, k, v = _qkv(dtype, device, e=e, ev=e)
    if layout == "rows_aligned":
        m = _mask(kind, (2, 4, 70, 160), dtype, device).detach()[..., :150]
    elif layout == "key_padding":
        m = _mask(kind, (2, 4, 1, 160), dtype, device).detach()[..., :150].expand(2, 4, 70, 150)
    else:
        m = _mask(kind, (2, 4, 150, 70), dtype, device).detach().transpose(-1, -2)
    if kind == "bool":
        got = check_features(_op(0.3, NONE, attn_bias=m), _ref(0.3, NONE, bias=m), [q, k, v])
    else:
        m.requires_grad_()
        got = check_features(_op(0.3, NONE, attn_bias=None), _ref(0.3, NONE, bias=None), [q, k, v, m])
        assert got["grad3"].shape == m.shape
    dead = (~m if kind == "bool" else m == float("-inf")).all(-1)
    assert torch.all(got["lse"][dead] == float("-inf")) and torch.all(got["out"][dead] == 0)


def test_mask_read_in_place(device):
    """A broadcast mask reaches the op as a stride-0 view: no copy of it is made."""
    q, k, v = (t.detach() for t in _qkv(torch.float32, device))
    mask = torch.rand(70, 150, device=device) > 0.5
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        flashattn_ext.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    names = {e.name for e in prof.events()}
    assert any(n.startswith("flashattn::") for n in names)
    copies = names & {"aten::copy_", "aten::clone", "aten::contiguous", "aten::_to_copy"}
    assert not copies, f"the mask was copied: {sorted(copies)}"


@pytest.mark.parametrize("lead", [(), (2,), (2, 3)], ids=["3d", "4d", "5d"])
@pytest.mark.parametrize("mask_shape", [(9, 13), (4, 1, 13), (1, 9, 13)], ids=["LS", "H1S", "1LS"])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_sdpa_attn_mask_matches_torch(device, lead, mask_shape, kind):
    """flashattn_ext.scaled_dot_product_attention(attn_mask=...) equals torch's in float64,
    gradients (of the float mask too) included."""
    q, k, v = (torch.randn(lead + (4, n, 16), dtype=torch.float64, device=device, requires_grad=True)
               for n in (9, 13, 13))
    if kind == "bool":
        m = torch.rand(mask_shape, device=device) > 0.3
        m[..., 0] = True  # no fully masked row (torch's result for those changed across versions)
        leaves = (q, k, v)
    else:
        m = torch.randn(mask_shape, dtype=torch.float64, device=device, requires_grad=True)
        leaves = (q, k, v, m)
    out = flashattn_ext.scaled_dot_product_attention(q, k, v, attn_mask=m)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    dout = torch.randn_like(out)
    for g, e in zip(torch.autograd.grad(out, leaves, dout), torch.autograd.grad(expected, leaves, dout)):
        assert g.shape == e.shape
        torch.testing.assert_close(g, e, rtol=0, atol=1e-12)


# ---- sliding window, ALiBi, softcap ----

WINDOWS = [(16, 0), (0, 16), (40, -1), (-1, 3)]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("window", WINDOWS, ids=[f"{l}_{r}" for l, r in WINDOWS])
@pytest.mark.parametrize("causal,lq,lk", [(NONE, 300, 200), (BOTTOM_RIGHT, 150, 300), (TOP_LEFT, 300, 300)],
                         ids=["none_300x200", "bottom_right_150x300", "top_left_300x300"])
def test_window(device, dtype, window, causal, lq, lk):
    """Lengths past the forward's 256-row and 128-key tiles: whole tiles are skipped."""
    q, k, v = _qkv(dtype, device, b=1, lq=lq, lk=lk)
    features = dict(window_left=window[0], window_right=window[1])
    check_features(_op(0.25, causal, **features), _ref(0.25, causal, window=window), [q, k, v])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("mask", [None, "bool"], ids=["window", "window_bool_mask"])
@pytest.mark.parametrize("e", [64, 96, 128, 256])
def test_window_and_mask_at_tensor_core_dims(device, dtype, mask, e):
    """A window, alone and with a bool mask, at the head dims where the CUDA backward takes the
    2-D dK/dV kernel's feature variant (at 256 the mask's tiles do not fit beside it: the 1-D
    kernel), over several query and key tiles with ragged ends."""
    q, k, v = _qkv(dtype, device, b=1, hq=2, hkv=1, lq=200, lk=300, e=e, ev=e)
    features, ref_features = dict(window_left=70, window_right=10), dict(window=(70, 10))
    if mask is not None:
        features["attn_bias"] = ref_features["bias"] = _mask("bool", (1, 2, 200, 300), dtype, device)
    check_features(_op(e**-0.5, NONE, **features), _ref(e**-0.5, NONE, **ref_features), [q, k, v])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", [NONE, BOTTOM_RIGHT], ids=["none", "bottom_right"])
@pytest.mark.parametrize("per_batch", [False, True], ids=["H", "BH"])
def test_alibi(device, dtype, causal, per_batch):
    q, k, v = _qkv(dtype, device, lq=90, lk=70)
    slopes = torch.rand((2, 4) if per_batch else (4,), device=device)
    check_features(_op(0.25, causal, alibi_slopes=slopes), _ref(0.25, causal, alibi=slopes), [q, k, v])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", [NONE, BOTTOM_RIGHT], ids=["none", "bottom_right"])
def test_softcap(device, dtype, causal):
    """Scores up to ~20 against a cap of 5: the cap bends most of them."""
    q, k, v = _qkv(dtype, device, lq=90, lk=70, mult=2.0)
    check_features(_op(0.25, causal, softcap=5.0), _ref(0.25, causal, softcap=5.0), [q, k, v])


# ---- dropout ----

def _rng(seed):
    return torch.tensor([seed, 12345], dtype=torch.int64)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", [NONE, TOP_LEFT], ids=["none", "top_left"])
@pytest.mark.parametrize("p", [0.1, 0.6])
def test_dropout(device, dtype, causal, p):
    """Against the reference with the keep mask of the test helper (the same Philox stream)."""
    q, k, v = _qkv(dtype, device, lq=90, lk=140)
    keep = dropout_mask(_rng(7), 2, 4, 90, 140, p).to(device)
    check_features(_op(0.25, causal, dropout_p=p, rng_state=_rng(7)), _ref(0.25, causal, keep=keep, dropout_p=p),
                   [q, k, v])


def test_dropout_bits_are_philox_4x32_10():
    """Seed 0, offset 0: columns 0-3 of row 0 of head 0 take the words of Philox-4x32-10 at
    counter 0, key 0 (Random123's known answer 6627e8d5 e169c58d bc57ac4c 9b00dbd8); a score
    is kept iff its word is at least p * 2^32."""
    words = [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    zero = torch.zeros(2, dtype=torch.int64)
    for threshold in sorted(words) + [w + 1 for w in words]:
        keep = dropout_mask(zero, 1, 1, 1, 4, threshold / 2**32)[0, 0, 0]
        assert keep.tolist() == [w >= threshold for w in words], hex(threshold)


@pytest.mark.parametrize("p", [0.17, 0.5])
def test_dropout_keep_fraction_and_mask(device, p):
    """With q = 0 every probability is 1 / len_k and v = identity reads the keep mask out of
    the output: it equals the helper's mask (the same on every device), and the kept
    fraction over 2M scores is within 1% of 1 - p."""
    b, h, lq, lk = 2, 4, 1024, 256
    q = torch.zeros(b, h, lq, 8, device=device)
    k = torch.randn(b, h, lk, 8, device=device)
    v = torch.eye(lk, device=device).expand(b, h, lk, lk)
    out, _ = op(q, k, v, 1.0, NONE, dropout_p=p, rng_state=_rng(3))
    kept = out * lk * (1 - p)
    assert torch.all((kept - kept.round()).abs() < 1e-3)
    kept = kept.round().bool()
    assert torch.equal(kept.cpu(), dropout_mask(_rng(3), b, h, lq, lk, p))
    assert abs(kept.double().mean().item() - (1 - p)) < 0.01 * (1 - p)


def test_dropout_seeded_by_torch(device):
    """torch.manual_seed reproduces a call (output and gradients); another seed gives another mask."""
    q, k, v = (t.detach().transpose(1, 2) for t in _qkv(torch.float32, device, hq=2, hkv=2))

    def run(seed):
        torch.manual_seed(seed)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = flashattn_ext.flash_attn_func(*leaves, dropout_p=0.3, deterministic=True)
        return [out.detach()] + list(torch.autograd.grad(out.square().sum(), leaves))

    first, again, other = run(1), run(1), run(2)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(first[0], other[0])


# ---- combinations ----

@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=ALL_DTYPE_IDS)
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_window_alibi_softcap_dropout_gqa(device, dtype, deterministic):
    """Both backward paths of the CUDA kernels (dQ by atomics, and by its own kernel)."""
    q, k, v = _qkv(dtype, device, lq=140, lk=100, mult=2.0)
    slopes = torch.rand(2, 4, device=device)
    keep = dropout_mask(_rng(5), 2, 4, 140, 100, 0.2).to(device)
    fn = _op(0.25, BOTTOM_RIGHT, deterministic, window_left=30, window_right=-1, alibi_slopes=slopes, softcap=4.0,
             dropout_p=0.2, rng_state=_rng(5))
    ref = _ref(0.25, BOTTOM_RIGHT, window=(30, -1), alibi=slopes, softcap=4.0, keep=keep, dropout_p=0.2)
    check_features(fn, ref, [q, k, v], dlse=torch.randn(2, 4, 140, device=device))


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=ALL_DTYPE_IDS)
@pytest.mark.parametrize("causal", CAUSAL_MODES, ids=CAUSAL_IDS)
def test_bias_with_causal_softcap_dropout(device, dtype, causal):
    q, k, v = _qkv(dtype, device, lq=70, lk=90)
    m = _mask("float", (2, 1, 70, 90), dtype, device)
    keep = dropout_mask(_rng(9), 2, 4, 70, 90, 0.3).to(device)
    fn = _op(0.25, causal, attn_bias=None, softcap=3.0, dropout_p=0.3, rng_state=_rng(9))
    ref = _ref(0.25, causal, bias=None, softcap=3.0, keep=keep, dropout_p=0.3)
    check_features(fn, ref, [q, k, v, m])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim,head_dim_v", [(96, 96), (176, 192), (64, 200), (256, 256)])
def test_features_with_head_dims(device, dtype, head_dim, head_dim_v):
    """Every feature at the head-dim tiers above 64, among them those where the CUDA kernels cut
    the columns into slices (a block per slice recomputes the scores; one of them writes the
    bias gradient)."""
    q, k, v = _qkv(dtype, device, b=1, hq=2, hkv=1, lq=70, lk=90, e=head_dim, ev=head_dim_v)
    m = _mask("float", (1, 2, 70, 90), dtype, device)
    slopes = torch.rand(2, device=device)
    keep = dropout_mask(_rng(4), 1, 2, 70, 90, 0.2).to(device)
    fn = _op(head_dim**-0.5, BOTTOM_RIGHT, attn_bias=None, window_left=40, alibi_slopes=slopes, softcap=6.0,
             dropout_p=0.2, rng_state=_rng(4))
    ref = _ref(head_dim**-0.5, BOTTOM_RIGHT, bias=None, window=(40, -1), alibi=slopes, softcap=6.0, keep=keep,
               dropout_p=0.2)
    check_features(fn, ref, [q, k, v, m])


# ---- variable-length batches ----

def _assert_equal_to_rounding(got, expected):
    """Within a few roundings of the dtype, relative to the largest magnitude (at least 1);
    infinities (lse of rows with no key) at the same places."""
    rel = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2**-6, torch.float16: 2**-8}[got.dtype]
    assert torch.equal(got.isinf(), expected.isinf()) and torch.equal(got[got.isinf()], expected[expected.isinf()])
    fin = ~expected.isinf()
    if fin.any():
        scale = max(expected[fin].abs().max().item(), 1.0)
        assert (got[fin].double() - expected[fin].double()).abs().max().item() <= rel * scale


LENS = {"mixed": ([5, 0, 130, 300, 1], [7, 3, 130, 200, 0]), "equal": ([64, 64], [64, 64])}


def _packed(lens_q, lens_k, dtype, device, hq=4, hkv=2, e=16):
    cu = lambda lens: torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    make = lambda n, h: torch.randn(n, h, e, dtype=torch.float32).to(dtype=dtype, device=device).requires_grad_()
    return make(sum(lens_q), hq), make(sum(lens_k), hkv), make(sum(lens_k), hkv), cu(lens_q), cu(lens_k)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("features", ["plain", "window_alibi_softcap"])
@pytest.mark.parametrize("lens", list(LENS.values()), ids=list(LENS))
def test_varlen_equals_each_sequence_alone(device, dtype, causal, features, lens):
    """Sequences of lengths 0 to 300 (some with no key), each compared with flash_attn_func
    on that sequence alone: out and lse identical on CPU (the same kernel; on CUDA a plain
    call may take a tensor-core kernel, so there equal to rounding), gradients equal to
    rounding."""
    _check_varlen_against_each_sequence(device, dtype, causal, features, lens, e=16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("e", [64, 128, 256])
def test_varlen_at_tensor_core_dims(device, dtype, causal, e):
    """As above at the head dims where a CUDA varlen backward takes the 2-D dK/dV kernel's
    feature variant (and each sequence alone its plain variant)."""
    _check_varlen_against_each_sequence(device, dtype, causal, "plain", LENS["mixed"], e=e)


def _check_varlen_against_each_sequence(device, dtype, causal, features, lens, e):
    lens_q, lens_k = lens
    q, k, v, cu_q, cu_k = _packed(lens_q, lens_k, dtype, device, e=e)
    n = len(lens_q)
    opts = dict(causal=causal)
    slopes = torch.rand(n, 4, device=device)
    if features != "plain":
        opts.update(window_size=(20, 3), softcap=4.0)
    out, lse = flashattn_ext.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), return_lse=True,
                                                    alibi_slopes=None if features == "plain" else slopes, **opts)
    assert out.shape == (sum(lens_q), 4, e) and lse.shape == (4, sum(lens_q))
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    for b in range(n):
        rows = [slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1]), slice(cu_k[b], cu_k[b + 1])]
        alone = [t[r].detach()[None].requires_grad_() for t, r in zip((q, k, v), rows)]
        o, l = flashattn_ext.flash_attn_func(*alone, return_lse=True,
                                             alibi_slopes=None if features == "plain" else slopes[b:b + 1], **opts)
        if device == "cpu":
            assert torch.equal(o[0], out[rows[0]]) and torch.equal(l[0], lse[:, rows[0]])
        _assert_equal_to_rounding(out[rows[0]], o[0])
        _assert_equal_to_rounding(lse[:, rows[0]], l[0])
        if o.numel() == 0:
            continue
        for g_alone, g, r in zip(torch.autograd.grad(o, alone, dout[rows[0]][None]), grads, rows):
            _assert_equal_to_rounding(g[r], g_alone[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_varlen_dropout(device, dtype):
    """Sequence b uses [b, :, :len_q, :len_k] of the helper's mask for the batch of sequences."""
    lens_q, lens_k = [30, 0, 70], [50, 10, 40]
    q, k, v, cu_q, cu_k = _packed(lens_q, lens_k, dtype, device)
    keep = dropout_mask(_rng(11), 3, 4, 70, 50, 0.25).to(device)
    out, lse = op(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], 0.25, BOTTOM_RIGHT,
                  dropout_p=0.25, rng_state=_rng(11), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=70,
                  max_seqlen_k=50)
    for b in range(3):
        rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        seq = [t[r].detach().transpose(0, 1)[None] for t, r in ((q, rq), (k, rk), (v, rk))]
        ref_out, ref_lse = attention_ref(*(t.double() for t in seq), 0.25, BOTTOM_RIGHT,
                                         keep=keep[b:b + 1, :, :lens_q[b], :lens_k[b]], dropout_p=0.25)
        torch.testing.assert_close(out[0, :, rq].transpose(0, 1).double(), ref_out[0].transpose(0, 1),
                                   rtol=0, atol=2e-2 if dtype == torch.bfloat16 else 1e-5)
        torch.testing.assert_close(lse[0, :, rq].double(), ref_lse[0], rtol=0, atol=1e-5)

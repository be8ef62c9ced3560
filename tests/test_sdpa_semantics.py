"""SDPA's inputs beyond plain tensors (CausalBias masks, jagged nested tensors) and
flashattn_ext.attention, the function that takes every feature at once, against torch and
the float64 plain-torch reference."""
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right, causal_upper_left

import flashattn_ext
from feature_reference import attention_ref, check_features
from flashattn_ext.ops import dropout_mask, new_rng_state
from reference import BOTTOM_RIGHT, NONE, TOP_LEFT


def _leaves(*shapes, dtype=torch.float64, device="cpu"):
    return [torch.randn(s, dtype=dtype, device=device, requires_grad=True) for s in shapes]


def _assert_same_with_grads(out, expected, leaves, atol):
    torch.testing.assert_close(out, expected, rtol=0, atol=atol)
    dout = torch.randn_like(out)
    for g, e in zip(torch.autograd.grad(out, leaves, dout), torch.autograd.grad(expected, leaves, dout)):
        torch.testing.assert_close(g, e, rtol=0, atol=atol)


# ---- CausalBias ----

@pytest.mark.parametrize("make_bias", [causal_upper_left, causal_lower_right], ids=["upper_left", "lower_right"])
@pytest.mark.parametrize("lens", [(8, 16), (12, 12)], ids=["8x16", "12x12"])
def test_causal_bias_matches_torch(device, make_bias, lens):
    lq, lk = lens
    q, k, v = _leaves((2, 3, lq, 16), (2, 3, lk, 16), (2, 3, lk, 8), device=device)
    bias = make_bias(lq, lk)
    out = flashattn_ext.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    _assert_same_with_grads(out, F.scaled_dot_product_attention(q, k, v, attn_mask=bias), (q, k, v), 1e-12)


def test_causal_lower_right_more_queries_than_keys(device):
    """Bottom-right alignment with len_q > len_k: the first rows see no key and give 0."""
    q, k, v = _leaves((1, 2, 10, 16), (1, 2, 4, 16), (1, 2, 4, 16), device=device)
    out = flashattn_ext.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(10, 4))
    expected, _ = attention_ref(q, k, v, 0.25, BOTTOM_RIGHT)
    _assert_same_with_grads(out, expected, (q, k, v), 1e-12)
    assert out[:, :, :6].abs().sum() == 0


def test_causal_bias_errors(device):
    q = torch.randn(1, 2, 8, 16, device=device)
    with pytest.raises(ValueError, match=r"CausalBias for \(seq_len_q, seq_len_kv\) = \(8, 12\) .* \(8, 16\)"):
        flashattn_ext.scaled_dot_product_attention(q, q.repeat(1, 1, 2, 1), q.repeat(1, 1, 2, 1),
                                                   attn_mask=causal_lower_right(8, 12))
    with pytest.raises(RuntimeError, match="attn_mask and is_causal=True cannot be given together"):
        flashattn_ext.scaled_dot_product_attention(q, q, q, attn_mask=causal_upper_left(8, 8), is_causal=True)


# ---- jagged nested tensors ----

def _jagged(lens, heads, dim, dtype, device):
    """A (batch, heads, j, dim) jagged nested tensor that requires grad (SDPA's layout: a
    (batch, j, heads, dim) one transposed), and its sequences as dense leaves."""
    seqs = [torch.randn(n, heads, dim, dtype=dtype, device=device) for n in lens]
    nested = torch.nested.nested_tensor(seqs, layout=torch.jagged, requires_grad=True)
    return nested, nested.transpose(1, 2)


@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-12), (torch.float32, 5e-6)], ids=["fp64", "fp32"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_nested_self_attention(device, dtype, atol, is_causal):
    """Each sequence attends within itself, as SDPA on that sequence alone; the result is a
    nested tensor with query's lengths; gradients reach the nested inputs."""
    lens = [3, 9, 1, 6]
    leaf, x = _jagged(lens, 4, 16, dtype, device)
    out = flashattn_ext.scaled_dot_product_attention(x, x, x, is_causal=is_causal, scale=0.3)
    assert out.is_nested and out.shape[0] == 4 and out.shape[1] == 4 and out.shape[3] == 16
    assert [t.shape[1] for t in out.unbind()] == lens
    dout = torch.randn_like(out.values())  # (heads, total, dim), as out.values()
    (grad,) = torch.autograd.grad((out.values() * dout).sum(), leaf)
    offsets = x.offsets().tolist()
    for b, (seq, o, g) in enumerate(zip(leaf.unbind(), out.unbind(), grad.unbind())):
        dense = seq.detach().transpose(0, 1).double().requires_grad_()
        expected = F.scaled_dot_product_attention(dense, dense, dense, is_causal=is_causal, scale=0.3)
        torch.testing.assert_close(o.double(), expected, rtol=0, atol=atol)
        (expected_grad,) = torch.autograd.grad(expected, dense, dout[:, offsets[b]:offsets[b + 1]].double())
        torch.testing.assert_close(g.transpose(0, 1).double(), expected_grad, rtol=0, atol=atol * 10)


def test_nested_cross_attention_gqa(device):
    """Queries and keys of different lengths per sequence, fewer key/value heads."""
    lens_q, lens_k = [2, 7, 4], [5, 3, 8]
    _, q = _jagged(lens_q, 6, 16, torch.float64, device)
    _, k = _jagged(lens_k, 2, 16, torch.float64, device)
    v = torch.nested.nested_tensor_from_jagged(torch.randn(sum(lens_k), 2, 8, dtype=torch.float64, device=device),
                                               offsets=k.offsets()).transpose(1, 2)
    out = flashattn_ext.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    for o, qs, ks, vs in zip(out.unbind(), q.unbind(), k.unbind(), v.unbind()):
        expected = F.scaled_dot_product_attention(qs.detach(), ks.detach(), vs.detach(), enable_gqa=True)
        torch.testing.assert_close(o, expected, rtol=0, atol=1e-12)


def test_nested_errors(device):
    _, x = _jagged([3, 5], 2, 8, torch.float32, device)
    dense = torch.randn(2, 2, 5, 8, device=device)
    with pytest.raises(ValueError, match="attn_mask cannot be given with nested tensors"):
        flashattn_ext.scaled_dot_product_attention(x, x, x, attn_mask=torch.ones(5, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="all be nested tensors or all dense; key is a dense tensor"):
        flashattn_ext.scaled_dot_product_attention(x, dense, dense)
    strided = torch.nested.nested_tensor([torch.randn(2, 3, 8), torch.randn(2, 4, 8)]).to(device)
    with pytest.raises(ValueError, match="layout torch.strided; only layout=torch.jagged"):
        flashattn_ext.scaled_dot_product_attention(strided, strided, strided)
    untransposed = x.transpose(1, 2)
    with pytest.raises(ValueError, match=r"\(batch, heads, j, head_dim\).*ragged dimension at 1"):
        flashattn_ext.scaled_dot_product_attention(untransposed, untransposed, untransposed)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        _, k = _jagged([3, 5], 1, 8, torch.float32, device)
        flashattn_ext.scaled_dot_product_attention(x, k, k)


# ---- attention(): every feature together ----

def _features_fn(layout, **opts):
    def fn(q, k, v, bias):
        t = (lambda x: x.transpose(1, 2)) if layout == "blhd" else (lambda x: x)
        out, lse = flashattn_ext.attention(t(q), t(k), t(v), layout=layout, attn_mask=bias, return_lse=True, **opts)
        return t(out), lse
    return fn


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=["fp64", "fp32", "bf16"])
@pytest.mark.parametrize("layout", ["bhld", "blhd"])
@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
def test_attention_every_feature(device, dtype, layout, causal):
    """Float bias (with its gradient) + softcap + ALiBi + window + scale + causal + GQA
    against the float64 reference, with the accuracy rule."""
    make = lambda *s: torch.randn(*s, device=device).to(dtype).requires_grad_()
    q, k, v = make(2, 4, 30, 16), make(2, 2, 40, 16), make(2, 2, 40, 8)
    bias = torch.randn(2, 1, 30, 40, device=device).to(dtype).requires_grad_()
    slopes = torch.rand(4, device=device)
    code = {None: NONE, "top_left": TOP_LEFT, "bottom_right": BOTTOM_RIGHT}[causal]
    fn = _features_fn(layout, causal=causal, window_size=(12, 5), softcap=3.0, alibi_slopes=slopes, scale=0.4)

    def ref(q_, k_, v_, bias_):
        return attention_ref(q_, k_, v_, 0.4, code, bias=bias_, window=(12, 5), alibi=slopes, softcap=3.0)

    check_features(fn, ref, [q, k, v, bias])


def test_attention_dropout_with_bool_mask(device):
    """Dropout (from torch's generator) with a bool mask and bottom-right causal: the same as
    the reference with the keep mask of the state the call drew."""
    q, k, v = _leaves((2, 2, 20, 16), (2, 2, 30, 16), (2, 2, 30, 16), device=device)
    mask = torch.rand(2, 1, 20, 30, device=device) > 0.2
    torch.manual_seed(5)
    rng_state = new_rng_state(q.device)
    torch.manual_seed(5)
    out = flashattn_ext.attention(q, k, v, attn_mask=mask, causal="bottom_right", dropout_p=0.3)
    keep = dropout_mask(rng_state, 2, 2, 20, 30, 0.3).to(device)
    expected, _ = attention_ref(q, k, v, 0.25, BOTTOM_RIGHT, bias=mask, keep=keep, dropout_p=0.3)
    _assert_same_with_grads(out, expected, (q, k, v), 1e-12)


def test_attention_plain_is_sdpa(device):
    q, k, v = _leaves((2, 3, 9, 16), (2, 3, 9, 16), (2, 3, 9, 16), device=device)
    out = flashattn_ext.attention(q, k, v, causal="top_left")
    _assert_same_with_grads(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), 1e-12)


def test_attention_errors(device):
    x = torch.randn(1, 2, 5, 8, device=device)
    with pytest.raises(ValueError, match="layout must be 'bhld' .* or 'blhd' .*, got 'bshd'"):
        flashattn_ext.attention(x, x, x, layout="bshd")
    for bad in (True, 1, "causal"):
        with pytest.raises(ValueError, match=f"causal must be None, 'top_left' or 'bottom_right', got {bad!r}"):
            flashattn_ext.attention(x, x, x, causal=bad)
    with pytest.raises(ValueError, match=r"q must have 4 dimensions \(batch, len, heads, dim\) for layout='blhd'"):
        flashattn_ext.attention(x[0], x, x, layout="blhd")
    with pytest.raises(ValueError, match="attn_mask of shape .* does not broadcast"):
        flashattn_ext.attention(x, x, x, attn_mask=torch.ones(3, 5, 5, dtype=torch.bool, device=device))


def test_attention_compile_fullgraph(device):
    """torch.compile(fullgraph=True) traces attention() with a mask and every modifier, and
    scaled_dot_product_attention with a CausalBias built outside the compiled function."""
    q, k, v = _leaves((2, 4, 12, 16), (2, 2, 20, 16), (2, 2, 20, 16), device=device)
    mask = torch.rand(2, 1, 12, 20, device=device) > 0.2
    alibi = torch.rand(4, device=device)

    def every_feature(q_, k_, v_):
        return flashattn_ext.attention(q_, k_, v_, attn_mask=mask, causal="bottom_right", window_size=(9, 2),
                                       softcap=2.0, alibi_slopes=alibi)

    bias = causal_lower_right(12, 20)

    def with_causal_bias(q_, k_, v_):
        return flashattn_ext.scaled_dot_product_attention(q_, k_, v_, attn_mask=bias, enable_gqa=True)

    for fn in (every_feature, with_causal_bias):
        compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
        _assert_same_with_grads(compiled(q, k, v), fn(q, k, v), (q, k, v), 1e-12)

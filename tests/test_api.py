"""The public functions: flashattn_ext.scaled_dot_product_attention (SDPA semantics on
(..., H, L, E)) and flashattn_ext.flash_attn_func (flash-attn semantics on (B, L, H, E))."""
import pytest
import torch
import torch.nn.functional as F

import flashattn_ext
from reference import BOTTOM_RIGHT, NONE, TOP_LEFT, attention, check_against_reference, ours


def _leaves(*shapes, dtype=torch.float64, device="cpu"):
    return [torch.randn(s, dtype=dtype, device=device, requires_grad=True) for s in shapes]


def _grads(outputs, inputs, grad_outputs):
    return torch.autograd.grad(outputs, inputs, grad_outputs)


@pytest.mark.parametrize("lead", [(), (2,), (2, 3)], ids=["3d", "4d", "5d"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_sdpa_matches_torch(device, lead, is_causal):
    q, k, v = _leaves(lead + (4, 9, 16), lead + (4, 13, 16), lead + (4, 13, 8), device=device)
    out = flashattn_ext.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    assert out.shape == expected.shape == lead + (4, 9, 8)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    dout = torch.randn_like(out)
    for g, e in zip(_grads(out, (q, k, v), dout), _grads(expected, (q, k, v), dout)):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_sdpa_accuracy_5d(device, dtype, is_causal):
    q, k, v = (torch.randn(2, 2, 3, 40, 32, dtype=dtype, device=device) for _ in range(3))
    check_against_reference(
        q, k, v, 32**-0.5, TOP_LEFT if is_causal else NONE,
        fn=lambda q_, k_, v_: (flashattn_ext.scaled_dot_product_attention(q_, k_, v_, is_causal=is_causal),
                               ours(q_.flatten(0, 1), k_.flatten(0, 1), v_.flatten(0, 1), 32**-0.5,
                                    TOP_LEFT if is_causal else NONE)[1].unflatten(0, (2, 2))))


@pytest.mark.parametrize("is_causal", [False, True])
def test_sdpa_gqa_and_scale(device, is_causal):
    q, k, v = _leaves((2, 6, 11, 16), (2, 2, 7, 16), (2, 2, 7, 24), device=device)
    out = flashattn_ext.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=0.37, enable_gqa=True)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=0.37, enable_gqa=True)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    dout = torch.randn_like(out)
    for g, e in zip(_grads(out, (q, k, v), dout), _grads(expected, (q, k, v), dout)):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-12)


def test_sdpa_default_scale(device):
    q, k, v = _leaves((1, 2, 5, 20), (1, 2, 6, 20), (1, 2, 6, 20), device=device)
    out = flashattn_ext.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(out, ours(q, k, v, 20**-0.5, NONE)[0], rtol=0, atol=0)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("len_q,len_k", [(9, 9), (5, 12), (12, 5)])
@pytest.mark.parametrize("heads_kv", [4, 2, 1])
def test_flash_attn_func_matches_sdpa(device, causal, len_q, len_k, heads_kv):
    """flash_attn_func on (B, L, H, E) equals SDPA on the transposed views, causal aligned
    bottom-right; gradients and lse too."""
    q, k, v = _leaves((2, len_q, 4, 16), (2, len_k, heads_kv, 16), (2, len_k, heads_kv, 8), device=device)
    out, lse = flashattn_ext.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    assert out.shape == (2, len_q, 4, 8) and lse.shape == (2, 4, len_q) and lse.dtype == torch.float64
    mode = BOTTOM_RIGHT if causal else NONE
    ref_out, ref_lse = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 16**-0.5, mode)
    torch.testing.assert_close(out, ref_out.transpose(1, 2), rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-12)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse).masked_fill(lse.isinf(), 0)
    for g, e in zip(_grads((out, lse), (q, k, v), (dout, dlse)),
                    _grads((ref_out.transpose(1, 2), ref_lse), (q, k, v), (dout, dlse))):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_func_accuracy(device, dtype, causal):
    q, k, v = (torch.randn(2, 3, 50, 32, dtype=dtype, device=device) for _ in range(3))
    k, v = k[:, :, :37], v[:, :, :37]

    def fn(q_, k_, v_):
        out, lse = flashattn_ext.flash_attn_func(q_.transpose(1, 2), k_.transpose(1, 2), v_.transpose(1, 2),
                                                 causal=causal, return_lse=True)
        return out.transpose(1, 2), lse

    check_against_reference(q, k, v, 32**-0.5, BOTTOM_RIGHT if causal else NONE, fn=fn,
                            dlse=torch.randn(2, 3, 50, device=device))


def test_flash_attn_func_outputs(device):
    q, k, v = _leaves((1, 5, 2, 8), (1, 5, 2, 8), (1, 5, 2, 8), dtype=torch.bfloat16, device=device)
    out = flashattn_ext.flash_attn_func(q, k, v, softmax_scale=0.5)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and out.shape == (1, 5, 2, 8)
    # Its memory order is (B, L, H, E), like the inputs.
    assert out.is_contiguous()
    out2, lse = flashattn_ext.flash_attn_func(q, k, v, softmax_scale=0.5, return_lse=True)
    assert torch.equal(out, out2) and lse.dtype == torch.float32 and lse.shape == (1, 2, 5)
    out3, lse3 = ours(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.5, NONE)
    assert torch.equal(out, out3.transpose(1, 2)) and torch.equal(lse, lse3)


def _head_dim_view(shape, how, device):
    """A float64 tensor of `shape` whose last dimension is not contiguous, in the autograd graph of a leaf."""
    *lead, rows, dim = shape
    if how == "strided":
        return torch.randn(*lead, rows, 2 * dim, dtype=torch.float64, device=device, requires_grad=True)[..., ::2]
    if how == "transposed":
        return torch.randn(*lead, dim, rows, dtype=torch.float64, device=device, requires_grad=True).transpose(-1, -2)
    return torch.randn(*lead, rows, 1, dtype=torch.float64, device=device, requires_grad=True).expand(shape)


def _flash(fn, q, k, v, **kwargs):
    out = fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **kwargs)
    return (out[0] if isinstance(out, tuple) else out).transpose(1, 2)


def _varlen(q, k, v):
    cu_q = torch.tensor([0, 2, q.shape[2]], dtype=torch.int32, device=q.device)
    cu_k = torch.tensor([0, 3, k.shape[2]], dtype=torch.int32, device=q.device)
    out = flashattn_ext.flash_attn_varlen_func(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1),
                                               cu_q, cu_k, q.shape[2], k.shape[2], causal=True)
    return out.transpose(0, 1)[None]


_ENTRY_POINTS = {
    "sdpa": lambda q, k, v: flashattn_ext.scaled_dot_product_attention(q, k, v, is_causal=True),
    "sdpa_mask": lambda q, k, v: flashattn_ext.scaled_dot_product_attention(
        q, k, v, attn_mask=torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()),
    "attention": lambda q, k, v: flashattn_ext.attention(q, k, v),
    "flash_attn_func": lambda q, k, v: _flash(flashattn_ext.flash_attn_func, q, k, v, causal=True),
    "flash_attn_func_window": lambda q, k, v: _flash(flashattn_ext.flash_attn_func, q, k, v, window_size=(2, 1)),
    "attn_probs": lambda q, k, v: _flash(flashattn_ext.flash_attn_interface.flash_attn_func, q, k, v,
                                         return_attn_probs=True),
    "varlen": _varlen,
}


@pytest.mark.parametrize("how", ["strided", "transposed", "expanded"])
@pytest.mark.parametrize("entry", list(_ENTRY_POINTS))
def test_head_dim_not_contiguous(device, entry, how):
    """torch's SDPA and flash-attn take q, k, v whose last dimension is not contiguous (a strided, transposed or
    expanded head dim) by copying them; every public function does too: the output and gradients the contiguous
    tensors give, on two calls (the second must not take a fast path that hands the view to the op)."""
    call = _ENTRY_POINTS[entry]
    shapes = (1, 2, 7, 8), (1, 2, 9, 8), (1, 2, 9, 8)
    dout = torch.randn(1, 2, 7, 8, dtype=torch.float64, device=device)
    for which in range(3):
        args = _leaves(*shapes, device=device)
        args[which] = _head_dim_view(shapes[which], how, device)
        plain = [a.detach().contiguous().requires_grad_() for a in args]
        want = call(*plain)
        want_grads = _grads(want, plain, dout)
        for _ in range(2):
            got = call(*args)
            assert torch.equal(got, want)
            assert all(torch.equal(g, w) for g, w in zip(_grads(got, args, dout), want_grads))

"""flash-attn 2's API: the packed variants (the same results as flash_attn_func /
flash_attn_varlen_func on the unpacked views, gradients reaching the packed tensor),
return_attn_probs (out, softmax_lse, S_dmask) with S_dmask checked against the float64
reference probabilities and the dropout pattern against the output it produced, and the
bert_padding helpers unpad_input / pad_input."""
import math

import pytest
import torch

import flashattn_ext
from feature_reference import alibi_ref, check_features, visible
from flashattn_ext.flash_attn_interface import (flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                                                flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func)
from reference import BOTTOM_RIGHT, NONE

FEATURES = {"plain": {}, "all": dict(causal=True, window_size=(6, 2), softcap=3.0)}


def _grads(out, leaves, seed=1):
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype).to(out.device)
    return torch.autograd.grad(out, leaves, dout)


@pytest.mark.parametrize("features", FEATURES)
def test_qkvpacked_is_flash_attn_func_on_views(device, features):
    qkv = torch.randn(2, 11, 3, 4, 16, dtype=torch.float64, device=device, requires_grad=True)
    out = flash_attn_qkvpacked_func(qkv, softmax_scale=0.3, **FEATURES[features])
    q, k, v = (qkv[:, :, i].detach().requires_grad_() for i in range(3))
    expected = flashattn_ext.flash_attn_func(q, k, v, softmax_scale=0.3, **FEATURES[features])
    assert torch.equal(out, expected)
    assert torch.equal(_grads(out, qkv)[0], torch.stack(_grads(expected, (q, k, v)), dim=2))


def test_kvpacked_gqa_is_flash_attn_func_on_views(device):
    q = torch.randn(2, 9, 6, 16, dtype=torch.float64, device=device, requires_grad=True)
    kv = torch.randn(2, 13, 2, 2, 16, dtype=torch.float64, device=device, requires_grad=True)
    out = flash_attn_kvpacked_func(q, kv, causal=True)
    q2, k, v = q.detach().requires_grad_(), kv[:, :, 0].detach().requires_grad_(), kv[:, :, 1].detach().requires_grad_()
    expected = flashattn_ext.flash_attn_func(q2, k, v, causal=True)
    assert torch.equal(out, expected)
    dq, dkv = _grads(out, (q, kv))
    dq2, dk, dv = _grads(expected, (q2, k, v))
    assert torch.equal(dq, dq2) and torch.equal(dkv, torch.stack((dk, dv), dim=2))


def _cu(lens, device):
    return torch.tensor([0] + lens, dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)


@pytest.mark.parametrize("features", FEATURES)
def test_varlen_packed_are_varlen_func_on_views(device, features):
    lens_q, lens_k = [5, 0, 12], [7, 3, 12]
    cu_q, cu_k = _cu(lens_q, device), _cu(lens_k, device)
    qkv = torch.randn(sum(lens_q), 3, 4, 16, dtype=torch.float64, device=device, requires_grad=True)
    out = flash_attn_varlen_qkvpacked_func(qkv, cu_q, max(lens_q), **FEATURES[features])
    q, k, v = (qkv[:, i].detach().requires_grad_() for i in range(3))
    expected = flashattn_ext.flash_attn_varlen_func(q, k, v, cu_q, cu_q, max(lens_q), max(lens_q), **FEATURES[features])
    assert torch.equal(out, expected)
    assert torch.equal(_grads(out, qkv)[0], torch.stack(_grads(expected, (q, k, v)), dim=1))

    q = torch.randn(sum(lens_q), 4, 16, dtype=torch.float64, device=device, requires_grad=True)
    kv = torch.randn(sum(lens_k), 2, 2, 16, dtype=torch.float64, device=device, requires_grad=True)
    out = flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, max(lens_q), max(lens_k), **FEATURES[features])
    k, v = kv[:, 0].detach().requires_grad_(), kv[:, 1].detach().requires_grad_()
    expected = flashattn_ext.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                                    **FEATURES[features])
    assert torch.equal(out, expected)
    dq, dkv = _grads(out, (q, kv))
    dq2, dk, dv = _grads(expected, (q, k, v))
    assert torch.equal(dq, dq2) and torch.equal(dkv, torch.stack((dk, dv), dim=1))


def test_qkvpacked_accuracy_bf16(device):
    """The packed path against the float64 reference with the accuracy rule (bf16)."""
    from feature_reference import attention_ref
    qkv = torch.randn(2, 40, 3, 4, 32, device=device).to(torch.bfloat16).requires_grad_()

    def ours(t):
        out, lse, _ = flash_attn_qkvpacked_func(t, causal=True, return_attn_probs=True)
        return out.transpose(1, 2), lse

    def ref(t):
        q, k, v = (t[:, :, i].transpose(1, 2) for i in range(3))
        return attention_ref(q, k, v, 32**-0.5, BOTTOM_RIGHT)

    check_features(ours, ref, [qkv], names=["out", "lse", "dqkv"])


def _reference_probs(q, k, scale, causal, window=(-1, -1), softcap=0.0, alibi=None):
    """float64 softmax probabilities on (batch, heads, len, dim) tensors; rows that see no key are 0."""
    q, k = q.double(), k.double()
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = scale * q @ k.transpose(-1, -2)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if alibi is not None:
        s = s + alibi_ref(alibi, q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.device)
    s = s.masked_fill(~visible(q.shape[2], k.shape[2], causal, window, q.device), float("-inf"))
    return torch.softmax(s, dim=-1).nan_to_num(0.0)


@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-12), (torch.float32, 5e-6)], ids=["fp64", "fp32"])
@pytest.mark.parametrize("features", FEATURES)
def test_return_attn_probs(device, dtype, atol, features):
    """S_dmask is the softmax probabilities (batch, heads, len_q, len_k), with every option;
    softmax_lse is flash-attn's (batch, heads, len_q); out is as without return_attn_probs."""
    q = torch.randn(2, 7, 6, 16, dtype=dtype, device=device)
    k, v = (torch.randn(2, 12, 2, 16, dtype=dtype, device=device) for _ in range(2))
    slopes = torch.rand(2, 6, device=device)
    opts = dict(FEATURES[features], alibi_slopes=slopes if features == "all" else None)
    out, lse, probs = flashattn_ext.flash_attn_func(q, k, v, return_attn_probs=True, **opts)
    assert out.dtype == probs.dtype == dtype and probs.shape == (2, 6, 7, 12) and lse.shape == (2, 6, 7)
    assert torch.equal(out, flashattn_ext.flash_attn_func(q, k, v, **opts))
    expected = _reference_probs(q.transpose(1, 2), k.transpose(1, 2), 16**-0.5, BOTTOM_RIGHT if opts.get("causal")
                                else NONE, opts.get("window_size", (-1, -1)), opts.get("softcap", 0.0),
                                opts["alibi_slopes"])
    torch.testing.assert_close(probs.double(), expected, rtol=0, atol=atol)
    rebuilt = torch.einsum("bhij,bjhd->bihd", probs.double(), v.double().repeat_interleave(3, dim=2))
    torch.testing.assert_close(rebuilt, out.double(), rtol=0, atol=atol * 10)


def test_return_attn_probs_encodes_dropout(device):
    """With dropout, S_dmask is negative exactly where the call dropped a score: the kept
    probabilities, rescaled by 1 / (1 - p), reproduce the call's output; |S_dmask| are the
    probabilities without dropout."""
    q, k, v = (torch.randn(2, 20, 2, 16, dtype=torch.float64, device=device) for _ in range(3))
    out, _, probs = flashattn_ext.flash_attn_func(q, k, v, dropout_p=0.4, return_attn_probs=True)
    _, _, plain = flashattn_ext.flash_attn_func(q, k, v, return_attn_probs=True)
    dropped = (probs < 0).double().mean().item()
    assert 0.3 < dropped < 0.5
    torch.testing.assert_close(probs.abs(), plain, rtol=0, atol=1e-15)
    rebuilt = torch.einsum("bhij,bjhd->bihd", probs.clamp(min=0) / 0.6, v)
    torch.testing.assert_close(rebuilt, out, rtol=0, atol=1e-12)


def test_varlen_return_attn_probs(device):
    """Sequence b's probabilities sit in S_dmask[b, :, :len_q, :len_k], zeros elsewhere; lse is (heads, total_q)."""
    lens_q, lens_k = [4, 9, 0], [6, 9, 5]
    cu_q, cu_k = _cu(lens_q, device), _cu(lens_k, device)
    q = torch.randn(sum(lens_q), 4, 16, dtype=torch.float64, device=device)
    k, v = (torch.randn(sum(lens_k), 2, 16, dtype=torch.float64, device=device) for _ in range(2))
    slopes = torch.rand(4, device=device)
    out, lse, probs = flashattn_ext.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 9, causal=True, softcap=2.0,
                                                            alibi_slopes=slopes, return_attn_probs=True)
    assert probs.shape == (3, 4, 9, 9) and lse.shape == (4, 13)
    for b in range(3):
        rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        expected = _reference_probs(q[rq].transpose(0, 1)[None], k[rk].transpose(0, 1)[None], 0.25, BOTTOM_RIGHT,
                                    softcap=2.0, alibi=slopes)[0]
        torch.testing.assert_close(probs[b, :, :lens_q[b], :lens_k[b]], expected, rtol=0, atol=1e-12)
        assert probs[b, :, lens_q[b]:].abs().sum() == 0 and probs[b, :, :, lens_k[b]:].abs().sum() == 0


def test_packed_errors(device):
    x = torch.randn(2, 5, 4, 16, device=device)
    with pytest.raises(ValueError, match=r"qkv must have shape \(batch, seq_len, 3, heads, head_dim\).* 16\)"):
        flash_attn_qkvpacked_func(x)
    with pytest.raises(ValueError, match=r"kv must have shape .* with 2 at dimension 2"):
        flash_attn_kvpacked_func(x, torch.randn(2, 5, 3, 4, 16, device=device))
    with pytest.raises(TypeError, match="qkv must be a torch.Tensor, got list"):
        flash_attn_varlen_qkvpacked_func([x], None, 5)
    cu = torch.tensor([0, 5], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="block_table .* is not supported"):
        flashattn_ext.flash_attn_varlen_func(x[0], x[0], x[0], cu, cu, 5, 5, block_table=torch.zeros(1, 1))


# ---- bert_padding ----

def _padding_mask(lens, seqlen, left, device):
    pos = torch.arange(seqlen, device=device)[None]
    lens = torch.tensor(lens, device=device)[:, None]
    return pos >= seqlen - lens if left else pos < lens


@pytest.mark.parametrize("left", [False, True], ids=["right_padded", "left_padded"])
def test_unpad_pad_roundtrip(device, left):
    lens = [3, 6, 0, 5]
    x = torch.randn(4, 6, 2, 3, dtype=torch.float64, device=device, requires_grad=True)
    mask = _padding_mask(lens, 6, left, device).int()
    rows, indices, cu, max_len, used = flashattn_ext.unpad_input(x, mask)
    assert cu.dtype == used.dtype == torch.int32 and indices.dtype == torch.int64
    assert cu.tolist() == [0, 3, 9, 9, 14] and used.tolist() == lens and max_len == 6
    assert torch.equal(rows, x[mask.bool()])
    back = flashattn_ext.pad_input(rows, indices, 4, 6)
    assert torch.equal(back, x * mask[:, :, None, None])
    (grad,) = torch.autograd.grad(back, x, torch.ones_like(back))
    assert torch.equal(grad, mask[:, :, None, None].expand_as(x).double())


def test_unpad_input_unused_mask(device):
    x = torch.arange(8, dtype=torch.float32, device=device).view(2, 4, 1)
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]], device=device)
    unused = torch.tensor([[0, 0, 1, 0], [0, 1, 1, 0]], device=device)
    rows, indices, cu, max_len, used = flashattn_ext.unpad_input(x, mask, unused)
    assert rows.flatten().tolist() == [0, 1, 2, 4, 5, 6] and indices.tolist() == [0, 1, 2, 4, 5, 6]
    assert cu.tolist() == [0, 3, 6] and max_len == 3 and used.tolist() == [2, 1]


@pytest.mark.parametrize("causal", [False, True])
def test_unpad_varlen_pad_matches_padded_attention(device, causal):
    """HF's flash-attention path: unpad -> varlen -> pad gives, on every token, what masked
    attention on the padded (right-padded) batch gives."""
    lens, seqlen = [5, 8, 2], 8
    mask = _padding_mask(lens, seqlen, False, device)
    q, k, v = (torch.randn(3, seqlen, 4, 16, dtype=torch.float64, device=device) for _ in range(3))
    (q_rows, indices, cu, max_len, _), k_rows, v_rows = (flashattn_ext.unpad_input(q, mask),
                                                        flashattn_ext.unpad_input(k, mask)[0],
                                                        flashattn_ext.unpad_input(v, mask)[0])
    out = flashattn_ext.flash_attn_varlen_func(q_rows, k_rows, v_rows, cu, cu, max_len, max_len, causal=causal)
    out = flashattn_ext.pad_input(out, indices, 3, seqlen)
    keep = mask[:, None, None, :] & (torch.ones(seqlen, seqlen, device=device).tril().bool() if causal else True)
    expected = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                                v.transpose(1, 2), attn_mask=keep).transpose(1, 2)
    torch.testing.assert_close(out[mask], expected[mask], rtol=0, atol=1e-12)
    assert out[~mask].abs().sum() == 0
    assert math.isfinite(out.sum().item())

"""flashattn_ext.nn: MultiheadAttention against torch.nn.MultiheadAttention with the same
state_dict (outputs, attention weights, input and parameter gradients, in float64 and
float32), and Attention against the same block written with torch's SDPA."""
import pytest
import torch
import torch.nn.functional as F

import flashattn_ext.nn as fnn
from feature_reference import attention_ref
from reference import TOP_LEFT

TOL = {torch.float64: 1e-12, torch.float32: 2e-5}
DTYPES = pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
N, L, S, E, HEADS = 3, 6, 9, 32, 4


def _pair(dtype, device, **kwargs):
    """torch's module and ours, ours loaded from torch's state_dict."""
    ref = torch.nn.MultiheadAttention(E, HEADS, dtype=dtype, device=device, **kwargs)
    ours = fnn.MultiheadAttention(E, HEADS, dtype=dtype, device=device, **kwargs)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def _inputs(dtype, device, batch_first, kdim=E, vdim=E, self_attention=False):
    shape = lambda length, dim: (N, length, dim) if batch_first else (length, N, dim)
    q = torch.randn(shape(L, E), dtype=dtype, device=device, requires_grad=True)
    if self_attention:
        return q, q, q
    k = torch.randn(shape(S, kdim), dtype=dtype, device=device, requires_grad=True)
    v = torch.randn(shape(S, vdim), dtype=dtype, device=device, requires_grad=True)
    return q, k, v


def _masks(kind, dtype, device, length_k=S):
    """(key_padding_mask, attn_mask) of a kind; no query loses every key."""
    padding = torch.zeros(N, length_k, dtype=torch.bool, device=device)
    padding[0, -3:] = True
    padding[2, :2] = True
    allowed = torch.rand(L, length_k, device=device) > 0.4
    allowed[:, 4] = True
    if kind == "none":
        return None, None
    if kind == "padding_bool":
        return padding, None
    if kind == "both_bool":
        return padding, ~allowed
    if kind == "float_3d":  # (N * heads, L, S) float mask with a bool padding mask
        return padding, torch.randn(N * HEADS, L, length_k, dtype=dtype, device=device)
    if kind == "float_padding":  # float key_padding_mask, float 2-D mask
        return (torch.zeros(N, length_k, dtype=dtype, device=device).masked_fill(padding, float("-inf")),
                torch.randn(L, length_k, dtype=dtype, device=device))
    raise ValueError(kind)


def _compare(ref, ours, inputs, dtype, **call):
    """Outputs, weights and the gradients of inputs and parameters of both modules."""
    expected, expected_w = ref(*inputs, **call)
    out, w = ours(*inputs, **call)
    tol = TOL[dtype]
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)
    assert (w is None) == (expected_w is None)
    if w is not None:
        torch.testing.assert_close(w, expected_w, rtol=tol, atol=tol)
    dout = torch.randn_like(out)
    leaves = [t for t in dict.fromkeys(inputs) if t.requires_grad]
    got = torch.autograd.grad(out, leaves + list(ours.parameters()), dout)
    want = torch.autograd.grad(expected, leaves + list(ref.parameters()), dout)
    names = [f"input{i}" for i in range(len(leaves))] + [n for n, _ in ours.named_parameters()]
    for name, g, e in zip(names, got, want):
        torch.testing.assert_close(g, e, rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")


@DTYPES
@pytest.mark.parametrize("batch_first", [False, True], ids=["seq_first", "batch_first"])
@pytest.mark.parametrize("masks", ["none", "padding_bool", "both_bool", "float_3d", "float_padding"])
@pytest.mark.parametrize("need_weights", [False, True], ids=["no_weights", "weights"])
def test_mha_matches_torch(device, dtype, batch_first, masks, need_weights):
    ref, ours = _pair(dtype, device, batch_first=batch_first)
    padding, attn_mask = _masks(masks, dtype, device)
    _compare(ref, ours, _inputs(dtype, device, batch_first), dtype, key_padding_mask=padding, attn_mask=attn_mask,
             need_weights=need_weights)


@DTYPES
@pytest.mark.parametrize("options", [dict(kdim=12, vdim=20), dict(bias=False), dict(add_bias_kv=True),
                                     dict(add_zero_attn=True), dict(add_bias_kv=True, add_zero_attn=True)],
                         ids=["kdim_vdim", "no_bias", "bias_kv", "zero_attn", "bias_kv_zero_attn"])
def test_mha_options_match_torch(device, dtype, options):
    ref, ours = _pair(dtype, device, batch_first=True, **options)
    padding, attn_mask = _masks("both_bool", dtype, device)
    inputs = _inputs(dtype, device, True, options.get("kdim", E), options.get("vdim", E))
    _compare(ref, ours, inputs, dtype, key_padding_mask=padding, attn_mask=attn_mask, need_weights=True,
             average_attn_weights=False)


@DTYPES
@pytest.mark.parametrize("need_weights", [False, True], ids=["no_weights", "weights"])
def test_mha_self_attention_causal_hint(device, dtype, need_weights):
    """Self-attention (query is key is value: one packed projection) with the is_causal hint."""
    ref, ours = _pair(dtype, device, batch_first=True)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(L, device=device, dtype=dtype)
    _compare(ref, ours, _inputs(dtype, device, True, self_attention=True), dtype, attn_mask=causal, is_causal=True,
             need_weights=need_weights)


def test_mha_unbatched(device):
    ref, ours = _pair(torch.float64, device)
    q, k, v = (torch.randn(length, E, dtype=torch.float64, device=device, requires_grad=True) for length in (L, S, S))
    padding = torch.zeros(S, dtype=torch.bool, device=device)
    padding[-2:] = True
    _compare(ref, ours, (q, k, v), torch.float64, key_padding_mask=padding)


def test_mha_state_dict_loads_into_torch(device):
    ours = fnn.MultiheadAttention(E, HEADS, kdim=16, vdim=8, add_bias_kv=True, device=device, dtype=torch.float64)
    ref = torch.nn.MultiheadAttention(E, HEADS, kdim=16, vdim=8, add_bias_kv=True, device=device,
                                      dtype=torch.float64)
    ref.load_state_dict(ours.state_dict())
    assert list(ref.state_dict()) == list(ours.state_dict())
    _compare(ref, ours, _inputs(torch.float64, device, False, 16, 8), torch.float64)


def test_mha_dropout_weights_are_those_the_output_used(device):
    """In training with dropout, the returned per-head weights (dropped and rescaled) times
    the projected values, through out_proj, give the output."""
    _, ours = _pair(torch.float64, device, batch_first=True, dropout=0.3)
    q, k, v = _inputs(torch.float64, device, True)
    out, w = ours(q, k, v, need_weights=True, average_attn_weights=False)
    assert ((w == 0) & (ours.eval()(q, k, v, average_attn_weights=False)[1] > 0)).any()
    v_proj = F.linear(v, ours.in_proj_weight[2 * E:], ours.in_proj_bias[2 * E:]).unflatten(-1, (HEADS, E // HEADS))
    rebuilt = torch.einsum("nhls,nshd->nlhd", w, v_proj).flatten(2)
    torch.testing.assert_close(out, ours.out_proj(rebuilt), rtol=0, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_mha_inside_transformer_encoder_layer(device, causal):
    """Swapped into torch.nn.TransformerEncoderLayer (which calls it with need_weights=False, a
    padding mask and the is_causal hint): the layer's output and gradients are unchanged."""
    torch.manual_seed(3)
    ref = torch.nn.TransformerEncoderLayer(E, HEADS, dim_feedforward=64, dropout=0.0, batch_first=True,
                                           device=device, dtype=torch.float64)
    ours = torch.nn.TransformerEncoderLayer(E, HEADS, dim_feedforward=64, dropout=0.0, batch_first=True,
                                            device=device, dtype=torch.float64)
    ours.self_attn = fnn.MultiheadAttention(E, HEADS, dropout=0.0, batch_first=True, device=device,
                                            dtype=torch.float64)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(N, L, E, dtype=torch.float64, device=device, requires_grad=True)
    padding = torch.zeros(N, L, dtype=torch.bool, device=device)
    padding[1, -2:] = True
    mask = None
    if causal:
        mask = torch.nn.Transformer.generate_square_subsequent_mask(L, device=device, dtype=torch.float64)
    call = dict(src_mask=mask, src_key_padding_mask=padding, is_causal=causal)
    out, expected = ours(x, **call), ref(x, **call)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, [x] + list(ours.parameters()), dout)
    want = torch.autograd.grad(expected, [x] + list(ref.parameters()), dout)
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)


def test_mha_errors(device):
    _, ours = _pair(torch.float32, device)
    q, k, v = _inputs(torch.float32, device, False)
    with pytest.raises(ValueError, match="is_causal=True is a hint .* attn_mask must be given"):
        ours(q, k, v, is_causal=True)
    with pytest.raises(ValueError, match=r"attn_mask must have shape \(L, S\) = \(6, 9\) .* got \(6, 8\)"):
        ours(q, k, v, attn_mask=torch.zeros(L, S - 1, dtype=torch.bool, device=device))
    with pytest.raises(ValueError, match=r"key_padding_mask must have shape \(N, S\) = \(3, 9\), got \(9, 3\)"):
        ours(q, k, v, key_padding_mask=torch.zeros(S, N, dtype=torch.bool, device=device))
    with pytest.raises(ValueError, match="key_padding_mask must be bool .* or float .*, got dtype torch.int64"):
        ours(q, k, v, key_padding_mask=torch.zeros(N, S, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match="all be batched .* got key of shape"):
        ours(q, k[0], v)


# ---- Attention ----

def _attention_reference(block, x, attn_mask, window):
    """block's computation with the float64 plain-torch reference attention."""
    b, length, _ = x.shape
    h, hk, d = block.num_heads, block.num_kv_heads, block.head_dim
    qkv = block.qkv_proj(x).unflatten(-1, (h + 2 * hk, d)).transpose(1, 2)
    q, k, v = qkv.split([h, hk, hk], dim=1)
    out, _ = attention_ref(q, k, v, d ** -0.5, TOP_LEFT if block.causal else 0, bias=attn_mask, window=window,
                           softcap=block.softcap)
    return block.out_proj(out.transpose(1, 2).flatten(2))


@DTYPES
@pytest.mark.parametrize("config", [dict(num_kv_heads=4), dict(num_kv_heads=2, causal=True),
                                    dict(num_kv_heads=1, causal=True, window_size=(3, 0), softcap=2.0),
                                    dict(num_kv_heads=2, head_dim=12, window_size=(2, 2))],
                         ids=["mha", "gqa_causal", "mqa_window_softcap", "head_dim_window"])
@pytest.mark.parametrize("masked", [False, True], ids=["no_mask", "bool_mask"])
def test_attention_block_matches_reference(device, dtype, config, masked):
    block = fnn.Attention(E, 4, device=device, dtype=dtype, **config)
    x = torch.randn(2, 10, E, dtype=dtype, device=device, requires_grad=True)
    mask = None
    if masked:
        mask = torch.rand(2, 1, 10, 10, device=device) > 0.3
        mask[..., 0] = mask[..., 0] | torch.eye(10, dtype=torch.bool, device=device)[:, 0]
        mask |= torch.eye(10, dtype=torch.bool, device=device)  # every query keeps itself
    out = block(x, attn_mask=mask)
    expected = _attention_reference(block, x, mask, config.get("window_size", (-1, -1)))
    tol = TOL[dtype]
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)
    dout = torch.randn_like(out)
    params = [x] + list(block.parameters())
    for g, e in zip(torch.autograd.grad(out, params, dout), torch.autograd.grad(expected, params, dout)):
        torch.testing.assert_close(g, e, rtol=tol, atol=tol)


def test_attention_block_errors():
    with pytest.raises(ValueError, match=r"num_kv_heads \(3\) must be >= 1 and divide num_heads \(4\)"):
        fnn.Attention(E, 4, num_kv_heads=3)
    with pytest.raises(ValueError, match=r"embed_dim \(30\) must be divisible by num_heads \(4\)"):
        fnn.Attention(30, 4)
    with pytest.raises(ValueError, match=r"x must be a \(batch, len, embed_dim\) tensor, got \(10, 32\)"):
        fnn.Attention(E, 4)(torch.randn(10, E))


def test_modules_compile_fullgraph(device):
    """torch.compile(fullgraph=True) traces both modules (forward and backward) with no graph break."""
    x = torch.randn(2, 8, E, device=device, requires_grad=True)
    mha = fnn.MultiheadAttention(E, HEADS, batch_first=True, device=device)
    block = fnn.Attention(E, HEADS, num_kv_heads=2, causal=True, window_size=(3, 0), device=device)
    for module, call in ((mha, lambda m: m(x, x, x, need_weights=False)[0]), (block, lambda m: m(x))):
        compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
        out, expected = call(compiled), call(module)
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)  # the graph may split a linear's add
        (g,) = torch.autograd.grad(out.sum(), x)
        (e,) = torch.autograd.grad(expected.sum(), x)
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-6)

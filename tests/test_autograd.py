"""Autograd and torch integration: gradcheck in float64, torch.library.opcheck on both ops,
torch.compile(fullgraph=True) of forward + backward, and the double-backward error."""
import pytest
import torch

import flashattn_ext
from reference import BOTTOM_RIGHT, CAUSAL_IDS, CAUSAL_MODES, NONE, TOP_LEFT, lse_dtype, make_qkv, ours


def _fp64_leaves(heads_q, heads_kv, len_q, len_k, head_dim, head_dim_v, device, batch=1):
    return [t.requires_grad_() for t in
            make_qkv(batch, heads_q, heads_kv, len_q, len_k, head_dim, head_dim_v, torch.float64, device)]


@pytest.mark.parametrize("causal", CAUSAL_MODES, ids=CAUSAL_IDS)
@pytest.mark.parametrize("heads_q,heads_kv,len_q,len_k,head_dim,head_dim_v", [
    (2, 2, 5, 7, 4, 4),
    (2, 2, 7, 7, 4, 4),
    (4, 2, 6, 9, 3, 5),     # GQA, head_dim_v != head_dim
    (3, 1, 1, 4, 2, 2),     # MQA, single query
])
def test_gradcheck_out_and_lse(device, causal, heads_q, heads_kv, len_q, len_k, head_dim, head_dim_v):
    q, k, v = _fp64_leaves(heads_q, heads_kv, len_q, len_k, head_dim, head_dim_v, device)
    assert torch.autograd.gradcheck(lambda *t: ours(*t, 0.7, causal), (q, k, v))


def test_gradcheck_fully_masked_rows(device):
    """Bottom-right with len_q > len_k: rows 0..2 see nothing (out = 0; lse = -inf has no
    finite-difference derivative, so only out is checked)."""
    q, k, v = _fp64_leaves(2, 1, 7, 4, 3, 3, device)
    assert torch.autograd.gradcheck(lambda *t: ours(*t, 0.7, BOTTOM_RIGHT)[0], (q, k, v))


@pytest.mark.parametrize("causal", [NONE, TOP_LEFT])
def test_gradcheck_across_tiles(device, causal):
    """Lengths past the CPU tile sizes (64 keys, 128 queries), so tile edges are differentiated."""
    q, k, v = _fp64_leaves(1, 1, 130, 70, 2, 2, device)
    assert torch.autograd.gradcheck(lambda *t: ours(*t, 0.5, causal), (q, k, v), fast_mode=True)


@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck_flash_attn_func_with_lse(device, causal):
    q, k, v = (t.transpose(1, 2).detach().requires_grad_() for t in _fp64_leaves(4, 2, 6, 8, 4, 3, device))
    assert torch.autograd.gradcheck(
        lambda *t: flashattn_ext.flash_attn_func(*t, causal=causal, return_lse=True), (q, k, v))


@pytest.mark.parametrize("is_causal", [False, True])
def test_gradcheck_sdpa(device, is_causal):
    q, k, v = _fp64_leaves(4, 2, 5, 5, 4, 4, device)
    assert torch.autograd.gradcheck(
        lambda *t: flashattn_ext.scaled_dot_product_attention(*t, is_causal=is_causal, enable_gqa=True), (q, k, v))


@pytest.mark.parametrize("features", [{}, {"attn_bias": "float", "softcap": 3.0}, {"attn_bias": "bool",
                                                                              "window_left": 2}])
def test_functions_take_the_ops_formula(device, features):
    """The Python functions apply the op's registered formula directly (ops._FwdWithGrad, and
    ops._PlainFwdWithGrad without features: no per-call walk over the op's schema); gradients of
    out and lse, the bias gradient included, equal those through the op's registration bit for
    bit."""
    q, k, v = _fp64_leaves(4, 2, 9, 11, 8, 6, device)
    features = dict(features)
    if features.get("attn_bias") == "float":
        features["attn_bias"] = torch.randn(1, 4, 9, 11, dtype=torch.float64, device=device, requires_grad=True)
    elif features.get("attn_bias") == "bool":
        features["attn_bias"] = torch.rand(1, 1, 9, 11, device=device) > 0.3
    w_out, w_lse = torch.randn(1, 4, 9, 6, dtype=torch.float64, device=device), torch.randn(1, 4, 9, device=device,
                                                                                             dtype=torch.float64)
    leaves = [t for t in (q, k, v, features.get("attn_bias")) if t is not None and t.requires_grad]
    grads = {}
    for name, fn in (("functions", flashattn_ext.ops.fwd), ("registered", torch.ops.flashattn.fwd)):
        out, lse = fn(q, k, v, 0.4, TOP_LEFT, True, **features)
        assert ("FwdWithGrad" in type(out.grad_fn).__name__) == (name == "functions")
        grads[name] = torch.autograd.grad((out * w_out).sum() + (lse * w_lse).sum(), leaves)
    for a, b in zip(grads["functions"], grads["registered"]):
        assert torch.equal(a, b)


def test_fwd_rejects_unknown_feature(device):
    q, k, v = _fp64_leaves(1, 1, 2, 2, 4, 4, device)
    with pytest.raises(TypeError, match="unknown feature arguments.*window"):
        flashattn_ext.ops.fwd(q, k, v, 1.0, NONE, window=3)


# ---- torch.library.opcheck ----

OPCHECK_CASES = [
    # (heads_q, heads_kv, len_q, len_k, head_dim, head_dim_v, blhe_layout)
    (2, 2, 5, 7, 8, 8, False),
    (4, 1, 9, 3, 16, 8, False),
    (4, 2, 6, 6, 8, 8, True),
]


def _opcheck_inputs(case, dtype, device, requires_grad):
    hq, hkv, lq, lk, e, ev, blhe = case
    q, k, v = make_qkv(2, hq, hkv, lq, lk, e, ev, dtype, device)
    if blhe:  # (B, L, H, E) memory order seen through (B, H, L, E) views
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


@pytest.mark.parametrize("requires_grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("causal", CAUSAL_MODES, ids=CAUSAL_IDS)
@pytest.mark.parametrize("case", OPCHECK_CASES, ids=["mha", "mqa", "blhe"])
def test_opcheck_fwd(device, requires_grad, dtype, causal, case):
    q, k, v = _opcheck_inputs(case, dtype, device, requires_grad)
    torch.library.opcheck(torch.ops.flashattn.fwd, (q, k, v, 0.3, causal, False))


@pytest.mark.parametrize("requires_grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("with_dlse", [False, True], ids=["no_dlse", "dlse"])
@pytest.mark.parametrize("causal", CAUSAL_MODES, ids=CAUSAL_IDS)
@pytest.mark.parametrize("case", OPCHECK_CASES, ids=["mha", "mqa", "blhe"])
def test_opcheck_bwd(device, requires_grad, with_dlse, causal, case):
    q, k, v = _opcheck_inputs(case, torch.float32, device, False)
    out, lse = ours(q, k, v, 0.3, causal)
    dout = torch.randn_like(out)
    dlse = torch.randn_like(lse) if with_dlse else None
    args = (*[t.requires_grad_(requires_grad) for t in (dout, q, k, v, out)], lse, dlse, 0.3, causal, False)
    if not requires_grad:
        torch.library.opcheck(torch.ops.flashattn.bwd, args)
        return
    # bwd has no derivative by design (double backward raises), so opcheck's AOT test, which
    # differentiates the op when inputs require grad, must end in that error.
    torch.library.opcheck(torch.ops.flashattn.bwd, args,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    with pytest.raises(Exception, match="double backward"):
        torch.library.opcheck(torch.ops.flashattn.bwd, args, test_utils="test_aot_dispatch_dynamic")


# ---- torch.compile ----

def _loss_and_grads(fn, q, k, v, w_out, w_lse):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse, loss = fn(*leaves, w_out, w_lse)
    loss.backward()
    return [out.detach(), lse.detach(), loss.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("causal", [False, True])
def test_compile_fullgraph_forward_backward(device, causal):
    """The whole step (views, op, a loss using out and lse) compiles into one graph with
    inductor, and the compiled forward and backward match eager."""
    torch._dynamo.reset()

    def step(q, k, v, w_out, w_lse):
        out, lse = flashattn_ext.flash_attn_func(q, k, v, causal=causal, return_lse=True)
        loss = (out * w_out).sum() + (lse * w_lse).sum()
        return out, lse, loss

    q = torch.randn(2, 12, 4, 32, device=device)
    k = torch.randn(2, 20, 2, 32, device=device)
    v = torch.randn(2, 20, 2, 16, device=device)
    w_out, w_lse = torch.randn(2, 12, 4, 16, device=device), torch.randn(2, 4, 12, device=device)
    eager = _loss_and_grads(step, q, k, v, w_out, w_lse)
    compiled = _loss_and_grads(torch.compile(step, fullgraph=True, backend="inductor"), q, k, v, w_out, w_lse)
    for name, e, c in zip(("out", "lse", "loss", "dq", "dk", "dv"), eager, compiled):
        torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-5, msg=name)


def test_compile_sdpa_module_dynamic_shapes(device):
    """SDPA replacement inside a compiled function, with dynamic sequence lengths."""
    torch._dynamo.reset()

    def attend(x, w):
        q, k, v = (x @ w).unflatten(-1, (3, 2, 8)).permute(2, 0, 3, 1, 4)
        return flashattn_ext.scaled_dot_product_attention(q, k, v, is_causal=True).sum()

    compiled = torch.compile(attend, fullgraph=True, dynamic=True, backend="inductor")
    w = torch.randn(16, 48, device=device, requires_grad=True)
    for length in (5, 9):
        x = torch.randn(2, length, 16, device=device)
        (ge,) = torch.autograd.grad(attend(x, w), w)
        (gc,) = torch.autograd.grad(compiled(x, w), w)
        torch.testing.assert_close(gc, ge, rtol=1e-5, atol=1e-5)


# ---- double backward ----

def test_double_backward_raises(device):
    q, k, v = _fp64_leaves(2, 2, 4, 5, 8, 8, device)
    out, lse = ours(q, k, v, 0.5, NONE)
    dq, = torch.autograd.grad(out.sum() + lse.sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        dq.sum().backward()


def test_lse_dtype(device):
    for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        q, k, v = make_qkv(1, 1, 1, 3, 3, 8, 8, dtype, device)
        out, lse = ours(q, k, v, 1.0, NONE)
        assert out.dtype == dtype and lse.dtype == lse_dtype(dtype)

"""The optional features under autograd and torch.compile: gradcheck in float64 with each
feature (dropout with a fixed seed; the float bias differentiated too), opcheck of both ops
with features, fullgraph compile of the public functions with features, and bitwise
reproducible gradients with deterministic=True."""
import pytest
import torch

import flashattn_ext
from reference import BOTTOM_RIGHT, NONE, TOP_LEFT

op = torch.ops.flashattn.fwd
RNG = torch.tensor([42, 7], dtype=torch.int64)


def _leaves(device, b=1, hq=2, hkv=1, lq=6, lk=9, e=4, ev=3):
    return [torch.randn(s, dtype=torch.float64, device=device, requires_grad=True)
            for s in ((b, hq, lq, e), (b, hkv, lk, e), (b, hkv, lk, ev))]


GRADCHECK_CASES = {
    "bool_mask": (NONE, lambda d: dict(attn_bias=torch.rand(1, 2, 6, 9, device=d) > 0.3)),
    "window": (NONE, lambda d: dict(window_left=2, window_right=1)),
    "window_causal": (BOTTOM_RIGHT, lambda d: dict(window_left=3)),
    "alibi": (TOP_LEFT, lambda d: dict(alibi_slopes=torch.rand(1, 2, device=d))),
    "softcap": (NONE, lambda d: dict(softcap=1.5)),
    "dropout": (NONE, lambda d: dict(dropout_p=0.3, rng_state=RNG)),
    "everything": (BOTTOM_RIGHT, lambda d: dict(window_left=4, alibi_slopes=torch.rand(2, device=d), softcap=2.0,
                                                dropout_p=0.2, rng_state=RNG)),
}


@pytest.mark.parametrize("case", list(GRADCHECK_CASES))
def test_gradcheck(device, case):
    causal, features = GRADCHECK_CASES[case]
    features = features(device)
    q, k, v = _leaves(device)
    assert torch.autograd.gradcheck(lambda *t: op(*t, 0.7, causal, **features), (q, k, v))


@pytest.mark.parametrize("shape", [(1, 2, 6, 9), (1, 1, 6, 9), (1, 2, 1, 9)], ids=["full", "B1LS", "BH1S"])
def test_gradcheck_float_bias(device, shape):
    """The bias gradient too, summed over the bias's broadcast dimensions."""
    q, k, v = _leaves(device)
    bias = torch.randn(shape, dtype=torch.float64, device=device, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *t: op(*t[:3], 0.7, TOP_LEFT, attn_bias=t[3]), (q, k, v, bias))


def test_gradcheck_sdpa_mask_and_dropout(device):
    q, k, v = _leaves(device, hkv=2)
    mask = torch.randn(6, 9, dtype=torch.float64, device=device, requires_grad=True)

    def fn(*t):
        torch.manual_seed(3)  # the same dropout mask for every evaluation
        return flashattn_ext.scaled_dot_product_attention(*t[:3], attn_mask=t[3], dropout_p=0.25)
    assert torch.autograd.gradcheck(fn, (q, k, v, mask))


@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck_varlen(device, causal):
    cu_q = torch.tensor([0, 3, 3, 8], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 4, 6, 11], dtype=torch.int32, device=device)
    q, k, v = (torch.randn(n, 2, 3, dtype=torch.float64, device=device, requires_grad=True)
               for n in (8, 11, 11))
    slopes = torch.rand(3, 2, device=device)
    assert torch.autograd.gradcheck(
        lambda *t: flashattn_ext.flash_attn_varlen_func(*t, cu_q, cu_k, 5, 5, causal=causal, window_size=(3, 1),
                                                        alibi_slopes=slopes, return_lse=True), (q, k, v))


# ---- opcheck ----

OPCHECK_CASES = {
    "float_bias": lambda d: dict(attn_bias=torch.randn(2, 1, 6, 9, device=d, requires_grad=True)),
    "bool_mask": lambda d: dict(attn_bias=torch.rand(1, 4, 6, 9, device=d) > 0.5),
    "window_alibi_softcap": lambda d: dict(window_left=2, window_right=0, alibi_slopes=torch.rand(2, 4, device=d),
                                           softcap=3.0),
    "dropout": lambda d: dict(dropout_p=0.4, rng_state=RNG),
}


@pytest.mark.parametrize("case", list(OPCHECK_CASES))
def test_opcheck(device, case):
    features = OPCHECK_CASES[case](device)
    q, k, v = (torch.randn(s, device=device, requires_grad=True)
               for s in ((2, 4, 6, 8), (2, 2, 9, 8), (2, 2, 9, 8)))
    torch.library.opcheck(op, (q, k, v, 0.3, BOTTOM_RIGHT, False), features)
    out, lse = op(q, k, v, 0.3, BOTTOM_RIGHT, **features)
    bias_grad = case == "float_bias"
    bwd_args = (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), None, 0.3,
                BOTTOM_RIGHT, False)
    features = {n: t.detach() if isinstance(t, torch.Tensor) else t for n, t in features.items()}
    torch.library.opcheck(torch.ops.flashattn.bwd, bwd_args, dict(features, bias_requires_grad=bias_grad))


def test_opcheck_varlen(device):
    cu_q = torch.tensor([0, 3, 3, 8], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 4, 6, 11], dtype=torch.int32, device=device)
    q, k, v = (torch.randn(1, 2, n, 8, device=device, requires_grad=True) for n in (8, 11, 11))
    features = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=5, max_seqlen_k=5)
    torch.library.opcheck(op, (q, k, v, 0.3, BOTTOM_RIGHT, False), features)


# ---- torch.compile ----

def _grads(fn, leaves):
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    torch.manual_seed(1)  # the same dropout seed for every run
    out = fn(*leaves)
    return [out.detach()] + list(torch.autograd.grad(out.square().sum(), leaves))


def _compare_compiled(fn, leaves):
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="inductor")
    eager = _grads(fn, leaves)
    # inductor draws random numbers its own way; this makes them torch's (the dropout seed)
    with torch._inductor.config.patch(fallback_random=True):
        got = _grads(compiled, leaves)
    for e, g in zip(eager, got):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


def test_compile_sdpa_mask_dropout(device):
    q, k, v = (torch.randn(2, 4, n, 16, device=device) for n in (12, 20, 20))
    mask = torch.randn(12, 20, device=device)

    def fn(q, k, v, mask):
        return flashattn_ext.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.2)
    _compare_compiled(fn, (q, k, v, mask))


def test_compile_flash_attn_window_alibi_softcap(device):
    q, k, v = (torch.randn(2, n, 4, 16, device=device) for n in (12, 20, 20))
    slopes = torch.rand(4, device=device)

    def fn(q, k, v):
        return flashattn_ext.flash_attn_func(q, k, v, causal=True, window_size=(5, 0), alibi_slopes=slopes,
                                             softcap=3.0)
    _compare_compiled(fn, (q, k, v))


def test_compile_varlen(device):
    cu_q = torch.tensor([0, 3, 3, 8], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 4, 6, 11], dtype=torch.int32, device=device)
    q, k, v = (torch.randn(n, 2, 8, device=device) for n in (8, 11, 11))

    def fn(q, k, v):
        return flashattn_ext.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 5, causal=True)
    _compare_compiled(fn, (q, k, v))


# ---- determinism ----

def test_deterministic_with_features(device):
    q, k, v = (torch.randn(2, n, 4, 32, device=device) for n in (300, 257, 257))
    slopes = torch.rand(4, device=device)

    def run():
        return _grads(lambda *t: flashattn_ext.flash_attn_func(*t, dropout_p=0.1, window_size=(100, 10),
                                                               alibi_slopes=slopes, softcap=5.0, deterministic=True),
                      (q, k, v))
    first, second = run(), run()
    assert all(torch.equal(a, b) for a, b in zip(first, second))

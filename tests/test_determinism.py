"""deterministic=True: the backward gives bitwise-identical gradients run to run."""
import pytest
import torch

import flashattn_ext
from reference import BOTTOM_RIGHT, NONE, check_against_reference, make_qkv, ours


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads_kv", [4, 1], ids=["mha", "mqa"])
def test_backward_is_bitwise_reproducible(device, dtype, causal, heads_kv):
    q = torch.randn(2, 300, 4, 64, dtype=dtype, device=device)
    k = torch.randn(2, 257, heads_kv, 64, dtype=dtype, device=device)
    v = torch.randn(2, 257, heads_kv, 64, dtype=dtype, device=device)
    dout = torch.randn(2, 300, 4, 64, dtype=dtype, device=device)

    def grads():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = flashattn_ext.flash_attn_func(*leaves, causal=causal, deterministic=True, return_lse=True)
        torch.autograd.backward((out, lse), (dout, torch.ones_like(lse)))
        return [out.detach()] + [t.grad for t in leaves]

    first, second = grads(), grads()
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mode", ["use_deterministic_algorithms", "float64"])
def test_reproducible_without_the_flag(device, mode):
    """torch.use_deterministic_algorithms(True), and float64 always, give reproducible
    gradients without deterministic=True (gradcheck compares two backward runs)."""
    dtype = torch.float64 if mode == "float64" else torch.float32
    q, k, v = (torch.randn(1, 4, 200, 32, dtype=dtype, device=device) for _ in range(3))
    dout = torch.randn_like(q)

    def grads():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        flashattn_ext.scaled_dot_product_attention(*leaves, is_causal=True).backward(dout)
        return [t.grad for t in leaves]

    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(mode == "use_deterministic_algorithms")
    try:
        first, second = grads(), grads()
    finally:
        torch.use_deterministic_algorithms(previous)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def _grads_of(fn, tensors, dout, runs):
    """The gradients of `fn` at `tensors` for upstream `dout`, from `runs` separate backward runs."""
    results = []
    for _ in range(runs):
        leaves = [t.clone().requires_grad_() for t in tensors]
        fn(*leaves).backward(dout)
        results.append([t.grad for t in leaves])
    return results


@pytest.mark.parametrize("dtype,head_dim", [(torch.bfloat16, 64), (torch.bfloat16, 128), (torch.bfloat16, 192),
                                            (torch.float16, 256), (torch.float64, 64), (torch.float64, 128)],
                         ids=["bf16-64", "bf16-128", "bf16-192", "fp16-256", "fp64-64", "fp64-128"])
@pytest.mark.parametrize("band", ["causal", "window", "full", "softcap"])
def test_many_key_tiles_add_into_dq(device, dtype, head_dim, band):
    """Long enough that many key tiles add into each query tile's dQ (on CUDA the tensor-core
    kernels then split the key tiles into groups, each walked by one block into a dQ accumulator
    of its own, summed in order): three runs give the same bits, and they agree with the default
    path to float tolerance."""
    # Keys enough for several key tiles per group (up to 8 groups per kv head; 128-key tiles).
    q = torch.randn(1, 300, 4, head_dim, dtype=dtype, device=device)
    k, v = (torch.randn(1, 2100, 2, head_dim, dtype=dtype, device=device) for _ in range(2))
    dout = torch.randn_like(q)
    # (softcap: the kernels' variant with the general per-score step)
    options = {"causal": dict(causal=True), "window": dict(window_size=(150, 40)), "full": {},
               "softcap": dict(causal=True, softcap=5.0)}[band]
    runs = _grads_of(lambda *t: flashattn_ext.flash_attn_func(*t, deterministic=True, **options), (q, k, v), dout, 3)
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)
    (default,) = _grads_of(lambda *t: flashattn_ext.flash_attn_func(*t, **options), (q, k, v), dout, 1)
    for a, b in zip(runs[0], default):
        torch.testing.assert_close(a, b, **({"atol": 1e-10, "rtol": 1e-10} if dtype == torch.float64 else {}))


def test_varlen_deterministic(device):
    """The same for a variable-length batch of ragged sequences with a causal window."""
    lens_q, lens_k = [300, 17, 451], [290, 333, 420]
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32, device=device)
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32, device=device)
    q = torch.randn(sum(lens_q), 4, 64, dtype=torch.bfloat16, device=device)
    k, v = (torch.randn(sum(lens_k), 2, 64, dtype=torch.bfloat16, device=device) for _ in range(2))
    dout = torch.randn_like(q)

    def fn(q_, k_, v_):
        return flashattn_ext.flash_attn_varlen_func(q_, k_, v_, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                                    window_size=(100, -1), deterministic=True)
    first, second, third = _grads_of(fn, (q, k, v), dout, 3)
    for a, b, c in zip(first, second, third):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("causal", [NONE, BOTTOM_RIGHT], ids=["none", "bottom_right"])
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 192])
def test_deterministic_backward_is_accurate(device, dtype, causal, head_dim):
    """The deterministic path (on CUDA the tensor-core kernels' dQ accumulators per group of key
    tiles, or the SIMT kernels' dQ kernel) meets the accuracy rule too, with GQA and ragged
    lengths."""
    q, k, v = make_qkv(1, 4, 2, 150, 133, head_dim, head_dim, dtype, device)
    scale = head_dim**-0.5
    check_against_reference(q, k, v, scale, causal, fn=lambda q_, k_, v_: ours(q_, k_, v_, scale, causal, True))

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("causal", [NONE, BOTTOM_RIGHT], ids=["none", "bottom_right"])
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 192])
def test_deterministic_backward_is_accurate(device, dtype, causal, head_dim):
    """The deterministic path (on CUDA a dQ kernel of its own, per head-dim tier) meets the
    accuracy rule too, with GQA and ragged lengths."""
    q, k, v = make_qkv(1, 4, 2, 150, 133, head_dim, head_dim, dtype, device)
    scale = head_dim**-0.5
    check_against_reference(q, k, v, scale, causal, fn=lambda q_, k_, v_: ours(q_, k_, v_, scale, causal, True))

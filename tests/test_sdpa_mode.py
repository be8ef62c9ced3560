"""SDPA interception: flashattn_ext.sdpa.enabled() / enable() / disable() send unmodified
F.scaled_dot_product_attention calls to our kernels (seen in the profiler), with torch's
results and gradients, and hand what we do not take back to torch; the kernels behind SDPA's
flash backend hook (sdpa_backend.py) against torch, on CPU by direct calls and on CUDA
through torch.nn.attention.activate_flash_attention_impl."""
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

import flashattn_ext
from flashattn_ext import sdpa, sdpa_backend

from flashattn_ext._measure import REL_ATOL, REL_ATOL_GRAD
from reference import assert_accurate

FP64 = {"rtol": 1e-10, "atol": 1e-10}


class Block(torch.nn.Module):
    """Model code as written for torch: F.scaled_dot_product_attention, nothing else."""

    def __init__(self, dim, heads, kv_heads):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q = torch.nn.Linear(dim, dim)
        self.kv = torch.nn.Linear(dim, 2 * kv_heads * self.head_dim)
        self.o = torch.nn.Linear(dim, dim)

    def forward(self, x, mask=None, causal=False):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(b, n, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                             enable_gqa=self.heads != self.kv_heads)
        return self.o(out.transpose(1, 2).reshape(b, n, -1))


# The public functions call the guarded kernels (flashattn::_fwd, or _fwd_plain for a call without
# optional features) directly in eager mode, the ops (flashattn::fwd) elsewhere: any is ours.
OUR_FWD = {"flashattn::fwd", "flashattn::_fwd", "flashattn::_fwd_plain"}
OUR_BWD = {"flashattn::bwd", "flashattn::_bwd", "flashattn::_bwd_plain"}


def _ran_ours(fn):
    """(fn's result, whether our forward ran and whether our backward ran)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        result = fn()
    names = {e.name for e in prof.events()}
    return result, bool(names & OUR_FWD), bool(names & OUR_BWD)


def _forward_backward(block, x, mask, causal):
    block.zero_grad()
    out = block(x, mask, causal)
    out.square().sum().backward()
    return out.detach(), [p.grad.clone() for p in block.parameters()]


@pytest.mark.parametrize("kind", ["causal", "bool_mask", "float_mask"])
def test_unmodified_module_runs_ours(device, kind):
    torch.manual_seed(0)
    x = torch.randn(2, 33, 64, device=device)
    mask = None
    if kind == "bool_mask":
        mask = torch.rand(2, 1, 33, 33, device=device) > 0.3
    elif kind == "float_mask":
        mask = torch.randn(33, 33, device=device)
    block = Block(64, 4, 2).to(device)
    mask64 = mask.double() if kind == "float_mask" else mask
    ref64_out, ref64_grads = _forward_backward(block.double(), x.double(), mask64, kind == "causal")
    block.float()
    torch_out, torch_grads = _forward_backward(block, x, mask, kind == "causal")
    with sdpa.enabled():
        (out, grads), fwd, bwd = _ran_ours(lambda: _forward_backward(block, x, mask, kind == "causal"))
    assert fwd and bwd
    names = ["out"] + [name for name, _ in block.named_parameters()]
    for name, ours, theirs, ref in zip(names, [out] + grads, [torch_out] + torch_grads, [ref64_out] + ref64_grads):
        assert_accurate(name, ours, ref, theirs, 1e-6)


def test_compiled_module_under_the_mode(device):
    """torch.compile(fullgraph=True) traces the mode: the compiled graph calls our op."""
    torch.manual_seed(0)
    block, x = Block(64, 4, 2).to(device), torch.randn(2, 9, 64, device=device)
    expected = block(x, None, True)
    with sdpa.enabled():
        out, fwd, _ = _ran_ours(lambda: torch.compile(block, fullgraph=True, backend="aot_eager")(x, None, True))
    assert fwd
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_enable_disable(device):
    q = torch.randn(1, 2, 8, 16, device=device)
    sdpa.enable()
    try:
        assert sdpa.is_enabled()
        (out, fwd, _) = _ran_ours(lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True))
    finally:
        sdpa.disable()
    assert fwd and not sdpa.is_enabled()
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, q, q, is_causal=True))
    _, fwd, _ = _ran_ours(lambda: F.scaled_dot_product_attention(q, q, q))
    assert not fwd
    with pytest.raises(RuntimeError, match="no enable"):
        sdpa.disable()


def test_positional_and_keyword_arguments_bind_as_torch(device):
    q, k, v = (torch.randn(2, 3, 5, 8, device=device, dtype=torch.float64) for _ in range(3))
    mask = torch.randn(5, 5, device=device, dtype=torch.float64)
    with sdpa.enabled():
        (out, fwd, _) = _ran_ours(lambda: F.scaled_dot_product_attention(q, k, v, mask, 0.0, False, scale=0.3))
    assert fwd
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3))


def _jagged(lengths, heads, dim, device):
    """A jagged nested tensor (batch, heads, j, dim), as SDPA takes one."""
    return torch.nested.nested_tensor([torch.randn(n, heads, dim) for n in lengths], layout=torch.jagged,
                                      device=device).transpose(1, 2)


def test_causal_bias_and_jagged_nested_inputs_run_ours(device):
    q = torch.randn(2, 3, 6, 8, device=device, dtype=torch.float64)
    k, v = (torch.randn(2, 3, 9, 8, device=device, dtype=torch.float64) for _ in range(2))
    bias = causal_lower_right(6, 9)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    with sdpa.enabled():
        out, fwd, _ = _ran_ours(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias))
    assert fwd
    torch.testing.assert_close(out, expected, **FP64)

    q, k, v = (_jagged([3, 5], 2, 8, device) for _ in range(3))
    with sdpa.enabled():
        out, fwd, _ = _ran_ours(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert fwd and out.is_nested
    for i, (qi, ki, vi) in enumerate(zip(q.unbind(), k.unbind(), v.unbind())):
        expected = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True)
        torch.testing.assert_close(out.unbind()[i], expected, rtol=1e-5, atol=1e-5)


def _fallback_cases(device):
    q = torch.randn(1, 2, 6, 8, device=device)
    strided_nested = torch.nested.nested_tensor([torch.randn(2, 3, 8), torch.randn(2, 5, 8)], device=device)
    big = torch.randn(1, 2, 6, 300, device=device)
    return {
        "strided_nested": ((strided_nested,) * 3, {}),
        "head_dim_300": ((big, big, big), {}),
        "int_mask": ((q, q, q), {"attn_mask": torch.ones(6, 6, dtype=torch.int32, device=device)}),
        "batch_broadcast": ((q, q.expand(3, -1, -1, -1), q.expand(3, -1, -1, -1)), {}),
        "column_major_head_dim": ((q.transpose(-1, -2).contiguous().transpose(-1, -2),) * 3, {}),
    }


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("case", ["strided_nested", "head_dim_300", "int_mask", "batch_broadcast",
                                  "column_major_head_dim"])
def test_inputs_we_do_not_take_go_to_torch(device, case):
    args, kwargs = _fallback_cases(device)[case]
    try:
        expected = F.scaled_dot_product_attention(*args, **kwargs)
    except Exception as e:  # torch refuses it: the mode must give the same refusal
        with sdpa.enabled(), pytest.raises(type(e)):
            F.scaled_dot_product_attention(*args, **kwargs)
        return
    with sdpa.enabled():
        out, fwd, _ = _ran_ours(lambda: F.scaled_dot_product_attention(*args, **kwargs))
    assert not fwd
    if out.is_nested:
        out, expected = (torch.cat([t.flatten() for t in x.unbind()]) for x in (out, expected))
    assert torch.equal(out, expected)


def test_wrong_arguments_get_torch_errors(device):
    q = torch.randn(1, 2, 6, 8, device=device)
    wrong = (((q, q), {}), ((q, q, q), {"bogus": 1}), ((q, q, q, None, 0.0, False, 0.3), {}),
             ((q, q, q), {"attn_mask": q, "is_causal": True}))
    for args, kwargs in wrong:
        with pytest.raises((TypeError, RuntimeError)) as theirs:
            F.scaled_dot_product_attention(*args, **kwargs)
        with sdpa.enabled(), pytest.raises(type(theirs.value)):
            F.scaled_dot_product_attention(*args, **kwargs)


# ---- the kernels behind SDPA's flash backend hook ----

def test_hook_is_registered_with_torch():
    attention = torch.nn.attention
    if not hasattr(attention, "register_flash_attention_impl"):
        pytest.skip("this torch has no flash attention hook")
    assert sdpa_backend.NAME in attention.list_flash_attention_impls()
    if not flashattn_ext.has_cuda_kernels():
        with pytest.raises(RuntimeError, match="no CUDA kernels"):
            attention.activate_flash_attention_impl(sdpa_backend.NAME)
        assert attention.current_flash_attention_impl() is None


def _leaves(device, dtype, shapes):
    return [torch.randn(s, device=device, dtype=dtype, requires_grad=True) for s in shapes]


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_flash_kernels_match_torch(device, causal):
    torch.manual_seed(0)
    q, k, v = _leaves(device, torch.float64, [(2, 4, 9, 16), (2, 2, 13, 16), (2, 2, 13, 16)])
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True, scale=0.3)
    dout = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    with torch.no_grad():
        out, lse, _, _, max_q, max_k, rng, unused, _ = sdpa_backend.sdpa_flash_forward(q, k, v, 0.0, causal, scale=0.3)
        grads = sdpa_backend.sdpa_flash_backward(dout, q, k, v, out, lse, None, None, max_q, max_k, 0.0, causal, rng,
                                                 unused, scale=0.3)
    assert (max_q, max_k) == (9, 13) and lse.shape == (2, 4, 9) and lse.dtype == torch.float64
    for ours, theirs in zip((out,) + grads, (ref,) + ref_grads):
        torch.testing.assert_close(ours, theirs, **FP64)


def test_sdpa_flash_kernels_dropout_round_trip(device):
    """The backward reads the forward's [seed, offset] from the rng_state slot: its gradients
    are those of our public function run with the same seed."""
    q, k, v = _leaves(device, torch.float32, [(1, 2, 20, 8)] * 3)
    torch.manual_seed(5)
    expected = flashattn_ext.scaled_dot_product_attention(q, k, v, dropout_p=0.4)
    expected_grads = torch.autograd.grad(expected.sum(), (q, k, v))
    torch.manual_seed(5)
    with torch.no_grad():
        out, lse, _, _, mq, mk, rng, unused, _ = sdpa_backend.sdpa_flash_forward(q, k, v, 0.4, False)
        grads = sdpa_backend.sdpa_flash_backward(torch.ones_like(out), q, k, v, out, lse, None, None, mq, mk, 0.4,
                                                 False, rng, unused)
    assert torch.equal(out, expected)
    for ours, theirs in zip(grads, expected_grads):
        assert torch.equal(ours, theirs)


def test_flash_layout_kernels_dense_and_packed(device):
    """aten::_flash_attention_forward/backward: flash-attn 2 layout, causal bottom-right with
    a window, dense and packed (cum_seq), against our flash-attn functions."""
    torch.manual_seed(0)
    q, k, v = _leaves(device, torch.float64, [(2, 7, 4, 16), (2, 11, 2, 16), (2, 11, 2, 16)])
    ref = flashattn_ext.flash_attn_func(q, k, v, causal=True, window_size=(3, 0))
    dout = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    with torch.no_grad():
        out, lse, rng, unused, _ = sdpa_backend.flash_forward(q, k, v, None, None, 7, 11, 0.0, True, False,
                                                              window_size_left=3, window_size_right=0)
        grads = sdpa_backend.flash_backward(dout, q, k, v, out, lse, None, None, 7, 11, 0.0, True, rng, unused,
                                            window_size_left=3, window_size_right=0)
    for ours, theirs in zip((out,) + grads, (ref,) + ref_grads):
        torch.testing.assert_close(ours, theirs, **FP64)

    lens_q, lens_k = [3, 0, 5], [4, 2, 6]
    cu_q = torch.tensor([0, 3, 3, 8], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 4, 6, 12], dtype=torch.int32, device=device)
    q, k, v = _leaves(device, torch.float64, [(sum(lens_q), 4, 8), (sum(lens_k), 2, 8), (sum(lens_k), 2, 8)])
    ref = flashattn_ext.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 6, causal=True)
    dout = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    with torch.no_grad():
        out, lse, rng, unused, _ = sdpa_backend.flash_forward(q, k, v, cu_q.long(), cu_k.long(), 5, 6, 0.0, True,
                                                              False)
        grads = sdpa_backend.flash_backward(dout, q, k, v, out, lse, cu_q.long(), cu_k.long(), 5, 6, 0.0, True, rng,
                                            unused)
        lse_in_place = sdpa_backend.flash_forward_no_dropout_inplace(torch.empty_like(out), q, k, v, cu_q, cu_k, 5,
                                                                     6, 0.0, True, False)
    assert lse.shape == (4, sum(lens_q)) and torch.equal(lse_in_place, lse)
    for ours, theirs in zip((out,) + grads, (ref,) + ref_grads):
        torch.testing.assert_close(ours, theirs, **FP64)


@pytest.mark.parametrize("argument", ["seqused_k", "block_table", "num_splits", "return_debug_mask"])
def test_flash_layout_refuses_what_it_cannot_do(device, argument):
    q = torch.randn(1, 4, 2, 8, device=device)
    values = {"seqused_k": torch.ones(1, dtype=torch.int32, device=device),
              "block_table": torch.zeros(1, 1, dtype=torch.int32, device=device), "num_splits": 2}
    kwargs = {argument: values[argument]} if argument in values else {}
    with pytest.raises(RuntimeError, match=argument.split("_")[0]):
        sdpa_backend.flash_forward(q, q, q, None, None, 4, 4, 0.0, False, argument == "return_debug_mask", **kwargs)


def test_activated_hook_runs_sdpa_flash_on_ours(device):
    """On CUDA: with our implementation active, an unmodified module's SDPA call goes to torch's
    flash backend, which runs our kernels (seen in the profiler: our ops and CUDA kernels, none of
    torch's flash kernels), with the accuracy of torch's own flash kernels for the output and
    every parameter's gradient; restoring gives torch's kernels back."""
    attention = torch.nn.attention
    if device != "cuda" or not hasattr(attention, "register_flash_attention_impl"):
        pytest.skip("the flash attention hook serves CUDA tensors on torch >= 2.11")
    if not torch.backends.cuda.is_flash_attention_available() or torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("torch's flash backend is not available on this GPU")
    torch.manual_seed(0)
    block, x = Block(256, 4, 4).to(device), torch.randn(2, 300, 256, device=device)
    ref_out, ref_grads = _forward_backward(block.double(), x.double(), None, True)
    block.bfloat16()
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        torch_out, torch_grads = _forward_backward(block, x.bfloat16(), None, True)
        attention.activate_flash_attention_impl(sdpa_backend.NAME)
        try:
            assert attention.current_flash_attention_impl() == sdpa_backend.NAME
            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=activities) as prof:
                out, grads = _forward_backward(block, x.bfloat16(), None, True)
                torch.cuda.synchronize()
        finally:
            attention.restore_flash_attention_impl()
        _, fwd, _ = _ran_ours(lambda: _forward_backward(block, x.bfloat16(), None, True))
    names = {e.name for e in prof.events()}
    kernels = {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}
    assert names & OUR_FWD and names & OUR_BWD and not fwd
    assert any("flashattn::cuda" in k for k in kernels), sorted(kernels)
    assert not any("pytorch_flash" in k for k in kernels), sorted(kernels)
    assert_accurate("out", out, ref_out, torch_out, REL_ATOL[torch.bfloat16])
    for (name, _), g, t, r in zip(block.named_parameters(), grads, torch_grads, ref_grads):
        assert_accurate(name, g, r, t, REL_ATOL_GRAD[torch.bfloat16])

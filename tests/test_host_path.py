"""The lean host path of small calls: a public call whose signature (shapes, strides, dtypes,
devices and flags of q, k, v) passed every check before skips the checks and goes straight to
the op; the autograd Function of a call without features saves and passes only q, k, v, out and
lse; outputs are allocated with the fake kernels' strides. Each must give what the full path
gives, bit for bit, and must never let a bad call through."""
import pytest
import torch
import torch.nn.functional as F

import flashattn_ext
from flashattn_ext import _checks
from reference import NONE, TOP_LEFT, check_against_reference


@pytest.fixture(autouse=True)
def _no_signatures_remembered():
    _checks._PASSED.clear()
    yield
    _checks._PASSED.clear()


def _leaves(*shapes, device, dtype=torch.float64):
    return [torch.randn(s, dtype=dtype, device=device, requires_grad=True) for s in shapes]


def _out_and_grads(fn, inputs, dout):
    out = fn(*inputs)
    return (out, *torch.autograd.grad(out, inputs, dout))


SDPA_CALLS = {
    "plain": dict(),
    "causal": dict(is_causal=True),
    "scale": dict(scale=0.3, is_causal=True),
    "gqa": dict(enable_gqa=True),
}


def _count_checks(monkeypatch):
    calls = []
    check = flashattn_ext.functional.check_fwd_args
    monkeypatch.setattr(flashattn_ext.functional, "check_fwd_args",
                        lambda *args, **kw: calls.append(1) or check(*args, **kw))
    return calls


@pytest.mark.parametrize("call", SDPA_CALLS)
def test_sdpa_repeated_call_equals_first(device, call, monkeypatch):
    """The first call takes the full path and remembers its signature; the second takes the
    short one: same output and gradients, bit for bit, and as torch's SDPA."""
    checks = _count_checks(monkeypatch)
    kw = SDPA_CALLS[call]
    hk = 1 if kw.get("enable_gqa") else 4
    q, k, v = _leaves((2, 4, 9, 16), (2, hk, 13, 16), (2, hk, 13, 8), device=device)
    dout = torch.randn(2, 4, 9, 8, dtype=torch.float64, device=device)
    fn = lambda *t: flashattn_ext.scaled_dot_product_attention(*t, **kw)  # noqa: E731
    first = _out_and_grads(fn, (q, k, v), dout)
    second = _out_and_grads(fn, (q, k, v), dout)
    assert len(checks) == 1
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    expected = _out_and_grads(lambda *t: F.scaled_dot_product_attention(*t, **kw), (q, k, v), dout)
    for a, e in zip(first, expected):
        torch.testing.assert_close(a, e, rtol=0, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_func_repeated_call_equals_first(device, causal, monkeypatch):
    checks = _count_checks(monkeypatch)
    q, k, v = _leaves((2, 9, 4, 16), (2, 13, 2, 16), (2, 13, 2, 8), device=device)
    dout = torch.randn(2, 9, 4, 8, dtype=torch.float64, device=device)
    results = []
    for _ in range(2):
        out, lse = flashattn_ext.flash_attn_func(q, k, v, softmax_scale=0.25, causal=causal, deterministic=True,
                                                 return_lse=True)
        results.append((out, lse, *torch.autograd.grad(out, (q, k, v), dout)))
    assert len(checks) == 1
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_repeated_call_skips_the_checks(device, monkeypatch):
    calls = _count_checks(monkeypatch)
    q = torch.randn(1, 2, 8, 16, device=device)
    for n in range(3):
        flashattn_ext.scaled_dot_product_attention(q, q, q, is_causal=True)
        flashattn_ext.flash_attn_func(q, q, q)
        assert len(calls) == 2  # each entry point checked its first call only
    flashattn_ext.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(8, 8, dtype=torch.bool, device=device))
    assert len(calls) == 3  # a call with a mask is checked every time
    for n in range(2):
        flashattn_ext.attention(q, q, q, causal="bottom_right")
        flashattn_ext.scaled_dot_product_attention(q[0], q[0], q[0])  # 3-D: reshaped views
    assert len(calls) == 5


def test_signature_of_each_entry_point_and_flag_apart(device, monkeypatch):
    """A flag the checks read (enable_gqa) and the entry point are part of the signature: a
    grouped-query call that passed does not let the same tensors through without enable_gqa,
    and tensors that passed SDPA's checks are checked again by flash_attn_func."""
    q = torch.randn(1, 4, 8, 16, dtype=torch.float64, device=device)
    kv = torch.randn(1, 2, 8, 16, dtype=torch.float64, device=device)
    flashattn_ext.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
    flashattn_ext.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        flashattn_ext.scaled_dot_product_attention(q, kv, kv)
    calls = _count_checks(monkeypatch)
    # As flash_attn_func's (batch, len, heads, dim): 6 heads of q against 8 of k.
    q6, k8 = (torch.randn(1, 4, n, 16, dtype=torch.float64, device=device) for n in (6, 8))
    flashattn_ext.scaled_dot_product_attention(q6, k8, k8)
    flashattn_ext.scaled_dot_product_attention(q6, k8, k8)
    assert len(calls) == 1
    with pytest.raises(RuntimeError, match="multiple of the number of key/value heads"):
        flashattn_ext.flash_attn_func(q6, k8, k8)
    assert len(calls) == 2


def test_failed_call_is_not_remembered(device):
    """A call that failed a check fails again the same way (nothing remembered), and a bad call
    of another signature after a good one is checked."""
    q = torch.randn(1, 2, 8, 300, device=device)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="head_dim of q and k must be between 1 and 256"):
            flashattn_ext.scaled_dot_product_attention(q, q, q)
    assert not _checks._PASSED
    good = torch.randn(1, 2, 8, 16, device=device)
    flashattn_ext.scaled_dot_product_attention(good, good, good)
    flashattn_ext.scaled_dot_product_attention(good, good, good)
    with pytest.raises(RuntimeError, match="dtype"):
        flashattn_ext.scaled_dot_product_attention(good, good.double(), good)


def test_strided_head_dim_is_copied_not_remembered(device):
    """A last dimension that is not contiguous is copied on the way (as torch's SDPA does), so its signature is not
    remembered: the fast path would hand the strided view to the op, which refuses it."""
    good = torch.randn(1, 2, 8, 16, device=device)
    strided = torch.randn(1, 2, 8, 32, device=device)[..., ::2]
    assert _checks.call_signature(good, strided, good, "sdpa") is None
    expected = flashattn_ext.scaled_dot_product_attention(good, strided.contiguous(), good)
    for _ in range(2):
        assert torch.equal(flashattn_ext.scaled_dot_product_attention(good, strided, good), expected)
    assert all(strided.stride() not in (sig[1], sig[5], sig[9]) for sig in _checks._PASSED)


def test_no_signature_for_what_the_checks_cannot_summarize(device):
    t = torch.randn(1, 2, 4, 8, device=device)
    assert _checks.call_signature(t, t, t) is not None
    assert _checks.call_signature(t, t.to_sparse(), t) is None  # no strides
    assert _checks.call_signature(t, torch.nn.Parameter(t), t) is None  # a tensor subclass
    assert _checks.call_signature(t, t, [1]) is None
    nested = torch.nested.nested_tensor([t[0], t[0, :, :2]])  # strided layout, no strides
    assert _checks.call_signature(t, nested, t) is None
    seen = []
    torch.func.grad(lambda x: seen.append(_checks.call_signature(x, t, t)) or x.sum())(t)
    assert seen == [None]  # inside a torch.func transform


def test_remembered_signatures_are_bounded(device, monkeypatch):
    monkeypatch.setattr(_checks, "_PASSED_MAX", 3)
    for n in range(1, 8):
        t = torch.randn(1, 1, n, 8, device=device)
        flashattn_ext.scaled_dot_product_attention(t, t, t)
        assert 1 <= len(_checks._PASSED) <= 3


@pytest.mark.parametrize("shape", [(2, 3, 5, 8), (0, 3, 5, 8), (2, 3, 0, 8), (1, 1, 1, 8)],
                         ids=["plain", "no_batch", "no_rows", "one_row"])
@pytest.mark.parametrize("layout", ["bhld", "blhd"])
def test_outputs_have_the_fake_kernels_strides(device, shape, layout):
    """The ops allocate out, lse, dq, dk and dv with the strides their fake kernels give
    (torch.compile plans with those), empty shapes included."""
    def make():
        t = torch.randn(shape, device=device)
        if layout == "blhd":
            t = torch.randn(shape[0], shape[2], shape[1], shape[3], device=device).transpose(1, 2)
        return t

    q, k, v = make(), make(), make()
    out, lse = torch.ops.flashattn.fwd(q, k, v, 0.5, TOP_LEFT)
    grads = torch.ops.flashattn.bwd(torch.ones_like(out), q, k, v, out, lse, None, 0.5, TOP_LEFT, False)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
        fout, flse = torch.ops.flashattn.fwd(fq, fk, fv, 0.5, TOP_LEFT)
        fgrads = torch.ops.flashattn.bwd(torch.ones_like(fout), fq, fk, fv, fout, flse, None, 0.5, TOP_LEFT, False)
    for real, fake in zip((out, lse, *grads), (fout, flse, *fgrads)):
        assert (real.shape, real.stride(), real.dtype) == (fake.shape, fake.stride(), fake.dtype)


# ---- the plain kernels (flashattn::_fwd_plain / _bwd_plain: only the arguments a call without
# optional features reads) against the general ones ----

PLAIN_CASES = {
    # name: (batch, heads_q, heads_kv, len_q, len_k, head_dim, head_dim_v, causal, blhd layout)
    "mha": (2, 2, 2, 7, 9, 16, 16, 0, False),
    "gqa_top_left": (1, 4, 2, 9, 6, 8, 12, 1, False),
    "bottom_right_blhd": (2, 3, 1, 5, 11, 32, 32, 2, True),
}


def _plain_case(name, dtype, device):
    b, hq, hk, lq, lk, e, ev, causal, blhd = PLAIN_CASES[name]

    def make(heads, length, dim):
        if blhd:
            return torch.randn(b, length, heads, dim, dtype=dtype, device=device).transpose(1, 2)
        return torch.randn(b, heads, length, dim, dtype=dtype, device=device)

    return make(hq, lq, e), make(hk, lk, e), make(hk, lk, ev), causal


@pytest.mark.parametrize("case", PLAIN_CASES)
@pytest.mark.parametrize("dlse", [False, True], ids=["no_dlse", "dlse"])
def test_plain_kernels_equal_the_general_ones(device, case, dlse):
    """Same outputs and gradients bit for bit, with the same strides, from the same C++ forward
    and backward: only the schema differs."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float64
    q, k, v, causal = _plain_case(case, dtype, device)
    plain = torch.ops.flashattn._fwd_plain(q, k, v, 0.3, causal)
    general = torch.ops.flashattn._fwd(q, k, v, 0.3, causal)
    assert plain[2] == general[2] == ""
    out, lse = general[:2]
    dout = torch.randn_like(out)
    g = torch.randn_like(lse) if dlse else None
    for deterministic in (False, True):
        grads_plain = torch.ops.flashattn._bwd_plain(dout, q, k, v, out, lse, g, 0.3, causal, deterministic)
        grads = torch.ops.flashattn._bwd(dout, q, k, v, out, lse, g, 0.3, causal, deterministic)
        assert grads_plain[3] == grads[4] == ""
        results = [(plain[:2], general[:2])]
        # The general backward's dq, dk, dv are not deterministic by default on CUDA: compare the
        # deterministic ones there.
        if deterministic or device == "cpu":
            results.append((grads_plain[:3], grads[:3]))
        for pair in results:
            for a, b in zip(*pair):
                assert torch.equal(a, b) and a.stride() == b.stride()


def _bad_plain_calls(device):
    """(q, k, v, causal) of calls the checks refuse, one rule each."""
    q = torch.randn(1, 2, 4, 8, device=device)
    return {
        "dtype": (q, q.double(), q, 0),
        "rank": (q[0], q[0], q[0], 0),
        "heads": (q, q[:, :1].expand(1, 3, 4, 8), q[:, :1].expand(1, 3, 4, 8), 0),
        "head_dim": (torch.randn(1, 2, 4, 300, device=device),) * 3 + (0,),
        "last_dim_strided": (q, torch.randn(1, 2, 4, 16, device=device)[..., ::2], q, 0),
        "causal": (q, q, q, 3),
        "int_dtype": (q.int(),) * 3 + (0,),
    }


@pytest.mark.parametrize("call", list(_bad_plain_calls("cpu")))
def test_plain_kernels_refuse_what_the_general_ones_refuse(device, call):
    """Every wrong argument gets the general kernels' message from the plain ones too (they
    return it; ops.run_fwd_plain / run_bwd_plain raise it)."""
    q, k, v, causal = _bad_plain_calls(device)[call]
    error = torch.ops.flashattn._fwd(q, k, v, 0.5, causal)[2]
    assert error and torch.ops.flashattn._fwd_plain(q, k, v, 0.5, causal)[2] == error
    out = torch.zeros(q.shape[:-1] + v.shape[-1:], dtype=q.dtype, device=device) if q.dim() == 4 else q
    lse = torch.zeros(q.shape[:-1], dtype=torch.float32, device=device) if q.dim() == 4 else q
    args = (out, q, k, v, out, lse, None, 0.5, causal, False)
    error = torch.ops.flashattn._bwd(*args)[4]
    assert error and torch.ops.flashattn._bwd_plain(*args)[3] == error
    with pytest.raises(RuntimeError, match="flashattn"):
        flashattn_ext.ops.run_fwd_plain(q, k, v, 0.5, causal)
    with pytest.raises(RuntimeError, match="flashattn"):
        flashattn_ext.ops.run_bwd_plain(*args)


def test_calls_on_recycled_memory_in_turn(device):
    """Calls whose operands take memory the caching allocator hands back from the call before: the same
    addresses under other shapes and strides (heads and head dims traded, the batch-sequence-heads layout), each
    shape twice, new values each time; each call's output and gradients against the float64 reference. On CUDA
    the Hopper kernels read the operands through tensor maps encoded from address, shape and strides: a map kept
    from an earlier call at the same address would read the wrong elements."""
    if device != "cuda":
        pytest.skip("the tensor maps of the Hopper kernels: CUDA")

    def make(shape):
        b, h, l, e, layout = shape
        if layout == "blhd":
            return [torch.randn(b, l, h, e, dtype=torch.bfloat16, device=device).transpose(1, 2) for _ in range(3)]
        return [torch.randn(b, h, l, e, dtype=torch.bfloat16, device=device) for _ in range(3)]

    shapes = [(4, 8, 1024, 64, "bhld"), (4, 4, 1024, 128, "bhld"), (4, 8, 1024, 64, "blhd")]
    for shape in shapes + shapes:
        q, k, v = make(shape)
        check_against_reference(q, k, v, 0.125, NONE)

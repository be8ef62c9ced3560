"""Nothing crashes and nothing is silently wrong: bad values through every entry point (run in a
subprocess, so that a crash fails one test instead of killing the run), accepted arguments at
their extremes, CUDA-graph capture and replay, torch.compile, autocast and torch.func."""
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import flashattn_ext
from flashattn_ext import flash_attn_func, flash_attn_varlen_func
from feature_reference import attention_ref

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Each probe is `name: code`; the code runs in one subprocess per test, which prints the name and
# "ok" or the type of the exception raised. A probe that kills the process leaves its name last.
_PROBE_HEADER = """
import sys, torch, flashattn_ext
from flashattn_ext import flash_attn_func, flash_attn_varlen_func
dev = sys.argv[1]
fwd, bwd = torch.ops.flashattn.fwd, torch.ops.flashattn.bwd
q = torch.randn(2, 3, 40, 16, device=dev)
x = torch.randn(30, 2, 16, device=dev)
def cu(*offsets):
    return torch.tensor(offsets, dtype=torch.int32, device=dev)
def probe(name, fn):
    print(name, end=" ", flush=True)
    try:
        fn()
        print("ok", flush=True)
    except Exception as e:
        print(type(e).__name__, flush=True)
"""

RAW_OP_PROBES = {
    "fwd_rank": ("fwd(q[0], q, q, 1.0, 0)", "RuntimeError"),
    "fwd_causal": ("fwd(q, q, q, 1.0, 7)", "RuntimeError"),
    "fwd_dtype": ("fwd(q, q.double(), q, 1.0, 0)", "RuntimeError"),
    "fwd_head_dim": ("fwd(*(torch.randn(1, 1, 4, 300, device=dev),) * 3, 1.0, 0)", "RuntimeError"),
    "fwd_scale_inf": ("fwd(q, q, q, float('inf'), 0)", "RuntimeError"),
    "fwd_scale_overflow": ("fwd(q, q, q, 1e39, 1)", "RuntimeError"),
    "fwd_dropout_no_rng": ("fwd(q, q, q, 1.0, 0, dropout_p=0.5)", "RuntimeError"),
    "fwd_bias_shape": ("fwd(q, q, q, 1.0, 0, attn_bias=torch.zeros(2, 3, 41, 40, device=dev))", "RuntimeError"),
    "fwd_cu_decreasing": ("fwd(*(x.transpose(0, 1)[None],) * 3, 1.0, 0, cu_seqlens_q=cu(0, 20, 10, 30), "
                          "cu_seqlens_k=cu(0, 20, 10, 30), max_seqlen_q=30, max_seqlen_k=30)", "RuntimeError"),
    "fwd_cu_total": ("fwd(*(x.transpose(0, 1)[None],) * 3, 1.0, 0, cu_seqlens_q=cu(0, 40), "
                     "cu_seqlens_k=cu(0, 40), max_seqlen_q=40, max_seqlen_k=40)", "RuntimeError"),
    "fwd_cu_max_seqlen": ("fwd(*(x.transpose(0, 1)[None],) * 3, 1.0, 0, cu_seqlens_q=cu(0, 30), "
                          "cu_seqlens_k=cu(0, 30), max_seqlen_q=10, max_seqlen_k=30)", "RuntimeError"),
    "bwd_lse_shape": ("bwd(q, q, q, q, q, torch.zeros(2, 3, 41, device=dev), None, 1.0, 0, False)", "RuntimeError"),
    "bwd_dout_shape": ("bwd(q[:, :, :5], q, q, q, q, torch.zeros(2, 3, 40, device=dev), None, 1.0, 0, False)",
                       "RuntimeError"),
    "dropout_mask_op_huge": ("torch.ops.flashattn.dropout_mask(torch.zeros(2, dtype=torch.int64), 2**40, 2**40, "
                             "2**40, 2**40, 0.5)", "RuntimeError"),
    "dropout_mask_huge": ("flashattn_ext.ops.dropout_mask(torch.zeros(2, dtype=torch.int64), 2**40, 1, 1, 1, 0.5)",
                          "ValueError"),
    "varlen_max_seqlen_huge": ("flash_attn_varlen_func(x, x, x, cu(0, 30), cu(0, 30), 30, 2**63 - 1)", "ok"),
    "varlen_max_seqlen_beyond_int64": ("flash_attn_varlen_func(x, x, x, cu(0, 30), cu(0, 30), 2**70, 30)", "ok"),
    "window_beyond_int64": ("flash_attn_func(q, q, q, window_size=(2**64, 0))", "ok"),
    "scale_string": ("flash_attn_func(q, q, q, softmax_scale='abc')", "TypeError"),
    "sparse_input": ("flash_attn_func(q.to_sparse(), q, q)", "ValueError"),
}

# Bad offsets reach the op unchecked while torch.compile traces (fake tensors have no values):
# the compiled call must still raise.
COMPILE_PROBES = {
    f"compile_{backend}_{case}": (
        f"torch.compile(flash_attn_varlen_func, fullgraph=True, backend='{backend}')(x, x, x, {offsets}, "
        f"{offsets}, {max_seqlen}, 30)", "RuntimeError")
    for backend in ("eager", "aot_eager")
    for case, offsets, max_seqlen in (("decreasing", "cu(0, 20, 10, 30)", 30), ("total", "cu(0, 40)", 40),
                                      ("max_seqlen", "cu(0, 30)", 10))
}

CUDA_PROBES = {
    # 2**20 heads of 4096 rows: the 512 GiB output cannot be allocated.
    "out_of_memory": ("fwd(*(torch.zeros(1, 1, 4096, 64, device=dev, dtype=torch.float16).expand(1, 2**20, 4096, "
                      "64),) * 3, 1.0, 0)", "OutOfMemoryError"),
}


def _run_probes(device, probes):
    code = _PROBE_HEADER + "".join(f"probe({name!r}, lambda: {src})\n" for name, (src, _) in probes.items())
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-c", code, device], capture_output=True, text=True, timeout=600, env=env,
                         cwd=ROOT)
    got = dict(line.split(" ", 1) for line in run.stdout.splitlines() if " " in line)
    last = run.stdout.split()[-2:] if run.stdout else []
    assert run.returncode == 0, f"the process died (exit {run.returncode}) after {last}:\n{run.stderr[-3000:]}"
    for name, (_, expected) in probes.items():
        assert got.get(name) == expected, f"{name}: expected {expected}, got {got.get(name)}\n{run.stderr[-3000:]}"


def test_bad_values_raise_through_every_entry_point(device):
    _run_probes(device, RAW_OP_PROBES | (CUDA_PROBES if device == "cuda" else {}))


def test_bad_offsets_raise_under_torch_compile(device):
    _run_probes(device, COMPILE_PROBES)


# ---- accepted arguments at their extremes ----

def _qkv(device, dtype=torch.float64, b=2, h=2, lq=9, lk=13, e=16):
    make = lambda n: torch.randn(b, n, h, e, dtype=dtype, device=device, requires_grad=True)  # noqa: E731
    return make(lq), make(lk), make(lk)


def _out_and_grads(fn, q, k, v):
    out = fn(q, k, v)
    dout = torch.ones_like(out)
    return (out,) + torch.autograd.grad(out, (q, k, v), dout)


@pytest.mark.parametrize("lq,lk", [(9, 13), (13, 9)])
@pytest.mark.parametrize("window", [(2**63 - 1, -1), (-1, 2**63 - 1), (2**63 - 1, 2**63 - 1), (22, 22), (2**80, 3)])
def test_windows_wider_than_every_length_are_unbounded(device, lq, lk, window):
    """Output and gradients equal those of the window with every side wider than len_q + len_k
    made unbounded (-1), which the float64 reference checks."""
    q, k, v = _qkv(device, lq=lq, lk=lk)
    unbounded = tuple(-1 if w >= lq + lk else w for w in window)
    got = _out_and_grads(lambda *t: flash_attn_func(*t, window_size=window), q, k, v)
    ref = _out_and_grads(lambda *t: flash_attn_func(*t, window_size=unbounded), q, k, v)
    for g, r in zip(got, ref):
        assert torch.equal(g, r)
    expected, _ = attention_ref(*(t.detach().transpose(1, 2) for t in (q, k, v)), 1 / math.sqrt(16),
                                window=unbounded)
    torch.testing.assert_close(got[0], expected.transpose(1, 2), rtol=0, atol=1e-12)


def test_max_seqlen_beyond_the_rows_is_clamped(device):
    x = torch.randn(30, 2, 16, dtype=torch.float64, device=device)
    cu = torch.tensor([0, 12, 30], dtype=torch.int32, device=device)
    exact = flash_attn_varlen_func(x, x, x, cu, cu, 18, 18)
    for big in (31, 10**9, 2**63 - 1, 2**70):
        assert torch.equal(flash_attn_varlen_func(x, x, x, cu, cu, big, big), exact)


@pytest.mark.parametrize("cap", [float("inf"), 1e39, 3.5e38])
def test_infinite_softcap_is_no_cap(device, cap):
    q, k, v = _qkv(device, dtype=torch.float32)
    got = _out_and_grads(lambda *t: flash_attn_func(*t, softcap=cap), q, k, v)
    ref = _out_and_grads(flash_attn_func, q, k, v)
    for g, r in zip(got, ref):
        assert torch.equal(g, r)


def test_scale_beyond_the_accumulation_type_is_refused(device):
    q, k, v = _qkv(device, dtype=torch.float32)
    qt, kt, vt = (t.detach().transpose(1, 2) for t in (q, k, v))
    for scale in (1e39, float("inf"), float("nan")):
        # each entry point names the argument as its signature does
        for call in (lambda: flash_attn_func(q, k, v, softmax_scale=scale, causal=True),
                     lambda: flashattn_ext.flash_attn_with_kvcache(q.detach(), k.detach(), v.detach(),
                                                                  softmax_scale=scale)):
            with pytest.raises(ValueError, match=r"softmax_scale must be finite with \|softmax_scale\| <= "):
                call()
        with pytest.raises(ValueError, match=r"scale must be finite with \|scale\| <= "):
            flashattn_ext.scaled_dot_product_attention(qt, kt, vt, scale=scale)
        # and the op itself, whichever way it is reached
        with pytest.raises(RuntimeError, match="argument 'scale' must be finite with"):
            flashattn_ext.ops.fwd_plain(qt, kt, vt, scale, False, False)
    # float64 accumulates in float64: the same scale is valid there (and the softmax is a hard max)
    q, k, v = (t.detach() for t in _qkv(device))
    out = flash_attn_func(q, k, v, softmax_scale=1e39)
    expected = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), scale=1e39).transpose(1, 2)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)


def test_broadcast_float_mask_gradient_rounds_once(device):
    """float64 inputs, float32 (1, Lk) mask: its gradient is summed over the broadcast
    dimensions (batch, heads, queries) in float64, then rounded to float32 once. (A (Lq, 1) mask
    adds a constant to each row, which the softmax cancels: its gradient is zero.)"""
    q, k, v = (torch.randn(2, 3, n, 16, dtype=torch.float64, device=device, requires_grad=True) for n in (40, 50, 50))
    mask = torch.randn(1, 50, dtype=torch.float32, device=device, requires_grad=True)
    out = flashattn_ext.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    dout = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, (mask,), dout)
    mask64 = mask.detach().double().requires_grad_()
    (expected,) = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, attn_mask=mask64), (mask64,), dout)
    assert grad.dtype == torch.float32
    torch.testing.assert_close(grad, expected.float(), rtol=1.2e-7, atol=1e-12)


def test_varlen_on_meta_tensors_gives_shapes():
    x = torch.empty(30, 2, 16, device="meta")
    cu = torch.empty(3, dtype=torch.int32, device="meta")
    out, lse = flash_attn_varlen_func(x, x, x, cu, cu, 20, 20, return_lse=True)
    assert out.shape == (30, 2, 16) and lse.shape == (2, 30)


def test_messages_show_the_shapes_the_user_passed(device):
    q = torch.randn(2, 7, 3, 16, device=device)
    k = torch.randn(2, 7, 4, 16, device=device)
    with pytest.raises(RuntimeError,
                       match=r"argument 'v' has number of heads \(must equal k's\) 3 \(shape \[2, 7, 3, 16\]\) "):
        flash_attn_func(q, k, q)
    x = torch.randn(30, 2, 16, device=device)
    cu = torch.tensor([0, 30], dtype=torch.int32, device=device)
    with pytest.raises(RuntimeError, match=r"argument 'k' has head_dim \(must equal q's\) 8 \(shape \[30, 2, 8\]\)"):
        flash_attn_varlen_func(x, x[..., :8], x, cu, cu, 30, 30)


@pytest.mark.parametrize("name,value,match", [
    ("softmax_scale", "abc", r"softmax_scale must be a real number, got 'abc'"),
    ("softcap", [1.0], r"softcap must be a real number >= 0 \(0 = off\), got \[1.0\]"),
    ("dropout_p", "0.1", r"dropout_p must be a real number in \[0, 1\), got '0.1'"),
    ("window_size", (1, 2, 3), r"window_size must be a pair \(left, right\) of ints \(-1 = unbounded\)"),
])
def test_scalar_arguments_are_named(device, name, value, match):
    q = torch.randn(1, 4, 2, 16, device=device)
    with pytest.raises((TypeError, ValueError), match=match):
        flash_attn_func(q, q, q, **{name: value})


# ---- autocast and torch.func ----

def test_autocast_computes_in_the_autocast_dtype(device):
    dtype = torch.bfloat16 if device == "cpu" else torch.float16
    q, k, v = (torch.randn(2, 3, n, 32, device=device, requires_grad=True) for n in (20, 30, 30))
    with torch.autocast(device, dtype=dtype):
        out = flashattn_ext.scaled_dot_product_attention(q, k, v, is_causal=True)
        raw, _ = torch.ops.flashattn.fwd(q, k, v, 0.25, 1)
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.dtype == raw.dtype == expected.dtype == dtype
    assert torch.equal(out, flashattn_ext.scaled_dot_product_attention(*(t.to(dtype) for t in (q, k, v)),
                                                                       is_causal=True))
    assert torch.equal(raw, torch.ops.flashattn.fwd(*(t.to(dtype) for t in (q, k, v)), 0.25, 1)[0])
    out.float().sum().backward()  # the gradients reach the float32 leaves through the casts
    assert q.grad.dtype == torch.float32 and torch.isfinite(q.grad).all()


def test_torch_func_grad_and_vjp(device):
    q, k, v = (t.detach() for t in _qkv(device))
    loss = lambda q, k, v: (flash_attn_func(q, k, v, causal=True) ** 2).sum()  # noqa: E731
    grads = torch.func.grad(loss, argnums=(0, 1, 2))(q, k, v)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = torch.autograd.grad(loss(*leaves), leaves)
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-12)
    out, vjp = torch.func.vjp(lambda q: flash_attn_func(q, k, v), q)
    (dq,) = vjp(torch.ones_like(out))
    leaf = q.clone().requires_grad_()
    torch.testing.assert_close(dq, torch.autograd.grad(flash_attn_func(leaf, k, v).sum(), leaf)[0], rtol=0, atol=1e-12)


# ---- CUDA graphs ----

cuda_only = pytest.mark.skipif(not torch.cuda.is_available() or not flashattn_ext.has_cuda_kernels(),
                               reason="CUDA graphs need a GPU and the CUDA kernels")


def _capture(fn):
    """fn captured in a CUDA graph (after a warm-up on a side stream); returns (graph, output)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


@cuda_only
def test_varlen_captured_in_a_cuda_graph_replays_new_values():
    x = torch.randn(60, 4, 64, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, 17, 60], dtype=torch.int32, device="cuda")
    graph, out = _capture(lambda: flash_attn_varlen_func(x, x, x, cu, cu, 43, 43, causal=True))
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.testing.assert_close(out, flash_attn_varlen_func(x, x, x, cu, cu, 43, 43, causal=True), rtol=0, atol=0)


@cuda_only
def test_dropout_replayed_from_a_cuda_graph_draws_new_masks():
    q = torch.randn(1, 256, 4, 64, device="cuda", dtype=torch.float16)
    graph, out = _capture(lambda: flash_attn_func(q, q, q, dropout_p=0.5))
    outs = []
    for _ in range(3):
        graph.replay()
        outs.append(out.clone())
    assert not torch.equal(outs[0], outs[1]) and not torch.equal(outs[1], outs[2])
    torch.manual_seed(4)
    first = flash_attn_func(q, q, q, dropout_p=0.5)
    torch.manual_seed(4)
    assert torch.equal(first, flash_attn_func(q, q, q, dropout_p=0.5))  # eager: the seed reproduces the call


@cuda_only
@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_compile_reduce_overhead(dropout_p):
    x = torch.randn(60, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cu = torch.tensor([0, 17, 60], dtype=torch.int32, device="cuda")
    fn = torch.compile(lambda x: flash_attn_varlen_func(x, x, x, cu, cu, 43, 43, causal=True, dropout_p=dropout_p),
                       mode="reduce-overhead")
    for _ in range(3):
        out = fn(x)
        out.sum().backward()
    if dropout_p == 0.0:
        torch.testing.assert_close(out, flash_attn_varlen_func(x, x, x, cu, cu, 43, 43, causal=True), rtol=0, atol=0)

"""Ring attention (flashattn_ext.distributed) against one process's attention on the whole
sequence: 2 and 4 processes (gloo on CPU; NCCL when the GPUs are there), out, lse and dq/dk/dv
of each rank's shard, float64 against the op on the unsharded tensors, float32 / bfloat16 with
the accuracy rule against the float64 torch reference. Each spawned job runs many cases
(spawning costs seconds). The block plan is checked against the global mask by brute force."""
import itertools
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flashattn_ext
from flashattn_ext import distributed as fd
from flashattn_ext._measure import REL_ATOL, REL_ATOL_GRAD
from flashattn_ext._ring_plan import LAYOUTS, alibi_terms, block_calls, ring_steps, shard_chunks
from flashattn_ext.ops import CAUSAL_BOTTOM_RIGHT
from reference import BOTTOM_RIGHT, NONE, assert_accurate, attention, attention_composite, lse_dtype, \
    run_with_grads, same_dtype_backend

# The float64 comparison with the op on the whole sequence: only the summation order differs.
F64_TOL = 1e-12


def _shard(x, dim, layout, rank, world, group=None):
    if layout == "zigzag":
        return fd.zigzag_shard(x, dim, group)
    return x.chunk(world, dim)[rank]


def _inputs(dtype, device, b, length, hq, hkv, e, ev=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda *s: torch.randn(*s, generator=g).to(dtype=dtype, device=device)
    ev = ev or e
    return (make(b, length, hq, e), make(b, length, hkv, e), make(b, length, hkv, ev), make(b, length, hq, ev),
            make(b, hq, length).to(lse_dtype(dtype)))


def _grads(fn, q, k, v, dout, dlse):
    """out, lse, dq, dk, dv of fn on fresh leaves for the loss sum(out dout) [+ sum(lse dlse)]."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = fn(q, k, v)
    loss = (out * dout).sum() + ((lse * dlse).sum() if dlse is not None else 0)
    return dict(zip(("out", "lse", "dq", "dk", "dv"), (out.detach(), lse.detach(),
                                                       *torch.autograd.grad(loss, (q, k, v)))))


def _check_exact(rank, world, device, causal=False, layout=None, hq=2, hkv=2, n=6, window=(-1, -1), softcap=0.0,
                 alibi=False, with_dlse=False, b=2, e=8, ev=None, group=None, head_dim_transposed=False):
    """float64: this rank's shard of ring_attention against the op on the whole sequence; rank
    and world within `group` (default: the world). head_dim_transposed: q, k and v shards stored with the head
    dim outermost (a last dimension that is not contiguous, which ring_attention copies)."""
    label = dict(world=world, causal=causal, layout=layout, hq=hq, hkv=hkv, n=n, window=window, softcap=softcap,
                 alibi=alibi, with_dlse=with_dlse, ev=ev, head_dim_transposed=head_dim_transposed)
    layout_used = layout or ("zigzag" if causal else "contiguous")
    q, k, v, dout, dlse = _inputs(torch.float64, device, b, n * world, hq, hkv, e, ev, seed=len(str(label)))
    dlse = dlse if with_dlse else None
    slopes = torch.rand(b, hq, generator=torch.Generator().manual_seed(7)).to(device) if alibi else None
    options = dict(causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes, return_lse=True)
    ref = _grads(lambda *t: flashattn_ext.flash_attn_func(*t, **options), q, k, v, dout, dlse)
    shard = lambda x, dim=1: _shard(x, dim, layout_used, rank, world, group)
    stored = (lambda x: x.transpose(-1, -2).contiguous().transpose(-1, -2)) if head_dim_transposed else (lambda x: x)
    got = _grads(lambda *t: fd.ring_attention(*t, group=group, layout=layout, **options), stored(shard(q)),
                 stored(shard(k)), stored(shard(v)), shard(dout), None if dlse is None else shard(dlse, 2))
    for name in ("out", "lse", "dq", "dk", "dv"):
        want = shard(ref[name], 2 if name == "lse" else 1)
        err = (got[name] - want).abs().max().item()
        bound = F64_TOL * max(1.0, want.abs().max().item())
        assert err <= bound, f"{name}: max error {err:.3e} > {bound:.3e} on rank {rank} for {label}"


def _check_accuracy(rank, world, device, dtype, causal, hq=4, hkv=2, n=16, b=1, e=32):
    """float32 / bfloat16: DESIGN §4's rule against torch's float64 reference, torch's own error
    measured in the same dtype (on CPU for bf16, the larger of the math path's and the plain
    composite's, as tests/reference.py explains)."""
    layout = "zigzag" if causal else "contiguous"
    code = BOTTOM_RIGHT if causal else NONE
    scale = e ** -0.5
    q, k, v, dout, _ = _inputs(dtype, device, b, n * world, hq, hkv, e, seed=3)
    heads = lambda t: t.transpose(1, 2)  # the references take (batch, heads, len, dim)
    ref = run_with_grads(lambda *t: attention(*t, scale, code), *(heads(t).double() for t in (q, k, v, dout)))
    backend = same_dtype_backend(device, n * world, n * world, code)
    same = run_with_grads(lambda *t: attention(*t, scale, code, backend), *(heads(t) for t in (q, k, v, dout)))
    if dtype == torch.bfloat16 and torch.device(device).type == "cpu":
        plain = run_with_grads(lambda *t: attention_composite(*t, scale, code), *(heads(t) for t in (q, k, v, dout)))
        err = lambda x, name: (x[name].double() - ref[name]).abs().max()
        same = {name: plain[name] if err(plain, name) > err(same, name) else same[name] for name in same}
    shard = lambda x, dim: _shard(x, dim, layout, rank, world)
    got = _grads(lambda *t: fd.ring_attention(*t, causal=causal, return_lse=True), shard(q, 1), shard(k, 1),
                 shard(v, 1), shard(dout, 1), None)
    for name in ("out", "lse", "dq", "dk", "dv"):
        tol = REL_ATOL[lse_dtype(dtype)] if name == "lse" else (REL_ATOL if name == "out" else REL_ATOL_GRAD)[dtype]
        mine = got[name] if name == "lse" else heads(got[name])
        assert mine.dtype == (lse_dtype(dtype) if name == "lse" else dtype), name
        assert_accurate(f"{name} ({dtype}, causal={causal}, rank {rank})", mine, shard(ref[name], 2),
                        shard(same[name], 2), tol)


def _check_errors_and_helpers(rank, world, device):
    q = torch.randn(1, 4, 2, 8, dtype=torch.float64, device=device)
    longer = torch.randn(1, 6, 2, 8, dtype=torch.float64, device=device)
    with pytest.raises(ValueError, match=r"q shape is \(1, 4, 2, 8\) on rank 0 and \(1, 6, 2, 8\) on rank 1"
                       if rank == 0 else r"q shape is \(1, 6, 2, 8\) on rank 1 and \(1, 4, 2, 8\) on rank 0"):
        fd.ring_attention(longer if rank == 1 else q, q if rank == 0 else longer, q if rank == 0 else longer)
    with pytest.raises(ValueError, match=r"causal is (0|1) on rank %d" % rank):
        fd.ring_attention(q, q, q, causal=rank == 0)
    with pytest.raises(ValueError, match=r"shard_len must be even, got 3"):
        fd.ring_attention(q[:, :3], q[:, :3], q[:, :3], causal=True)
    with pytest.raises(ValueError, match=r"layout must be one of"):
        fd.ring_attention(q, q, q, layout="striped")
    with pytest.raises(ValueError, match=r"softmax_scale must be finite .* got inf"):
        fd.ring_attention(q, q, q, softmax_scale=float("inf"))
    with pytest.raises(TypeError, match=r"softcap must be a real number >= 0 \(0 = off\), got 'x'"):
        fd.ring_attention(q, q, q, softcap="x")
    with pytest.raises(RuntimeError, match=r"'window_size' must be \(left, right\) with each >= 0, or -1"):
        fd.ring_attention(q, q, q, window_size=(-2, 0))
    with pytest.raises(ValueError, match=r"\(6\) must be a multiple of 2 \* world_size = 4"):
        fd.zigzag_shard(longer, 1)
    x = torch.randn(1, 4, 2, 8, device=device, requires_grad=True)
    with torch.autocast(device.type, dtype=torch.bfloat16):  # computed in bf16, as the ops under autocast
        out = fd.ring_attention(x, x, x, causal=True)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, fd.ring_attention(*(x.detach().bfloat16(),) * 3, causal=True))
    out.float().sum().backward()
    assert x.grad.dtype == torch.float32 and x.grad.abs().sum() > 0
    whole = torch.arange(24.0, device=device).reshape(1, 8, 3)
    mine = fd.zigzag_shard(whole, 1)
    assert torch.equal(mine[0, :, 0], torch.tensor([2 * rank, 2 * rank + 1, 6 - 2 * rank, 7 - 2 * rank],
                                                   dtype=whole.dtype, device=device) * 3)
    assert torch.equal(fd.zigzag_unshard(mine, 1), whole)


EXACT_CASES = {
    2: [dict(), dict(n=5, hq=4, hkv=2), dict(causal=True, hq=4, hkv=1), dict(causal=True, n=10, with_dlse=True),
        dict(causal=True, layout="contiguous", n=5, ev=4), dict(n=7, window=(3, 2)), dict(causal=True, window=(4, -1)),
        dict(causal=True, n=8, window=(2, 0), softcap=0.7), dict(n=5, alibi=True, with_dlse=True),
        dict(causal=True, alibi=True, window=(7, -1)), dict(causal=True, head_dim_transposed=True)],
    4: [dict(n=3, hq=4, hkv=2), dict(causal=True, n=4, hq=4, hkv=2, with_dlse=True), dict(causal=True, window=(5, 0)),
        dict(n=4, window=(1, 6), alibi=True, softcap=0.5),
        # rings stopped early (2 steps, then 1): dK/dV go home in one direct transfer, or stay
        dict(causal=True, layout="contiguous", n=5, window=(4, -1), with_dlse=True),
        dict(causal=True, layout="contiguous", n=3, window=(0, 0))],
}


def _worker(rank, world, port, device_type):
    torch.set_num_threads(1)
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    try:
        for case in EXACT_CASES[world]:
            _check_exact(rank, world, device, **case)
        if world == 4:  # two rings of two ranks side by side, each in its own group
            pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
            _check_exact(rank % 2, 2, device, causal=True, n=6, window=(5, -1), group=pairs[rank // 2])
        if world == 2:
            _check_errors_and_helpers(rank, world, device)
            for dtype, causal in ((torch.float32, True), (torch.bfloat16, True), (torch.bfloat16, False)):
                _check_accuracy(rank, world, device, dtype, causal)
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("world", [2, 4])
def test_ring_matches_whole_sequence(device, world):
    if device == "cuda" and torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs (NCCL gives each rank its own)")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_worker, args=(world, _free_port(), device), nprocs=world, join=True)


def test_needs_initialised_group(device):
    q = torch.randn(1, 4, 2, 8, device=device)
    with pytest.raises(RuntimeError, match="process group is not initialised"):
        fd.ring_attention(q, q, q)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_block_plan_covers_the_global_mask(layout):
    """Every (query, key) pair of the sequence is computed by exactly one op call, with the op's
    bottom-right masks and ALiBi distances matching the global ones."""
    def op_mask(lq, lk, causal, left, right):
        i, j, off = torch.arange(lq)[:, None], torch.arange(lk)[None], lk - lq
        m = torch.ones(lq, lk, dtype=torch.bool)
        if left >= 0:
            m &= j >= i + off - left
        if right >= 0 or causal == CAUSAL_BOTTOM_RIGHT:
            m &= j <= i + off + max(right, 0)
        return m

    for world, n, causal, window in itertools.product((1, 3, 4), (4, 6), (False, True),
                                                      ((-1, -1), (0, 0), (3, 2), (5, -1), (2, 11))):
        for rank, src, alibi in itertools.product(range(world), range(world), (False, True)):
            qc, kc = shard_chunks(rank, world, n, layout), shard_chunks(src, world, n, layout)
            gq, gk = (torch.cat([torch.arange(c.start, c.start + c.length) for c in ch]) for ch in (qc, kc))
            dist_ = gq[:, None] - gk[None]
            want = torch.ones(n, n, dtype=torch.bool)
            if window[0] >= 0:
                want &= dist_ <= window[0]
            if causal or window[1] >= 0:
                want &= -dist_ <= (0 if causal else window[1])
            count = torch.zeros(n, n, dtype=torch.int64)
            alibi_dist = torch.full((n, n), -1)
            for c in block_calls(qc, kc, causal, *window, alibi):
                lq, lk = c.q_end - c.q_start, c.k_end - c.k_start
                m = op_mask(lq, lk, c.causal, c.window_left, c.window_right)
                count[c.q_start:c.q_end, c.k_start:c.k_end] += m
                if alibi:
                    if c.diagonal:
                        d = (torch.arange(lq)[:, None] - torch.arange(lk)[None] + lk - lq).abs()
                    else:
                        (kf, ks), (qf, qs) = alibi_terms(c)
                        d = (qf + qs * torch.arange(lq))[:, None] + (kf + ks * torch.arange(lk))[None]
                    alibi_dist[c.q_start:c.q_end, c.k_start:c.k_end] = torch.where(m, d, -1)
            where = f"world {world}, n {n}, causal {causal}, window {window}, rank {rank}, keys of {src}"
            assert count.max() <= 1, f"a pair computed twice: {where}"
            assert torch.equal(count.bool(), want), f"mask differs: {where}"
            if alibi:
                assert torch.equal(alibi_dist[want], dist_.abs()[want]), f"ALiBi distances differ: {where}"


def test_zigzag_plan_is_one_call_per_step():
    """Causal zigzag without window: one causal call on the diagonal, one unmasked c x 2c call
    elsewhere (the load balance the layout is for)."""
    world, n = 4, 6
    for rank, src in itertools.product(range(world), range(world)):
        calls = block_calls(shard_chunks(rank, world, n, "zigzag"), shard_chunks(src, world, n, "zigzag"), True,
                            -1, -1, False)
        assert len(calls) == 1
        c = calls[0]
        assert (c.q_end - c.q_start) * (c.k_end - c.k_start) == (n * n if src == rank else n * n // 2)
        assert c.unmasked == (src != rank)


def test_ring_stops_after_the_last_step_any_rank_needs():
    world, n = 4, 6
    assert ring_steps(world, n, "zigzag", True, -1, -1) == world
    assert ring_steps(world, n, "contiguous", False, -1, -1) == world
    assert ring_steps(world, n, "contiguous", True, 6, -1) == 2  # the previous shard only
    assert ring_steps(world, n, "contiguous", True, 7, -1) == 3  # a shard's first query reaches two shards back
    assert ring_steps(world, n, "contiguous", True, 0, -1) == 1
    assert ring_steps(world, n, "contiguous", False, 2, 1) == world  # the next shard: the ring's last step
    for steps, left in ((2, 6), (3, 7)):
        last = [max(t for t in range(world) if block_calls(shard_chunks(rank, world, n, "contiguous"),
                                                          shard_chunks((rank - t) % world, world, n, "contiguous"),
                                                          True, left, -1, False))
                for rank in range(world)]
        assert max(last) == steps - 1

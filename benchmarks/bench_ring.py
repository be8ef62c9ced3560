"""Ring attention (flashattn_ext.distributed.ring_attention) on 1 / 2 / 4 GPUs of one host with
NCCL: time of one forward + backward per length, causal (zigzag shards) and not, bf16, E = 128,
beside one GPU running flash_attn_func on the whole sequence (where it fits) and torch's own
context parallelism (torch.distributed.tensor.experimental.context_parallel) with its cuDNN and
flash SDPA backends -- and with SDPA's flash backend routed to our kernels where this build has
that hook (flashattn_ext.sdpa). Per row: median ms over ranks' worst, TFLOP/s of the
whole sequence, speedup and scaling efficiency against one GPU, peak memory per GPU, and how
much of the ring's time the attention alone takes (the same calls with the transfers replaced
by no-ops: 1.0 = communication fully hidden). JSON on stdout or --out.

    python benchmarks/bench_ring.py                      # 1, 2 and 4 GPUs (those present)
    python benchmarks/bench_ring.py --worlds 2 --lengths 262144,1048576 --heads 32
    python benchmarks/bench_ring.py --quick              # CPU, gloo, tiny sizes (checks the script)
    python benchmarks/bench_ring.py --worlds 2 --lengths 262144 --trace-dir traces   # + profiler traces
"""
import argparse
import datetime
import json
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import flashattn_ext
from flashattn_ext import _measure as M
from flashattn_ext import distributed as fd

DTYPE = torch.bfloat16


def _inputs(shape, device, seed):
    gen = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(DTYPE) for _ in range(4)]


def _worst_over_ranks(value, device):
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _measure(run, device, args):
    """(median ms, peak bytes allocated on this GPU or None on CPU), the worst over ranks."""
    dist.barrier()
    ms = M.median_ms(run, device, warmup=args.warmup, repeats=args.repeats)
    peak = None
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        run()
        torch.cuda.synchronize()
        peak = _worst_over_ranks(torch.cuda.max_memory_allocated(), device)
    return _worst_over_ranks(ms, device), peak


class _NoTransfer:
    """Stands in for a ring transfer: the tensors 'received' are those sent (the data stays local)."""

    def __init__(self, tensors):
        self.tensors = list(tensors)

    def wait(self):
        return self.tensors


def _ring_rows(args, rank, world, device, length, causal):
    n = length // world
    q, k, v, dout = _inputs((args.batch, n, args.heads, args.head_dim), device, seed=rank)
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def run():
        return torch.autograd.grad(fd.ring_attention(q, k, v, causal=causal), (q, k, v), dout)

    ms, peak = _measure(run, device, args)
    rows = [dict(impl="ring", ms=ms, peak_bytes=peak)]
    if args.ring_only:
        return rows
    start = fd._Ring.start
    fd._Ring.start = lambda ring, tensors, first_tag=0, hops=1: _NoTransfer(tensors)  # the same calls and merges, no communication
    try:
        compute_ms, _ = _measure(run, device, args)
    finally:
        fd._Ring.start = start
    rows[0]["attention_only_ms"] = compute_ms
    rows[0]["hidden_fraction"] = compute_ms / ms
    if args.trace_dir:
        _trace(run, device, os.path.join(args.trace_dir, f"ring_w{world}_L{length}_{'causal' if causal else 'full'}"
                                                         f"_rank{rank}.json"))
    return rows + _context_parallel_rows(args, world, device, length, causal)


def _trace(run, device, path):
    """A chrome trace of one call (kernels and transfers on their streams: the overlap to see)."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    dist.barrier()
    with profile(activities=activities) as prof:
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    prof.export_chrome_trace(path)


_mesh = None


def _context_parallel_rows(args, world, device, length, causal):
    """torch's context_parallel on (B, H, L, E) buffers it shards itself (head-tail balanced when
    causal); its ring calls SDPA's fused CUDA ops, so there is nothing to run on the CPU."""
    if device.type != "cuda":
        return []
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import _cp_options
    from torch.nn.attention import SDPBackend, sdpa_kernel
    global _mesh
    if _mesh is None:  # one per process: a mesh may create process groups
        _mesh = init_device_mesh("cuda", (world,))
    variants = [("torch-cp-cudnn", SDPBackend.CUDNN_ATTENTION, False), ("torch-cp-flash", SDPBackend.FLASH_ATTENTION,
                                                                       False)]
    try:
        import flashattn_ext.sdpa  # noqa: F401  (the SDPA integration registers "flashattn_ext" with torch)
    except ImportError:
        pass
    if "flashattn_ext" in getattr(torch.nn.attention, "list_flash_attention_impls", list)():
        variants.append(("torch-cp-flash=ours", SDPBackend.FLASH_ATTENTION, True))
    rows = []
    for name, backend, ours in variants:
        q, k, v, dout = _inputs((args.batch, args.heads, length, args.head_dim), device, seed=0)
        # Its head-tail balancing (our zigzag) is on by default and refuses non-causal attention.
        balanced, _cp_options.enable_load_balance = _cp_options.enable_load_balance, causal
        try:
            if ours:
                torch.nn.attention.activate_flash_attention_impl("flashattn_ext")
            with context_parallel(_mesh, buffers=[q, k, v, dout], buffer_seq_dims=[2, 2, 2, 2],
                                  no_restore_buffers={q, k, v, dout}), sdpa_kernel(backend):
                q.requires_grad_(), k.requires_grad_(), v.requires_grad_()

                def run():
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                    return torch.autograd.grad(out, (q, k, v), dout)

                ms, peak = _measure(run, device, args)
            rows.append(dict(impl=name, ms=ms, peak_bytes=peak))
        except Exception as e:  # a backend that does not run here is reported, not fatal
            rows.append(dict(impl=name, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"))
        finally:
            _cp_options.enable_load_balance = balanced
            if ours:
                torch.nn.attention.restore_flash_attention_impl()
        del q, k, v, dout
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _single_rows(args, device, length, causal):
    shape = (args.batch, length, args.heads, args.head_dim)
    try:
        q, k, v, dout = _inputs(shape, device, seed=0)
        q, k, v = (t.requires_grad_() for t in (q, k, v))

        def run():
            return torch.autograd.grad(flashattn_ext.flash_attn_func(q, k, v, causal=causal), (q, k, v), dout)

        ms, peak = _measure(run, device, args)
        return [dict(impl="one-gpu", ms=ms, peak_bytes=peak)]
    except torch.OutOfMemoryError:
        return [dict(impl="one-gpu", error="out of memory")]


def _worker(rank, world, port, args, out_path):
    torch.set_num_threads(max(1, torch.get_num_threads() // world))
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # A rank that fails alone leaves the others waiting in a collective: the timeout ends the run instead.
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world, device_id=device if device.type == "cuda" else None,
                            timeout=datetime.timedelta(seconds=args.timeout))
    rows = []
    try:
        for length in args.lengths:
            for causal in args.causal:
                if world == 1 and length > args.single_max:
                    continue
                case = _single_rows(args, device, length, causal) if world == 1 else \
                    _ring_rows(args, rank, world, device, length, causal)
                for row in case:
                    row.update(world=world, seq_len=length, causal=causal)
                    if "ms" in row:
                        flops = M.attention_flops(args.batch, args.heads, length, length, args.head_dim, causal,
                                                  "fwd_bwd")
                        row["tflops"] = M.tflops(flops, row["ms"])
                    rows.append(row)
                    if rank == 0:
                        print(json.dumps(row), file=sys.stderr, flush=True)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _add_scaling(rows):
    """speedup and efficiency of each multi-GPU row against one GPU at the same length and mask."""
    single = {(r["seq_len"], r["causal"]): r["ms"] for r in rows if r["impl"] == "one-gpu" and "ms" in r}
    for r in rows:
        base = single.get((r["seq_len"], r["causal"]))
        if r["world"] > 1 and "ms" in r and base:
            r["speedup_vs_one_gpu"] = base / r["ms"]
            r["scaling_efficiency"] = base / r["ms"] / r["world"]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", default=None, help="comma-separated process counts (default: 1,2,4 up to the GPUs)")
    p.add_argument("--lengths", default=None, help="comma-separated (default 64k ... 1M; --quick: 256,512)")
    p.add_argument("--single-max", type=int, default=262144, help="longest sequence timed on one GPU")
    p.add_argument("--causal", default="1,0", help="1 = causal (zigzag shards), 0 = not; comma-separated")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ring-only", action="store_true",
                   help="time the ring alone (no communication-free rerun, no torch context_parallel rows)")
    p.add_argument("--trace-dir", default=None, help="write a profiler trace of one ring call per rank and case here")
    p.add_argument("--timeout", type=int, default=300, help="seconds a rank waits in one collective")
    p.add_argument("--quick", action="store_true", help="CPU with gloo, worlds 1,2,4, tiny sizes")
    p.add_argument("--out", default=None, help="JSON file (default: stdout)")
    args = p.parse_args()
    if args.quick:
        args.device, args.lengths, args.single_max = "cpu", args.lengths or "256,512", 512
        args.heads, args.head_dim, args.repeats = 2, 32, 2
        args.worlds = args.worlds or "1,2,4"
    else:
        args.device, args.lengths = "cuda", args.lengths or "65536,131072,262144,524288,1048576"
        if not torch.cuda.is_available():
            p.error("no GPU: use --quick to run on the CPU")
        gpus = torch.cuda.device_count()
        args.worlds = args.worlds or ",".join(str(w) for w in (1, 2, 4) if w <= gpus)
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.causal = [bool(int(x)) for x in args.causal.split(",")]
    worlds = [int(x) for x in args.worlds.split(",")]
    for w in worlds:
        bad = [n for n in args.lengths if n % (2 * w)]
        if bad:
            p.error(f"lengths {bad} are not multiples of 2 * {w} (zigzag shards of {w} ranks)")
    rows = []
    tmp = f"/tmp/bench_ring_{os.getpid()}.json"
    for world in worlds:
        mp.spawn(_worker, args=(world, _free_port(), args, tmp), nprocs=world, join=True)
        with open(tmp) as f:
            rows += json.load(f)
    os.remove(tmp)
    _add_scaling(rows)
    result = dict(device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu", dtype="bf16",
                  batch=args.batch, heads=args.heads, head_dim=args.head_dim, torch=torch.__version__, rows=rows)
    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    main()

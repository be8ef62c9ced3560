"""Host overhead per call: microseconds per attention call on a tiny shape (default B = H = 1,
L = 16, E = 64), where the kernel takes a few microseconds and the time is what the host spends
in Python, the dispatcher and autograd before the launch. A call whose kernel is shorter than
this overhead (inference at small batch; bf16 L = 1024 causal on an H200 is ~40 us) measures the
host, not the GPU.

Rows: forward with autograd recording (inputs require grad), forward under torch.no_grad()
(inference), forward + backward. Columns: flashattn_ext.scaled_dot_product_attention, the op
torch.ops.flashattn.fwd through its torch.library autograd registration (what the functions took
before ops._FwdWithGrad), and torch's SDPA (default backend choice).

    python benchmarks/bench_overhead.py [--device cuda] [--out-dir DIR]
"""
import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

import flashattn_ext


def batch_us(fn, device, calls):
    """µs per call of fn over one batch of `calls` calls (the device synchronized at the end)."""
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def interleaved_us(fns, device, calls, rounds, warmup=50):
    """{name: (best, median)} µs per call of each fn in `fns`: `rounds` rounds, each a batch of every fn in an order
    rotated per round, so that a slow spell of the host (a busy core, a frequency change) falls on every fn alike."""
    names = list(fns)
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(batch_us(fns[name], device, calls))
    return {name: (min(t), statistics.median(t)) for name, t in times.items()}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32", "fp64"))
    p.add_argument("--shape", default="1,1,16,64", help="B,H,L,E")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--out-dir")
    args = p.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}[args.dtype]
    if args.device == "cpu" and dtype in (torch.bfloat16, torch.float16):
        dtype = torch.float32  # the CPU half kernels are slow enough to hide the overhead
    b, h, length, e = (int(x) for x in args.shape.split(","))
    q, k, v = (torch.randn(b, h, length, e, device=args.device, dtype=dtype, requires_grad=True) for _ in range(3))
    scale = e ** -0.5
    impls = {
        "ours": lambda: flashattn_ext.scaled_dot_product_attention(q, k, v, is_causal=True),
        "ours-op": lambda: torch.ops.flashattn.fwd(q, k, v, scale, 1)[0],
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    }

    def no_grad(fn):
        def run():
            with torch.no_grad():
                return fn()
        return run

    def fwd_bwd(fn):
        return lambda: fn().sum().backward()

    passes = {"fwd": lambda fn: fn, "fwd no_grad": no_grad, "fwd+bwd": fwd_bwd}
    table = {name: interleaved_us({impl: wrap(fn) for impl, fn in impls.items()}, args.device, args.calls, args.rounds)
             for name, wrap in passes.items()}
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"{device_name}, torch {torch.__version__}, {dtype}, shape {args.shape}: us per call, best (median) of "
          f"{args.rounds} interleaved rounds of {args.calls} calls")
    print(f"{'pass':12s}" + "".join(f"{impl:>16s}" for impl in impls) + "   ours/sdpa best (median)")
    for name, row in table.items():
        cells = "".join(f"{row[impl][0]:8.1f} ({row[impl][1]:5.1f})" for impl in impls)
        print(f"{name:12s}{cells}   {row['ours'][0] / row['sdpa'][0]:9.2f} ({row['ours'][1] / row['sdpa'][1]:4.2f})")
    if args.out_dir:
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "overhead.json"), "w") as f:
            json.dump({"device": device_name, "torch": torch.__version__, "dtype": str(dtype), "shape": args.shape,
                       "rounds": args.rounds, "calls": args.calls,
                       "us_per_call": {name: {impl: {"best": b, "median": m} for impl, (b, m) in row.items()}
                                       for name, row in table.items()}}, f, indent=1)


if __name__ == "__main__":
    main()

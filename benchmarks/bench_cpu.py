"""CPU benchmark: flashattn_ext beside torch's CPU SDPA, in one run.

Shape: B=1, H=8 (B·H = 8 attention heads), E in {64, 128}, L in {512 ... 8192}, self-attention,
causal and not, fp32 and bf16. Per row: forward and forward+backward time (median after
warm-up; fewer repeats for long rows, see --budget), TFLOP/s (DESIGN.md §5: forward
4·B·H·L²·E, halved when causal; fwd+bwd 3.5× that), time ratio ours/sdpa (< 1: ours is faster)
and peak extra memory of one forward+backward (fresh-process RSS peak, inputs excluded).

    python benchmarks/bench_cpu.py                 # full grid, about 10 minutes on 2 cores
    python benchmarks/bench_cpu.py --quick         # fp32, E=64, L <= 2048
    python benchmarks/bench_cpu.py --dtype bf16 --head-dim 128 --max-len 4096
"""
import argparse
import datetime
import itertools
import json
import os
import platform
import sys
import time

import torch

from flashattn_ext import _measure as M

IMPLS = ("ours", "sdpa")
LENGTHS = (512, 1024, 2048, 4096, 8192)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fp32, E=64, L in 512..2048 (under a minute)")
    p.add_argument("--dtype", default="fp32,bf16", help="comma list of fp32, bf16, fp16, fp64")
    p.add_argument("--head-dim", default="64,128", help="comma list of head dims")
    p.add_argument("--max-len", type=int, default=max(LENGTHS))
    p.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--repeats", type=int, default=10, help="most timed repeats per measurement")
    p.add_argument("--budget", type=float, default=1.5,
                   help="seconds of timed repeats per measurement; long rows get fewer repeats (at least 2)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "cpu.json"))
    args = p.parse_args(argv)
    if args.quick:
        args.dtype, args.head_dim, args.max_len = "fp32", "64", 2048
    args.dtypes = args.dtype.split(",")
    args.head_dims = [int(x) for x in args.head_dim.split(",")]
    args.causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    args.lengths = [n for n in LENGTHS if n <= args.max_len]
    return args


def time_row(args, dtype, length, head_dim, causal):
    shape = (args.batch, args.heads, length, head_dim)
    q, k, v, dout = M.make_inputs(*shape, M.DTYPES[dtype], "cpu")
    row = {"dtype": dtype, "batch": args.batch, "heads": args.heads, "len": length, "head_dim": head_dim,
           "causal": causal}
    for impl in IMPLS:
        attn = M.get_attention(impl)
        fwd = M.median_ms(lambda: attn(q, k, v, causal), "cpu", warmup=1, repeats=args.repeats, budget_s=args.budget)
        both = M.median_ms(M.fwd_bwd_fn(attn, q, k, v, dout, causal), "cpu", warmup=1, repeats=args.repeats,
                           budget_s=args.budget)
        row[impl] = {"fwd_ms": fwd, "fwd_bwd_ms": both,
                     "fwd_tflops": M.tflops(M.attention_flops(*shape[:3], length, head_dim, causal, "fwd"), fwd),
                     "fwd_bwd_tflops": M.tflops(M.attention_flops(*shape[:3], length, head_dim, causal, "fwd_bwd"),
                                                both)}
    row["ratio_fwd"] = row["ours"]["fwd_ms"] / row["sdpa"]["fwd_ms"]
    row["ratio_fwd_bwd"] = row["ours"]["fwd_bwd_ms"] / row["sdpa"]["fwd_bwd_ms"]
    return row


def add_memory(rows):
    """One fresh process measures every (row, impl)."""
    cases = [(impl, r["dtype"], (r["batch"], r["heads"], r["len"], r["head_dim"]), r["causal"])
             for r in rows for impl in IMPLS]
    results = iter(M.cpu_peak_extra_bytes(cases))
    for r in rows:
        for impl in IMPLS:
            res = next(results)
            r[impl]["peak_extra_mib"] = res["bytes"] / 2**20
            r[impl]["peak_exact"] = res["exact"]


HEADER = (f"{'dtype':5s} {'E':>4s} {'L':>5s} {'causal':6s} | {'fwd TFLOP/s':>13s} {'fwd+bwd TFLOP/s':>15s} | "
          f"{'time ours/sdpa':>14s} | {'peak extra MiB':>15s}")
SUBHEADER = (f"{'':23s} | {'ours':>6s} {'sdpa':>6s} {'ours':>7s} {'sdpa':>7s} | {'fwd':>6s} {'f+b':>7s} | "
             f"{'ours':>7s} {'sdpa':>7s}")


def format_row(r):
    o, s = r["ours"], r["sdpa"]
    mem = (f"{o['peak_extra_mib']:7.1f} {s['peak_extra_mib']:7.1f}" if "peak_extra_mib" in o else f"{'-':>7s} {'-':>7s}")
    return (f"{r['dtype']:5s} {r['head_dim']:4d} {r['len']:5d} {str(r['causal']):6s} | "
            f"{o['fwd_tflops']:6.3f} {s['fwd_tflops']:6.3f} {o['fwd_bwd_tflops']:7.3f} {s['fwd_bwd_tflops']:7.3f} | "
            f"{r['ratio_fwd']:6.2f} {r['ratio_fwd_bwd']:7.2f} | {mem}")


def main(argv=None):
    args = parse_args(argv)
    start = time.perf_counter()
    print(f"flashattn_ext vs torch SDPA on CPU ({torch.get_num_threads()} threads, torch {torch.__version__}), "
          f"B={args.batch} H={args.heads}")
    print(HEADER + "\n" + SUBHEADER, flush=True)
    rows = []
    for dtype, head_dim, causal, length in itertools.product(args.dtypes, args.head_dims, args.causals, args.lengths):
        rows.append(time_row(args, dtype, length, head_dim, causal))
        print(format_row(rows[-1]), flush=True)
    if not args.no_memory:
        print("measuring peak memory in a fresh process ...", flush=True)
        add_memory(rows)
        print(HEADER + "\n" + SUBHEADER + "\n" + "\n".join(format_row(r) for r in rows))
    elapsed = time.perf_counter() - start
    print(f"{len(rows)} rows in {elapsed:.0f} s; time ratio < 1 means ours is faster")
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
            "python": sys.version.split()[0], "flops": "fwd 4*B*H*L*L*E (x0.5 causal), fwd+bwd 3.5x fwd",
            "elapsed_s": elapsed}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

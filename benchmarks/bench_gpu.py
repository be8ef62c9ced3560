"""GPU benchmark: flashattn_ext beside torch SDPA's flash, cuDNN, efficient and math backends, in one run.

Grid (DESIGN.md §5, the FlashAttention papers' grid): B·L = 16384 tokens, H·E = 2048,
E in {64, 128, 256}, L in {512 ... 16384}, causal and not, self-attention. Forward and backward
are timed separately, with CUDA events, warm-up (--warmup calls and at least 0.2 s) and the median
of --repeats: the forward alone,
and the backward alone replayed on a retained graph of one forward (torch.autograd.grad with
retain_graph=True; gradients are returned, not accumulated). TFLOP/s: forward 4·B·H·L²·E
(halved when causal), backward 2.5× forward. Peak extra memory: one forward+backward,
torch.cuda.max_memory_allocated above the inputs. A backend that cannot run a row is skipped
and the reason recorded; the math backend is skipped where its score matrix (B·H·L² in at
least fp32) passes --math-max-gb.

    python benchmarks/bench_gpu.py --dtypes bf16             # the standard grid
    python benchmarks/bench_gpu.py --quick                   # a few rows
    python benchmarks/bench_gpu.py --memory-check            # fp16 L=32768 peak memory vs SDPA-flash
    python benchmarks/bench_gpu.py --device cpu --quick      # smoke test of the code paths, no GPU
    python benchmarks/bench_gpu.py --replot results.txt      # plots from a printed table
"""
import argparse
import datetime
import itertools
import json
import os
import sys
import warnings

import torch

from flashattn_ext import _measure as M

IMPLS = ("ours", "ours-det", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "sdpa-math")  # ours-det: deterministic=True
LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)
PASSES = ("fwd", "bwd")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", default=os.environ.get("OUT") or os.path.join(os.path.dirname(
        os.path.abspath(__file__)), "results"))
    p.add_argument("--dtypes", default="bf16", help="comma list of bf16, fp16, fp32, fp64")
    p.add_argument("--head-dims", default="64,128,256")
    p.add_argument("--lens", default=",".join(map(str, LENGTHS)), help="comma list of sequence lengths")
    p.add_argument("--max-len", type=int, default=max(LENGTHS))
    p.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    p.add_argument("--tokens", type=int, help="B·L of every row (default 16384; 1024 with --device cpu)")
    p.add_argument("--hidden", type=int, help="H·E of every row (default 2048; 128 with --device cpu)")
    p.add_argument("--impls", default=",".join(i for i in IMPLS if i != "ours-det"))
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--math-max-gb", type=float, default=8.0, help="skip sdpa-math when B·H·L²·4 bytes pass this")
    p.add_argument("--quick", action="store_true", help="bf16-only, E=128, L in {1024, 4096}")
    p.add_argument("--memory-check", action="store_true",
                   help="only: fp16 B=1 H=16 L=32768 E=128 fwd+bwd peak memory (and time), ours vs sdpa-flash")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--device", default="cuda", help="'cpu' runs the same code paths on CPU (debug only)")
    args = p.parse_args(argv)
    debug = args.device == "cpu"
    args.tokens = args.tokens or (1024 if debug else 16384)
    args.hidden = args.hidden or (128 if debug else 2048)
    if args.quick:
        args.head_dims, args.lens = "128", "1024,4096"
        args.repeats, args.warmup = min(args.repeats, 10), min(args.warmup, 3)
    args.dtypes = args.dtypes.split(",")
    args.head_dims = [int(x) for x in args.head_dims.split(",")]
    args.lens = [n for n in (int(x) for x in args.lens.split(",")) if n <= args.max_len]
    args.causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    args.impls = args.impls.split(",")
    unknown = set(args.impls) - set(IMPLS)
    if unknown:
        p.error(f"unknown impls {sorted(unknown)}; choose from {IMPLS}")
    return args


def set_precision(device):
    """Strict fp32 on both sides: no TF32 in matmuls or cuDNN."""
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def why_not(impl, shape, dtype, args):
    """A reason to skip (impl, row) before trying it, or None."""
    b, h, length, _ = shape
    if impl == "sdpa-math":
        gb = b * h * length * length * max(dtype.itemsize, 4) / 1e9
        if gb > args.math_max_gb:
            return f"score matrix {gb:.3g} GB > --math-max-gb {args.math_max_gb:g}"
    return None


def first_line(text):
    return text.strip().splitlines()[0] if text.strip() else ""


def try_first_call(attn, inputs, causal):
    """Run fwd+bwd once. Returns None, or why it failed (error plus SDPA's warnings, which name
    the constraint a forced backend does not meet)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            M.fwd_bwd_fn(attn, *inputs, causal)()
            return None
        except (RuntimeError, NotImplementedError, ValueError, torch.cuda.OutOfMemoryError) as e:
            notes = "; ".join(first_line(str(w.message)) for w in caught)
            return first_line(str(e)) + (f" ({notes})" if notes else "")


def measure(impl, inputs, shape, dtype, causal, args):
    """Timings and memory of one impl on one row (`inputs`: the row's q, k, v, dout, which every impl
    reads and none changes), or {'skipped': reason}."""
    reason = why_not(impl, shape, dtype, args)
    if reason:
        return {"skipped": reason}
    device = args.device
    if device == "cuda":
        torch.cuda.empty_cache()
    attn = M.get_attention(impl)
    try:
        reason = try_first_call(attn, inputs, causal)
        if reason:
            return {"skipped": reason}
        q, k, v, dout = inputs
        warmup_s = 0.2 if device == "cuda" else 0.0
        fwd = M.median_ms(lambda: attn(q, k, v, causal), device, args.warmup, args.repeats, warmup_s=warmup_s)
        bwd = M.median_ms(M.bwd_only_fn(attn, *inputs, causal), device, args.warmup, args.repeats,
                          warmup_s=warmup_s)
        if device == "cuda":
            peak = M.cuda_peak_extra_bytes(M.fwd_bwd_fn(attn, *inputs, causal))
        else:  # debug path: fresh-process RSS peak
            peak = M.cpu_peak_extra_bytes([(impl, M.DTYPE_NAMES[dtype], shape, causal)])[0]["bytes"]
    except torch.cuda.OutOfMemoryError as e:
        return {"skipped": "out of memory: " + first_line(str(e))}
    flops = {ps: M.attention_flops(*shape[:3], shape[2], shape[3], causal, ps) for ps in PASSES}
    return {"fwd_ms": fwd, "bwd_ms": bwd, "fwd_tflops": M.tflops(flops["fwd"], fwd),
            "bwd_tflops": M.tflops(flops["bwd"], bwd), "peak_extra_mib": peak / 2**20}


def summarize(row, impls):
    """Best SDPA backend per pass and ours' speed over it (> 1: ours is faster)."""
    for ps in PASSES:
        key = f"{ps}_tflops"
        sdpa = [(row[i][key], i) for i in impls if i.startswith("sdpa") and key in row[i]]
        best = max(sdpa) if sdpa else (None, None)
        row[f"best_sdpa_{ps}"] = best[1]
        ours = row.get("ours", {}).get(key)
        row[f"speedup_{ps}"] = ours / best[0] if ours and best[0] else None


def fmt(x, width, spec):
    return f"{x:{width}{spec}}" if isinstance(x, (int, float)) else f"{'-':>{width}s}"


def print_header(impls):
    names = " ".join(f"{i.replace('sdpa-', ''):>9s}" for i in impls)
    print(f"{'dtype':5s} {'E':>3s} {'L':>5s} {'B':>3s} {'H':>3s} {'causal':6s} {'pass':4s} | TFLOP/s {names} | "
          f"ours/best (best SDPA)")


def print_row(row, impls):
    for ps in PASSES:
        vals = " ".join(fmt(row[i].get(f"{ps}_tflops"), 9, ".4g") for i in impls)
        best = row[f"best_sdpa_{ps}"] or "-"
        print(f"{row['dtype']:5s} {row['head_dim']:3d} {row['len']:5d} {row['batch']:3d} {row['heads']:3d} "
              f"{str(row['causal']):6s} {ps:4s} | {'':7s} {vals} | {fmt(row[f'speedup_{ps}'], 6, '.2f')} ({best})")
    mem = " ".join(fmt(row[i].get("peak_extra_mib"), 9, ".0f") for i in impls)
    print(f"{'':31s}{'mem':4s} | {'MiB':7s} {mem} |", flush=True)


def run_grid(args):
    rows = []
    for bad in sorted({e for e in args.head_dims if args.hidden % e}):
        print(f"bench_gpu: head dim {bad} skipped: H·E = {args.hidden} is not a multiple of it "
              f"(pass --hidden, e.g. {bad * (args.hidden // bad)})")
    for bad in sorted({n for n in args.lens if args.tokens % n}):
        print(f"bench_gpu: length {bad} skipped: B·L = {args.tokens} is not a multiple of it (pass --tokens)")
    print_header(args.impls)
    for dtype_name, head_dim, causal, length in itertools.product(args.dtypes, args.head_dims, args.causals,
                                                                  args.lens):
        if args.tokens % length or args.hidden % head_dim:
            continue
        shape = (args.tokens // length, args.hidden // head_dim, length, head_dim)
        row = {"dtype": dtype_name, "batch": shape[0], "heads": shape[1], "len": length, "head_dim": head_dim,
               "causal": causal}
        # One set of inputs per row, shared by the impls (drawn on the CPU: 1.9 s for a row's four
        # 16384 x 2048 tensors on a 2-core machine); the backward returns its gradients rather than
        # accumulating them, so no impl changes the set.
        inputs = M.make_inputs(*shape, M.DTYPES[dtype_name], args.device)
        for impl in args.impls:
            row[impl] = measure(impl, inputs, shape, M.DTYPES[dtype_name], causal, args)
        del inputs
        summarize(row, args.impls)
        print_row(row, args.impls)
        rows.append(row)
    skipped = {(i, r[i]["skipped"]) for r in rows for i in args.impls if "skipped" in r[i]}
    for impl, reason in sorted(skipped):
        print(f"skipped {impl}: {reason}")
    return rows


def memory_check(args):
    """fp16 B=1 H=16 L=32768 E=128 (B=1 H=2 L=1024 with --device cpu): peak extra memory of one
    fwd+bwd, and times, ours vs SDPA-flash."""
    shape = (1, 16, 32768, 128) if args.device == "cuda" else (1, 2, 1024, 128)
    result = dict(zip(("batch", "heads", "len", "head_dim"), shape), dtype="fp16", causal=False)
    inputs = M.make_inputs(*shape, torch.float16, args.device)
    for impl in ("ours", "sdpa-flash"):
        result[impl] = measure(impl, inputs, shape, torch.float16, False, args)
    print("memory check fp16 B={} H={} L={} E={}, one fwd+bwd:".format(*shape))
    for impl in ("ours", "sdpa-flash"):
        r = result[impl]
        print(f"  {impl:10s} " + (f"peak extra {r['peak_extra_mib']:8.1f} MiB, fwd {r['fwd_ms']:.2f} ms, "
                                   f"bwd {r['bwd_ms']:.2f} ms" if "skipped" not in r else f"skipped: {r['skipped']}"))
    if "peak_extra_mib" in result["ours"] and "peak_extra_mib" in result["sdpa-flash"]:
        result["memory_ratio"] = result["ours"]["peak_extra_mib"] / result["sdpa-flash"]["peak_extra_mib"]
        print(f"  ours / sdpa-flash peak memory: {result['memory_ratio']:.2f}")
    return result


def plot(rows, impls, out_dir):
    """Grouped bars of TFLOP/s vs L, one PNG per (dtype, head dim, causal, pass), as the charts of
    FlashAttention's README."""
    plt = M.pyplot()
    if plt is None:
        return []
    paths = []
    groups = sorted({(r["dtype"], r["head_dim"], r["causal"]) for r in rows})
    for (dtype, head_dim, causal), ps in itertools.product(groups, PASSES):
        sel = sorted((r for r in rows if (r["dtype"], r["head_dim"], r["causal"]) == (dtype, head_dim, causal)),
                     key=lambda r: r["len"])
        present = [i for i in impls if any(f"{ps}_tflops" in r[i] for r in sel)]  # drop never-run impls
        fig, ax = plt.subplots(figsize=(max(6.0, 1.5 + 0.3 * len(present) * len(sel)), 4.5))
        width = 0.8 / max(1, len(present))
        for j, impl in enumerate(present):
            vals = [r[impl].get(f"{ps}_tflops", 0.0) for r in sel]
            xs = [i + (j - (len(present) - 1) / 2) * width for i in range(len(sel))]
            bars = ax.bar(xs, vals, width, label=impl)
            for bar, val in zip(bars, vals):
                if val:
                    ax.annotate(f"{val:.3g}", (bar.get_x() + bar.get_width() / 2, val), ha="center", va="bottom",
                                fontsize=7)
        ax.set_xticks(range(len(sel)), [f"{r['len'] // 1024}k" if r["len"] >= 1024 else str(r["len"]) for r in sel])
        ax.set_xlabel("Sequence length")
        ax.set_ylabel("Speed (TFLOP/s)")
        name = {"fwd": "Forward", "bwd": "Backward"}[ps]
        ax.set_title(f"{name} speed, {dtype}, head dim {head_dim}, {'causal' if causal else 'not causal'}",
                     fontsize=11)
        ax.margins(y=0.12)
        ax.legend(fontsize=8, loc="upper left")
        png = f"gpu_{dtype}_hdim{head_dim}_{'causal' if causal else 'full'}_{ps}.png"
        paths.append(M.save_plot(plt, fig, os.path.join(out_dir, png), 120))
    return paths


def rows_from_table(text):
    """Rows (TFLOP/s and peak memory per impl) back from the table run_grid prints, for
    re-plotting a run of which only the log came back."""
    rows, impls = [], None
    for line in text.splitlines():
        head, _, rest = line.partition("|")
        cells = head.split()
        if head.startswith("dtype"):
            impls = [n if n.startswith("ours") else "sdpa-" + n for n in rest.split("|")[0].split()[1:]]
        elif impls and len(cells) == 7 and cells[0] in M.DTYPES:
            dtype, e, length, b, h, causal, ps = cells
            if ps == "fwd":
                rows.append({"dtype": dtype, "batch": int(b), "heads": int(h), "len": int(length),
                             "head_dim": int(e), "causal": causal == "True", **{i: {} for i in impls}})
            for impl, val in zip(impls, rest.split("|")[0].split()):
                if val != "-":
                    rows[-1][impl][f"{ps}_tflops"] = float(val)
        elif impls and rows and cells == ["mem"]:
            for impl, val in zip(impls, rest.split("|")[0].split()[1:]):
                if val != "-":
                    rows[-1][impl]["peak_extra_mib"] = float(val)
    return rows, impls or list(IMPLS)


def main(argv=None):
    if argv is None and len(sys.argv) == 3 and sys.argv[1] == "--replot":
        # python benchmarks/bench_gpu.py --replot TABLE.txt: plots from a saved table, beside it.
        rows, impls = rows_from_table(open(sys.argv[2]).read())
        for path in plot(rows, impls, os.path.dirname(os.path.abspath(sys.argv[2]))):
            print("wrote", path)
        return
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device here; --device cpu runs the code paths on CPU for debugging")
    set_precision(args.device)
    os.makedirs(args.out_dir, exist_ok=True)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (debug)"
    print(f"{device_name}, torch {torch.__version__}, {args.repeats} repeats after {args.warmup} warm-up; "
          f"fwd timed alone, bwd timed alone on a retained graph")
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "torch": torch.__version__,
            "device": device_name, "cuda": torch.version.cuda, "repeats": args.repeats, "warmup": args.warmup,
            "flops": "fwd 4*B*H*L*L*E (x0.5 causal), bwd 2.5x fwd", "bwd_timing": "retained graph"}
    if args.memory_check:
        result = {"meta": meta, "memory_check": memory_check(args)}
        path = os.path.join(args.out_dir, "gpu_memory_check.json")
    else:
        rows = run_grid(args)
        result = {"meta": meta, "rows": rows}
        path = os.path.join(args.out_dir, "gpu.json")
        if not args.no_plots:
            pngs = plot(rows, args.impls, args.out_dir)
            if pngs:
                print(f"wrote {len(pngs)} plots to {args.out_dir}")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

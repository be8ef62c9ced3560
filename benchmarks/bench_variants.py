"""Forward (or backward) TFLOP/s of kernel variants chosen by environment variables
(FLASHATTN_CUDA_KERNELS=sm80 / wgmma, PYTHONPATH=another build, ...), each in its own process, in
interleaved rounds: variant A, B, C, then C, B, A, ... so that a slow stretch of the GPU (medians 20-80% low
now and then, docs/performance.md) hits one reading, not one variant, and a drift within a round (long rows
have read a few % low in the second of two processes) falls on each variant alike. Prints every round
and the mean over rounds per variant and row.

  python benchmarks/bench_variants.py --rows 128:512,64:1024 --rounds 3 \\
      --variant sm80 FLASHATTN_CUDA_KERNELS=sm80 --variant wgmma FLASHATTN_CUDA_KERNELS=wgmma --sdpa sdpa-flash

Rows are E:L, non-causal unless --causal (or with --float-bias a float attn_mask (1, H, L, L): the kernels' bias
variants), bf16 unless --dtype fp16 (or e4m3: the float8 forward), B·L = 16384
and H·E = 2048 as in bench_gpu.py; the forward, or with --pass bwd the backward alone on a retained graph of
one forward as bench_gpu.py times it (FLOPs 2.5x the forward's). With --pass decode rows are KIND:B:C[:E] (mha,
gqa or mqa as in bench_decode.py: H = 32, E = 128 unless given, one query row against C cached keys) and the reading
is µs per read-only flash_attn_with_kvcache step, 16 of them captured in one CUDA graph and replayed (bench_decode.py's
ours-read-graph; --append: its ours-graph, the step appending one new row to the dense cache; --paged: the
same on pages of 256 keys or --page-size (its ours-paged-read-graph, or with --append ours-paged-graph);
--rotary: its ours-rotary-graph, the dense step appending one row with rotary tables, causal;
--sdpa: that SDPA backend on the same shape, the same way). One process times its rows with 40 calls per median
after at least 0.3 s of warm-up (--repeats, --warmup-s); a process that fails or runs past --child-timeout seconds (a kernel
that hangs) leaves its round's readings empty, and its variant runs in no later round."""
import argparse
import json
import os
import statistics
import subprocess
import sys


def child(args):
    import torch
    import torch.nn.functional as F

    # The flash variant's process names no tree of its own: this script's one, after any PYTHONPATH.
    sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import flashattn_ext
    from flashattn_ext import _measure as M
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "e4m3": torch.bfloat16}[args.dtype]

    bias = None  # (--float-bias: a (1, H, L, L) bias of the row's shape, made with its inputs)

    def attn(q, k, v, causal):
        extra = {"attn_mask": bias} if bias is not None else {"is_causal": causal}
        if args.impl != "ours":
            with torch.nn.attention.sdpa_kernel(getattr(torch.nn.attention.SDPBackend, M.SDPA_BACKENDS[args.impl])):
                return F.scaled_dot_product_attention(q, k, v, **extra)
        return flashattn_ext.scaled_dot_product_attention(q, k, v, **extra)

    out = []
    if args.pass_ == "decode":
        import bench_decode as D
        for row in args.rows.split(","):
            kind, b, cache, *rest = row.split(":")
            heads, dim = 32, int(rest[0]) if rest else 128
            if args.device == "cpu":  # a debug run of the script's own code: tiny shapes
                heads, dim, cache = 4, 16, min(int(cache), 256)
            group = D.KINDS[kind]
            t = D.make_row(int(b), int(cache), heads, heads // group if group else 1, dim, 1, args.page_size, dtype,
                           args.device)
            ours = ("ours-paged" if args.paged else "ours") + ("" if args.append else "-read")
            ours = "ours-rotary" if args.rotary else ours
            impl = (args.impl if args.impl != "ours" else ours) + ("-graph" if args.device == "cuda" else "")
            ms = M.per_call_ms(D.step_fn(impl, t, graph_steps=16), args.device, warmup=3, repeats=args.repeats,
                               warmup_s=args.warmup_s)
            out.append(f"{ms * 1e3:.2f}")
        print(" ".join(out))
        return
    for row in args.rows.split(","):
        e, length = map(int, row.split(":"))
        b, h = 16384 // length, 2048 // e
        if args.device == "cpu":  # a debug run of the script's own code: tiny shapes
            b, h, length = 1, 2, min(length, 128)
        q, k, v, dout = M.make_inputs(b, h, length, e, dtype, args.device)
        if args.float_bias:
            bias = torch.randn(1, h, length, length, device=args.device, dtype=dtype)
        if args.dtype == "e4m3":
            fn = M.float8_call(q, k, v, args.causal)
        elif args.pass_ == "bwd":
            fn = M.bwd_only_fn(attn, q, k, v, dout, args.causal)
        else:
            fn = lambda: attn(q, k, v, args.causal)  # noqa: E731
        ms = M.median_ms(fn, args.device, warmup=3, repeats=args.repeats, warmup_s=args.warmup_s)
        flops = M.attention_flops(b, h, length, length, e, args.causal, args.pass_)
        out.append(f"{flops / ms / 1e9:.1f}")
    print(" ".join(out))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", required=True, help="comma list of E:L (--pass decode: KIND:B:C or KIND:B:C:E)")
    p.add_argument("--variant", nargs="+", action="append", default=[], metavar=("NAME", "ENV=VALUE"),
                   help="a name and the environment variables that select it (repeatable)")
    # (_measure.SDPA_BACKENDS' keys but its math one, named here: this process does not import torch)
    p.add_argument("--sdpa", choices=("sdpa-flash", "sdpa-cudnn", "sdpa-efficient"),
                   help="that SDPA backend as one more variant")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--dtype", choices=("bf16", "fp16", "e4m3"), default="bf16",
                   help="e4m3: flash_attn_func's float8 forward (per-(batch, head) descales) on bf16 inputs quantized")
    p.add_argument("--pass", dest="pass_", choices=("fwd", "bwd", "decode"), default="fwd")
    p.add_argument("--page-size", type=int, default=256,
                   help="--paged: keys per page (not a multiple of 64: the decode kernel's row-by-row copy)")
    p.add_argument("--paged", action="store_true",
                   help="--pass decode: ours on pages of --page-size keys (bench_decode.py's ours-paged-read, with "
                        "--append its ours-paged); SDPA still reads the dense cache")
    p.add_argument("--append", action="store_true",
                   help="--pass decode: ours as bench_decode.py's ours (the step appending one row to the dense cache)")
    p.add_argument("--rotary", action="store_true",
                   help="--pass decode: ours as bench_decode.py's ours-rotary (the dense step appending one row, "
                        "rotary tables applied in the append, causal)")
    p.add_argument("--float-bias", action="store_true",
                   help="a float attn_mask (1, H, L, L) on every call (bench_features.py's float-bias case; not causal)")
    p.add_argument("--device", default="cuda", help="'cpu' runs the script's code on tiny shapes (debug only)")
    p.add_argument("--repeats", type=int, default=40, help="calls per median")
    p.add_argument("--warmup-s", type=float, default=0.3, help="seconds of warm-up per row")
    p.add_argument("--json", help="append {pass, dtype, causal, rows, readings} as one JSON line to this file")
    p.add_argument("--child-timeout", type=float, default=90.0, help="seconds a variant's process may take")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--impl", default="ours", help=argparse.SUPPRESS)
    args = p.parse_args()
    if (args.paged or args.append or args.rotary) and args.pass_ != "decode":
        p.error("--paged, --append, --rotary: with --pass decode")
    if args.rotary and (args.paged or args.append):
        p.error("--rotary: a dense step that appends (not with --paged or --append)")
    if args.float_bias and (args.causal or args.pass_ == "decode" or args.dtype == "e4m3"):
        p.error("--float-bias: a non-causal bf16 / fp16 forward or backward")
    if args.child:
        return child(args)
    bad = [kv for v in args.variant for kv in v[1:] if "=" not in kv]
    if bad:
        p.error(f"--variant: environment settings are ENV=VALUE, got {bad}")
    variants = [(v[0], dict(kv.split("=", 1) for kv in v[1:]), "ours") for v in args.variant]
    if args.sdpa:
        variants.append((args.sdpa, {}, args.sdpa))
    if not variants:
        p.error("name at least one --variant (or --sdpa)")
    if len({name for name, _, _ in variants}) != len(variants):
        p.error(f"variant names must differ: {[name for name, _, _ in variants]}")
    rows = args.rows.split(",")
    readings = {name: [] for name, _, _ in variants}
    base = [sys.executable, __file__, "--child", "--rows", args.rows, "--dtype", args.dtype, "--device", args.device,
            "--pass", args.pass_, "--repeats", str(args.repeats), "--warmup-s", str(args.warmup_s)]
    base += ["--causal"] if args.causal else []
    base += ["--float-bias"] if args.float_bias else []
    base += ["--paged", "--page-size", str(args.page_size)] if args.paged else []
    base += ["--append"] if args.append else []
    base += ["--rotary"] if args.rotary else []
    dropped = set()  # variants that hung or failed: they do so in every round, so they run no more
    for r in range(args.rounds):
        for name, env, impl in (variants if r % 2 == 0 else variants[::-1]):
            if name in dropped:
                continue
            try:
                res = subprocess.run(base + ["--impl", impl], env={**os.environ, **env}, capture_output=True, text=True,
                                     timeout=args.child_timeout)
            except subprocess.TimeoutExpired:
                print(f"round {r + 1} {name:>12}: timed out after {args.child_timeout:.0f} s (no more rounds)", flush=True)
                dropped.add(name)
                continue
            if res.returncode != 0:
                print(f"round {r + 1} {name:>12}: failed (no more rounds)\n{res.stderr[-2000:]}", flush=True)
                dropped.add(name)
                continue
            values = [float(x) for x in res.stdout.split()]
            readings[name].append(values)
            print(f"round {r + 1} {name:>12}: " + " ".join(f"{row}={x}" for row, x in zip(rows, values)), flush=True)
    unit = "µs per step" if args.pass_ == "decode" else "TFLOP/s"
    shape = "causal" if args.causal or args.rotary else "float bias" if args.float_bias else "non-causal"
    print(f"\nmean over {args.rounds} rounds, {unit} ({args.pass_}, {args.dtype}, {shape})")
    print(f"{'variant':>12} " + " ".join(f"{row:>9}" for row in rows))
    for name, values in readings.items():
        means = [statistics.mean(col) for col in zip(*values)] if values else [float("nan")] * len(rows)
        print(f"{name:>12} " + " ".join(f"{m:9.1f}" for m in means) + f"   ({len(values)} rounds)")
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps({"pass": args.pass_, "dtype": args.dtype, "causal": args.causal, "rows": rows,
                                "readings": readings}) + "\n")
    if any(len(values) < args.rounds for values in readings.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()

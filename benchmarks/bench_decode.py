"""Decode-step benchmark: flash_attn_with_kvcache (dense and paged cache) beside torch SDPA's flash,
cuDNN and efficient backends on the same dense cache, and a device-to-device copy of the same bytes.

One row = one decode step of B sequences, each with C keys in its cache: q (B, Lq, H, E) with
Lq = 1 by default, the new keys appended at C - Lq (ours: the step, append and attention), attention to
all C keys, not causal (bottom-right causal is a no-op for one row). ours-read is the attention alone
(the same call with no new keys, the cache's C keys attended): what SDPA computes, reading the same
(B, Hkv, C, E) cache views in place, with enable_gqa where Hkv < H. Every implementation X is measured twice: X, eager
calls, and X-graph, --graph-steps calls (16) captured back to back in one CUDA graph and replayed, the time
per call (no Python or launch overhead: what a model's captured decode step sees; with one call per replay
a step of ~15 us measured either its kernels alone or those plus the replay's launch latency, run by run).
Per row: µs per step (CUDA events, warm-up, median of --repeats; the best of --rounds rounds, each timing
every implementation in turn, so that a slow spell of the GPU or host hits one round) and K/V bandwidth = bytes of K and V read
(B·C·Hkv·2E·itemsize) / time. The copy column is the bandwidth ceiling: a device-to-device copy of
that many bytes, counted as read + write bytes / time (what a copy moves; eager: captured in a graph the copy
is a memcpy node, which the copy engines run at ~2/3 of the SMs' rate on the H200). Summary columns (each side
the better of eager and graph): ours-read over the fastest SDPA backend (time, like for like), the step
(ours) over it, ours-read's K/V bandwidth as a percentage of the copy's, and the paged step over the dense
one (time). Rows whose buffers would pass --max-gb are skipped.

    python benchmarks/bench_decode.py                       # the default grid (bf16, E=128)
    python benchmarks/bench_decode.py --full                # B 1..64, C 1k..128k, E 64/128/256
    python benchmarks/bench_decode.py --device cpu --quick  # tiny sizes on the CPU (code paths only)
    python benchmarks/bench_decode.py --table results/h200/decode_bf16.json  # its markdown table (docs/inference.md)
    python benchmarks/bench_decode.py --plot results/h200/decode_bf16.json --out-dir /tmp  # its plots

--impls may also name ours-rotary (and ours-rotary-graph; not in the default list): the dense step
with rotary tables (float32, the whole head, causal), q and the new keys rotated inside the
append's launch; ours-paged-read (and -graph): the attention alone on the paged cache (ours-read's call
with the block table), which parts the paged step's cost from the paged append's; and flex-paged:
torch's FlexAttention reading the paged cache in place (its PagedAttention helper maps the logical block
mask onto the shuffled pages; page-sized key blocks), compiled once per row (the compile is not timed),
attention only as SDPA.
"""
import argparse
import datetime
import itertools
import json
import os
import sys
import warnings

import torch
import torch.nn.functional as F

import flashattn_ext
from flashattn_ext import _measure as M

BASE_IMPLS = ("ours", "ours-read", "ours-paged", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "copy")
IMPLS = tuple(i + suffix for i in BASE_IMPLS for suffix in ("", "-graph"))
OPTIONAL_IMPLS = ("ours-rotary", "ours-rotary-graph", "ours-paged-read", "ours-paged-read-graph", "flex-paged")
KINDS = {"mha": 1, "gqa": 4, "mqa": None}  # query heads per key/value head (None: one key/value head)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", default=os.environ.get("OUT") or os.path.join(os.path.dirname(
        os.path.abspath(__file__)), "results"))
    p.add_argument("--dtype", default="bf16", choices=tuple(M.DTYPES))
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--caches", default="1024,8192,32768,131072", help="comma list of cache lengths C")
    p.add_argument("--head-dims", default="128")
    p.add_argument("--heads", type=int, default=32, help="query heads H")
    p.add_argument("--kinds", default="mha,gqa,mqa", help="mha (Hkv = H), gqa (Hkv = H/4), mqa (Hkv = 1)")
    p.add_argument("--len-q", type=int, default=1, help="query rows per sequence (new keys per step)")
    p.add_argument("--page-size", type=int, default=256)
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--graph-steps", type=int, default=16, help="calls captured in one graph (X-graph)")
    p.add_argument("--rounds", type=int, default=2,
                   help="rounds over a row's implementations; each keeps its best round's median")
    p.add_argument("--max-gb", type=float, help="skip rows needing more (default 60; 1 with --device cpu)")
    p.add_argument("--full", action="store_true", help="B 1,2,4,...,64, C 1k,2k,...,128k, E 64,128,256")
    p.add_argument("--quick", action="store_true", help="tiny: B 1,2, C 256,1024, E 64, H 8, fp32")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--device", default="cuda")
    p.add_argument("--table", metavar="JSON", help="print the summary table of a result file as markdown, run nothing")
    p.add_argument("--plot", metavar="JSON", help="draw the plots of a result file into --out-dir, run nothing")
    args = p.parse_args(argv)
    if args.full:
        args.batches, args.head_dims = "1,2,4,8,16,32,64", "64,128,256"
        args.caches = ",".join(str(1024 << i) for i in range(8))
    if args.quick:
        args.batches, args.caches, args.head_dims, args.heads, args.dtype = "1,2", "256,1024", "64", 8, "fp32"
        args.page_size = min(args.page_size, 64)
        args.repeats, args.warmup = min(args.repeats, 5), min(args.warmup, 2)
    args.max_gb = args.max_gb or (1.0 if args.device == "cpu" else 60.0)
    args.batches = [int(x) for x in args.batches.split(",")]
    args.caches = [int(x) for x in args.caches.split(",")]
    args.head_dims = [int(x) for x in args.head_dims.split(",")]
    args.kinds = args.kinds.split(",")
    args.impls = args.impls.split(",")
    for name, given, known in (("kinds", args.kinds, KINDS), ("impls", args.impls, IMPLS + OPTIONAL_IMPLS)):
        if set(given) - set(known):
            p.error(f"unknown {name} {sorted(set(given) - set(known))}; choose from {tuple(known)}")
    return args


def make_row(batch, cache, heads, heads_kv, dim, len_q, page, dtype, device):
    """The row's tensors: a dense cache, the same keys in a paged cache (pages in shuffled blocks),
    q and the new keys and values."""
    gen = torch.Generator(device=device).manual_seed(0)
    randn = lambda *s: torch.randn(*s, generator=gen, device=device, dtype=torch.float32).to(dtype)
    t = {"q": randn(batch, len_q, heads, dim), "k": randn(batch, len_q, heads_kv, dim),
         "v": randn(batch, len_q, heads_kv, dim), "k_cache": randn(batch, cache, heads_kv, dim),
         "v_cache": randn(batch, cache, heads_kv, dim),
         "cache_seqlens": torch.full((batch,), cache - len_q, dtype=torch.int32, device=device),
         "cache_full": torch.full((batch,), cache, dtype=torch.int32, device=device)}
    if cache % page == 0:
        pages = batch * cache // page
        order = torch.randperm(pages, generator=torch.Generator().manual_seed(0)).to(device)
        for name in ("k_cache", "v_cache"):
            paged = torch.empty((pages, page, heads_kv, dim), dtype=dtype, device=device)
            paged[order] = t[name].reshape(pages, page, heads_kv, dim)
            t[name + "_paged"] = paged
        t["block_table"] = order.view(batch, cache // page).to(torch.int32)
    return t


def flex_paged_step(t):
    """FlexAttention over the paged cache: the pages as one (1, Hkv, pages x page, E) sequence (a view),
    torch's PagedAttention table set to the row's block table, the logical block mask (every key of a
    sequence) converted to pages; the whole cache attended, nothing appended."""
    from torch.nn.attention.experimental._paged_attention import PagedAttention
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    q = t["q"].transpose(1, 2)
    pages, page, heads_kv, dim = t["k_cache_paged"].shape
    batch, blocks = t["block_table"].shape
    table = PagedAttention(pages, page, batch, device=q.device)
    table.page_table[:, :blocks] = t["block_table"].long()
    rows = torch.arange(batch, device=q.device)[:, None]
    table.physical_to_logical[rows, t["block_table"].long()] = torch.arange(blocks, device=q.device)
    table.capacity[:] = blocks * page
    logical = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= 0, batch, None, q.shape[2], blocks * page,
                                device=q.device, BLOCK_SIZE=(128, page))
    mask = table.convert_logical_block_mask(logical)
    k, v = (t[n].view(pages * page, heads_kv, dim).permute(1, 0, 2).unsqueeze(0)
            for n in ("k_cache_paged", "v_cache_paged"))
    torch._dynamo.reset()  # one compiled graph per row: no recompilation limit across the grid
    attend = torch.compile(flex_attention, dynamic=False)
    return lambda: attend(q, k, v, block_mask=mask, enable_gqa=heads_kv != q.shape[1])


def step_fn(impl, t, graph_steps=1):
    """One decode step of `impl` on the row's tensors (X-graph: a replay of graph_steps of them, its
    `steps` attribute that count)."""
    if impl == "ours":
        return lambda: flashattn_ext.flash_attn_with_kvcache(t["q"], t["k_cache"], t["v_cache"], t["k"], t["v"],
                                                             cache_seqlens=t["cache_seqlens"])
    if impl == "ours-read":
        return lambda: flashattn_ext.flash_attn_with_kvcache(t["q"], t["k_cache"], t["v_cache"],
                                                             cache_seqlens=t["cache_full"])
    if impl == "ours-rotary":
        cache, dim = t["k_cache"].shape[1], t["q"].shape[3]
        angle = torch.arange(cache, device=t["q"].device)[:, None] / 10000 ** (
            torch.arange(dim // 2, device=t["q"].device) / (dim // 2))
        cos, sin = angle.cos(), angle.sin()
        return lambda: flashattn_ext.flash_attn_with_kvcache(t["q"], t["k_cache"], t["v_cache"], t["k"], t["v"],
                                                             cache_seqlens=t["cache_seqlens"], rotary_cos=cos,
                                                             rotary_sin=sin, causal=True)
    if impl.endswith("-graph"):  # no Python or launch overhead
        step = step_fn(impl[:-len("-graph")], t)
        step()  # lazy initialisation outside the capture
        return M.graph_replay(step, graph_steps)  # (a step appends the same rows at the same place: repeatable)
    if impl == "ours-paged":
        return lambda: flashattn_ext.flash_attn_with_kvcache(
            t["q"], t["k_cache_paged"], t["v_cache_paged"], t["k"], t["v"], cache_seqlens=t["cache_seqlens"],
            block_table=t["block_table"])
    if impl == "ours-paged-read":
        return lambda: flashattn_ext.flash_attn_with_kvcache(t["q"], t["k_cache_paged"], t["v_cache_paged"],
                                                             cache_seqlens=t["cache_full"],
                                                             block_table=t["block_table"])
    if impl == "flex-paged":  # compiled once per row (the guard below and the measurement share it)
        if "flex_step" not in t:
            t["flex_step"] = flex_paged_step(t)
        return t["flex_step"]
    if impl == "copy":
        src = torch.empty(2 * t["k_cache"].numel() * t["k_cache"].element_size(), dtype=torch.uint8,
                          device=t["q"].device)
        dst = torch.empty_like(src)
        return lambda: dst.copy_(src)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = getattr(SDPBackend, M.SDPA_BACKENDS[impl])
    q, k, v = (t[n].transpose(1, 2) for n in ("q", "k_cache", "v_cache"))
    gqa = q.shape[1] != k.shape[1]

    def sdpa():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    return sdpa


def first_line(text):
    return text.strip().splitlines()[0] if text.strip() else ""


def measure(impl, t, kv_bytes, args):
    if impl.endswith("-graph") and args.device != "cuda":
        return {"skipped": "CUDA graphs need a CUDA device"}
    if (impl.startswith("ours-paged") or impl == "flex-paged") and "block_table" not in t:
        return {"skipped": f"cache length not a multiple of the page size {args.page_size}"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fn = step_fn(impl, t, args.graph_steps)  # (a graph is captured here)
            fn()
        except (RuntimeError, ValueError, NotImplementedError, torch.cuda.OutOfMemoryError) as e:
            notes = "; ".join(first_line(str(w.message)) for w in caught)
            return {"skipped": first_line(str(e)) + (f" ({notes})" if notes else "")}
    ms = M.per_call_ms(fn, args.device, args.warmup, args.repeats, warmup_s=0.2 if args.device == "cuda" else 0.0)
    moved = 2 * kv_bytes if impl.startswith("copy") else kv_bytes  # a copy reads and writes them
    return {"us": ms * 1e3, "gb_per_s": moved / (ms * 1e-3) / 1e9}


def check_paged_equals_dense(t):
    """ours-paged reads the same keys as ours: the same outputs up to rounding (a guard on the
    benchmark's inputs; a wrong page would change them by O(1))."""
    dense = step_fn("ours", t)()
    paged = step_fn("ours-paged", t)()
    if not torch.allclose(dense.float(), paged.float(), rtol=1e-2, atol=1e-2):
        raise AssertionError(f"paged and dense outputs differ by {(dense - paged).abs().max().item():.3g}")


def check_flex_equals_ours(t):
    """flex-paged attends to the paged cache after ours-paged appended the step's rows: the output of ours
    (dense, the same rows appended) up to rounding."""
    step_fn("ours-paged", t)()
    ours = step_fn("ours", t)()
    flex = step_fn("flex-paged", t)().transpose(1, 2)
    if not torch.allclose(ours.float(), flex.float(), rtol=2e-2, atol=2e-2):
        raise AssertionError(f"flex-paged and ours differ by {(ours.float() - flex.float()).abs().max().item():.3g}")


# The done-when numbers of a row (None where a side was not measured).
SUMMARY = ("ours_over_fastest_sdpa", "step_over_fastest_sdpa", "ours_pct_of_copy_bw", "paged_over_dense")


def _best_us(row, impls):
    times = [row[i]["us"] for i in impls if "us" in row.get(i, {})]
    return min(times) if times else None


def best_us(row, base):
    """The better of implementation `base`'s eager and graph-replay times (None where neither ran)."""
    return _best_us(row, (base, base + "-graph"))


def summarize(row):
    """Each side the better of eager and graph replay: ours-read (attention alone) and the step (ours) over
    the fastest SDPA backend, in time; ours-read's K/V bandwidth as a percentage of the copy's; the paged
    step over the dense one, in time."""
    read, step = best_us(row, "ours-read"), best_us(row, "ours")
    sdpa = _best_us(row, [i for i in row if i.startswith("sdpa-")])
    row["ours_over_fastest_sdpa"] = read / sdpa if read and sdpa else None
    row["step_over_fastest_sdpa"] = step / sdpa if step and sdpa else None
    copy = best_us(row, "copy")
    row["ours_pct_of_copy_bw"] = 100 * copy / (2 * read) if read and copy else None  # (a copy moves 2 kv_bytes)
    paged = best_us(row, "ours-paged")
    row["paged_over_dense"] = paged / step if step and paged else None


def markdown_table(rows):
    """The summary of each measured row (summarize) with its times in µs: the attention (ours-read), the step
    (ours), the fastest SDPA backend (named), each the better of eager and graph replay."""
    def us(x):
        return f"{x:.1f}" if x < 100 else f"{x:.0f}"

    def keys(c):
        return f"{c // 1024}k" if c % 1024 == 0 else str(c)
    lines = ["| kind | B | C | attention | step | fastest SDPA | attention / SDPA | step / SDPA | "
             "K/V bandwidth / copy's | paged / dense step |", "|:---:|---:|---:" + "|---:" * 7 + "|"]
    for row in rows:
        read, step = best_us(row, "ours-read"), best_us(row, "ours")
        sdpa = {b: best_us(row, b) for b in ("sdpa-flash", "sdpa-cudnn", "sdpa-efficient")}
        sdpa = {b: t for b, t in sdpa.items() if t is not None}
        if read is None or step is None or not sdpa or row.get("paged_over_dense") is None:
            continue
        fastest = min(sdpa, key=sdpa.get)
        lines.append(f"| {row['kind'].upper()} | {row['batch']} | {keys(row['cache'])} | {us(read)} | {us(step)} | "
                     f"{us(sdpa[fastest])} ({fastest[len('sdpa-'):]}) | {row['ours_over_fastest_sdpa']:.2f} | "
                     f"{row['step_over_fastest_sdpa']:.2f} | {row['ours_pct_of_copy_bw']:.0f}% | "
                     f"{row['paged_over_dense']:.2f} |")
    return "\n".join(lines)


def run_grid(args):
    dtype = M.DTYPES[args.dtype]
    rows = []
    names = " ".join(f"{i.replace('sdpa-', ''):>10s}" for i in args.impls)
    print(f"{'E':>3s} {'kind':4s} {'B':>3s} {'C':>6s} {'H':>3s} {'Hkv':>3s} | us per step {names} | GB/s of K/V "
          f"{names} | {' '.join(SUMMARY)}")
    for dim, kind, batch, cache in itertools.product(args.head_dims, args.kinds, args.batches, args.caches):
        heads_kv = 1 if KINDS[kind] is None else args.heads // KINDS[kind]
        kv_bytes = 2 * batch * cache * heads_kv * dim * dtype.itemsize
        row = {"dtype": args.dtype, "head_dim": dim, "kind": kind, "batch": batch, "cache": cache,
               "heads": args.heads, "heads_kv": heads_kv, "len_q": args.len_q, "page_size": args.page_size,
               "kv_bytes": kv_bytes}
        need_gb = 6 * kv_bytes / 1e9  # dense + paged caches, the gathered copy, the copy buffers
        if need_gb > args.max_gb or cache <= args.len_q:
            row["skipped"] = f"needs ~{need_gb:.3g} GB > --max-gb {args.max_gb:g}" if need_gb > args.max_gb \
                else f"cache length {cache} <= len_q {args.len_q}"
            rows.append(row)
            continue
        t = make_row(batch, cache, args.heads, heads_kv, dim, args.len_q, args.page_size, dtype, args.device)
        if "ours" in args.impls and "ours-paged" in args.impls and "block_table" in t:
            check_paged_equals_dense(t)
        if "flex-paged" in args.impls and "block_table" in t:
            try:
                check_flex_equals_ours(t)
            except (RuntimeError, ValueError, NotImplementedError, torch.cuda.OutOfMemoryError) as e:
                row["flex-paged"] = {"skipped": first_line(str(e))}  # (not measured below)
        measured = [impl for impl in args.impls if impl not in row]
        for _ in range(args.rounds):  # (each round times every implementation once: a slow spell hits one round)
            for impl in measured:
                m = measure(impl, t, kv_bytes, args)
                if "us" not in row.get(impl, {}) or ("us" in m and m["us"] < row[impl]["us"]):
                    row[impl] = m
        del t
        if args.device == "cuda":
            torch.cuda.empty_cache()
        summarize(row)
        us = " ".join(f"{row[i]['us']:10.1f}" if "us" in row[i] else f"{'-':>10s}" for i in args.impls)
        bw = " ".join(f"{row[i]['gb_per_s']:10.1f}" if "us" in row[i] else f"{'-':>10s}" for i in args.impls)
        summary = " ".join("-" if row[n] is None else f"{row[n]:.2f}" for n in SUMMARY)
        print(f"{dim:3d} {kind:4s} {batch:3d} {cache:6d} {args.heads:3d} {heads_kv:3d} | {'':11s} {us} | "
              f"{'':11s} {bw} | {summary}", flush=True)
        rows.append(row)
    for reason in sorted({(i, r[i]["skipped"]) for r in rows for i in args.impls if "skipped" in r.get(i, {})}):
        print("skipped %s: %s" % reason)
    return rows


def plot(rows, impls, out_dir):
    """K/V bandwidth against cache length: one PNG per (head dim, kind), one panel per batch."""
    plt = M.pyplot()
    if plt is None:
        return []
    paths = []
    measured = [r for r in rows if "skipped" not in r]
    for dim, kind in sorted({(r["head_dim"], r["kind"]) for r in measured}):
        sel = [r for r in measured if (r["head_dim"], r["kind"]) == (dim, kind)]
        batches = sorted({r["batch"] for r in sel})
        fig, axes = plt.subplots(1, len(batches), figsize=(4.2 * len(batches), 3.8), squeeze=False)
        for ax, batch in zip(axes[0], batches):
            pts = sorted((r for r in sel if r["batch"] == batch), key=lambda r: r["cache"])
            for base in dict.fromkeys(i[:-len("-graph")] if i.endswith("-graph") else i for i in impls):
                moved = 2 if base == "copy" else 1  # (a copy's bandwidth counts read + written bytes)
                xy = [(r["cache"], moved * r["kv_bytes"] / best_us(r, base) / 1e3) for r in pts if best_us(r, base)]
                if xy:
                    ax.plot(*zip(*xy), marker="o", label=base, linestyle="--" if base == "copy" else "-")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("cache length (keys)")
            ax.set_ylabel("K/V bandwidth (GB/s)")
            ax.set_title(f"B={batch}", fontsize=10)
        axes[0][0].legend(fontsize=7)
        heads_kv = sel[0]["heads_kv"]
        fig.suptitle(f"Decode step, {sel[0]['dtype']}, E={dim}, H={sel[0]['heads']}, Hkv={heads_kv} ({kind})",
                     fontsize=11)
        paths.append(M.save_plot(plt, fig, os.path.join(out_dir, f"decode_{sel[0]['dtype']}_hdim{dim}_{kind}.png"),
                                 110))
    return paths


def main(argv=None):
    args = parse_args(argv)
    if args.table:
        with open(args.table) as f:
            print(markdown_table(json.load(f)["rows"]))
        return
    if args.plot:
        os.makedirs(args.out_dir, exist_ok=True)
        with open(args.plot) as f:
            for png in plot(json.load(f)["rows"], args.impls, args.out_dir):
                print(f"wrote {png}")
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device here; --device cpu --quick runs the code paths on the CPU")
    os.makedirs(args.out_dir, exist_ok=True)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"{device_name}, torch {torch.__version__}, {args.dtype}, Lq={args.len_q}, page {args.page_size}, "
          f"median of {args.repeats} after {args.warmup} warm-up")
    with torch.inference_mode():
        rows = run_grid(args)
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "torch": torch.__version__,
            "device": device_name, "cuda": torch.version.cuda, "repeats": args.repeats, "warmup": args.warmup,
            "rounds": args.rounds, "bandwidth": "K/V bytes read / time; copy: bytes read + written / time"}
    path = os.path.join(args.out_dir, f"decode_{args.dtype}.json" if args.device == "cuda" else "decode_cpu.json")
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"wrote {path}")
    if not args.no_plots:
        for png in plot(rows, args.impls, args.out_dir):
            print(f"wrote {png}")


if __name__ == "__main__":
    main()

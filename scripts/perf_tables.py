"""Markdown tables of a bench_gpu.py result (docs/performance.md's form): one per dtype, a row per
(head dim, causal, L) with forward and backward TFLOP/s and peak MiB of ours / FA2 / cuDNN (those the run timed).

    python scripts/perf_tables.py benchmarks/results/h100/gpu_grid.json [--rows readme]

--rows readme: only L = 1024 and 16384 and no memory column (the README's table)."""
import argparse
import json

IMPLS = {"ours": "ours", "sdpa-flash": "FA2", "sdpa-cudnn": "cuDNN"}


def cell(row, impls, key, spec="{:.1f}"):
    vals = [row.get(i, {}).get(key) for i in impls]
    return " / ".join("-" if v is None else spec.format(v) for v in vals)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("result")
    p.add_argument("--rows", choices=("all", "readme"), default="all")
    args = p.parse_args()
    rows = json.load(open(args.result))["rows"]
    readme = args.rows == "readme"
    impls = [i for i in IMPLS if any(i in r for r in rows)]  # the backends this run timed
    names = " / ".join(IMPLS[i] for i in impls)
    for dtype in sorted({r["dtype"] for r in rows}, key=lambda d: d != "bf16"):
        print(f"{dtype}:\n")
        if readme:
            print(f"| E | causal | L | forward {names} | backward {names} |")
            print("|---:|:---:|---:|---:|---:|")
        else:
            print(f"| E | causal | L | B × H | forward {names} | backward {names} | peak MiB {names} |")
            print("|---:|:---:|---:|---:|---:|---:|---:|")
        sel = sorted((r for r in rows if r["dtype"] == dtype), key=lambda r: (r["head_dim"], r["causal"], r["len"]))
        for r in sel:
            if readme and r["len"] not in (1024, 16384):
                continue
            head = f"| {r['head_dim']} | {'yes' if r['causal'] else 'no'} | {r['len']} |"
            fb = f" {cell(r, impls, 'fwd_tflops')} | {cell(r, impls, 'bwd_tflops')} |"
            if readme:
                print(head + fb)
            else:
                mib = cell(r, impls, "peak_extra_mib", "{:.0f}")
                print(head + f" {r['batch']} × {r['heads']} |" + fb + f" {mib} |")
        print()


if __name__ == "__main__":
    main()

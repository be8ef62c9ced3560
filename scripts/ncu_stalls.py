"""Where a kernel's warps stall, from Nsight Compute's source page: a short text summary instead of the page's
~2 MB CSV a kernel (a device call returns few files). On the GPU machine:

    ncu --clock-control none --cache-control none --profile-from-start off --kernel-name regex:fwd_decode \\
        --set full -o rep python3 scripts/profile_decode.py mqa:1:8192 --impls ours-paged-read
    ncu -i rep.ncu-rep --page source --csv --print-source sass > rep.csv
    python3 scripts/ncu_stalls.py rep.csv [more.csv ...] > $OUT/stalls.txt

prints per CSV its kernel, the warp-stall samples by reason, over the prologue (before the key loop), the key loop
(sass_blocks.key_loop's rule: the shortest backward branch's range holding a tensor-core product) and the rest, and
the instructions with the most samples. (ncu's default `--cache-control all` flushes the caches before the launch:
a short kernel's code is then fetched cold, and `no_inst` stalls dominate, half the samples of a paged decode step's
kernel in one reading; `none` keeps the caches a graph replay of many steps would have.)"""
import argparse
import collections
import csv
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sass_blocks  # noqa: E402


def summarize(path, top):
    rows = list(csv.reader(open(path, newline="")))
    kernel = rows[0][1] if len(rows[0]) > 1 else "?"
    header, body = rows[1], [r for r in rows[2:] if len(r) > 2]
    samples_at = header.index("Warp Stall Sampling (All Samples)")
    reasons = [(h[len("stall_"):], i) for i, h in enumerate(header) if h.startswith("stall_") and "Not Issued" not in h]
    count = lambda r, i: int(r[i].replace(",", "") or 0)  # noqa: E731
    ins = [(int(r[0], 16), r[1].strip()) for r in body]
    loop = sass_blocks.key_loop(ins) or sass_blocks.largest_loop(ins)
    def region(address):
        if loop is None:
            return "all"
        return "prologue" if address < loop[0] else "key loop" if address <= loop[1] else "after"
    by_region = collections.defaultdict(collections.Counter)
    for r, (address, _) in zip(body, ins):
        for name, i in reasons:
            by_region[region(address)][name] += count(r, i)
    total = sum(count(r, samples_at) for r in body)
    print(f"== {os.path.basename(path)}: {kernel}")
    loop_text = f"{(loop[1] - loop[0]) // 16 + 1} instructions" if loop else "none found"
    print(f"   {len(body)} instructions, key loop {loop_text}, {total} samples")
    for name, counts in by_region.items():
        busiest = ", ".join(f"{k} {v}" for k, v in counts.most_common(6) if v)
        print(f"   {name:9s} {sum(counts.values()):6d}: {busiest}")
    print(f"   top {top} instructions (samples: reasons):")
    ranked = sorted(zip(body, ins), key=lambda x: -count(x[0], samples_at))[:top]
    for r, (address, text) in ranked:
        why = ", ".join(f"{name} {count(r, i)}" for name, i in reasons if count(r, i))
        text = re.sub(r"\s+", " ", text)[:60]
        print(f"   {count(r, samples_at):5d} {region(address):9s} {text:60s} {why}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("csv", nargs="+", help="ncu --page source --csv --print-source sass output, one kernel each")
    p.add_argument("--top", type=int, default=15)
    args = p.parse_args()
    for path in args.csv:
        summarize(path, args.top)


if __name__ == "__main__":
    main()

"""Where a kernel's warps stall, from Nsight Compute's source page: a short text summary instead of the page's
~2 MB CSV a kernel (a device call returns few files). On the GPU machine:

    ncu --clock-control none --cache-control none --profile-from-start off --kernel-name regex:fwd_decode \\
        --set full -o rep python3 scripts/profile_decode.py mqa:1:8192 --impls ours-paged-read
    ncu -i rep.ncu-rep --page source --csv --print-source sass > rep.csv
    python3 scripts/ncu_stalls.py rep.csv [more.csv ...] > $OUT/stalls.txt

prints per kernel of each CSV (a report of several kernels gives one CSV with a section each) the warp-stall samples
by reason, over the prologue (before the key loop), the key loop (sass_blocks.key_loop's rule: the shortest backward
branch's range holding a tensor-core product) and the rest; the instructions with the most samples; and the code by
execution count (instructions that ran equally often: a loop body, an item's code, a role's wait loop), which splits
two kernels' work per tile and per item alike whatever their layout (sm90_forward_ws.md compares ours with cuDNN's
that way). (ncu's default `--cache-control all` flushes the caches before the launch:
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


def sections(rows):
    """(kernel, header, body) of each kernel in a source-page CSV (one "Kernel Name" row before each)."""
    starts = [i for i, r in enumerate(rows) if r and r[0] == "Kernel Name"] or [0]
    for n, i in enumerate(starts):
        end = starts[n + 1] if n + 1 < len(starts) else len(rows)
        kernel = rows[i][1] if len(rows[i]) > 1 else "?"
        yield kernel, rows[i + 1], [r for r in rows[i + 2:end] if len(r) > 2]


def summarize(path, top, classes):
    for kernel, header, body in sections(list(csv.reader(open(path, newline="")))):
        summarize_kernel(path, kernel, header, body, top, classes)


def summarize_kernel(path, kernel, header, body, top, classes):
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
    if classes:
        print_classes(header, body, reasons, count, samples_at, classes)


def print_classes(header, body, reasons, count, samples_at, most):
    """The code by how often it ran: instructions sharing one execution count run together (a loop's body, an
    item's code, a role's), so the classes split a kernel's work and samples by phase without its control flow."""
    executed_at = header.index("Instructions Executed")
    by_count = collections.defaultdict(list)
    for r in body:
        by_count[count(r, executed_at)].append(r)
    total_executed = sum(n * len(rs) for n, rs in by_count.items()) or 1
    total_samples = sum(count(r, samples_at) for r in body) or 1
    print(f"   code by execution count (the {most} classes with the most warp instructions):")
    ranked = sorted(by_count.items(), key=lambda item: -item[0] * len(item[1]))[:most]
    for executed, rs in ranked:
        why = collections.Counter()
        ops = collections.Counter()
        for r in rs:
            for name, i in reasons:
                why[name] += count(r, i)
            ops[re.sub(r"^@!?U?P\w+ +", "", r[1].strip()).split(" ")[0].split(".")[0]] += 1
        samples = sum(count(r, samples_at) for r in rs)
        print(f"   {executed:10d} x {len(rs):4d} instr: {100 * executed * len(rs) / total_executed:4.1f}% executed, "
              f"{100 * samples / total_samples:4.1f}% samples; "
              + ", ".join(f"{k} {v}" for k, v in why.most_common(4) if v) + " | "
              + " ".join(f"{k} {v}" for k, v in ops.most_common(6)))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("csv", nargs="+", help="ncu --page source --csv --print-source sass output, one kernel each")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--classes", type=int, default=8, help="execution-count classes to list (0: none)")
    args = p.parse_args()
    for path in args.csv:
        summarize(path, args.top, args.classes)


if __name__ == "__main__":
    main()

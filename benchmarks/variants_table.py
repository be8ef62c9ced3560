"""Ratios between two variants of bench_variants.py's JSON lines (--json): per row, the mean TFLOP/s of
each over its rounds and NEW / OLD, with the lowest and highest round-to-round ratio, so that a change
can be judged against the rounds' spread. Prints one table per (pass, dtype, causal) and the extremes.

    python benchmarks/variants_table.py runs.jsonl OLD NEW
"""
import json
import statistics
import sys


def main():
    path, old, new = sys.argv[1:4]
    worst, best = (None, float("inf")), (None, float("-inf"))
    for line in open(path):
        run = json.loads(line)
        a, b = run["readings"].get(old), run["readings"].get(new)
        if not a or not b:
            continue
        title = f"{run['pass']} {run['dtype']} {'causal' if run['causal'] else 'non-causal'}"
        print(f"\n{title}: TFLOP/s {old} / {new}, {new}/{old} (rounds' range)")
        for i, row in enumerate(run["rows"]):
            ma = statistics.mean(r[i] for r in a)
            mb = statistics.mean(r[i] for r in b)
            pairs = [rb[i] / ra[i] for ra, rb in zip(a, b) if ra[i] > 0]
            ratio = mb / ma if ma > 0 else float("nan")
            print(f"  {row:>9}  {ma:7.1f} / {mb:7.1f}  {ratio:5.3f}  ({min(pairs):.3f}-{max(pairs):.3f})")
            if ratio < worst[1]:
                worst = (f"{title} {row}", ratio)
            if ratio > best[1]:
                best = (f"{title} {row}", ratio)
    print(f"\nlowest {new}/{old}: {worst[1]:.3f} at {worst[0]}; highest: {best[1]:.3f} at {best[0]}")


if __name__ == "__main__":
    main()

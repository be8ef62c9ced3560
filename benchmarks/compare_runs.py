"""Prints benchmark runs (bench_gpu.py's gpu.json, one per build) side by side: ours in each run,
its ratio to the first run's, and the SDPA backends of the first run.

    python benchmarks/compare_runs.py gpu_out/base/gpu.json gpu_out/new/gpu.json"""
import json
import os
import sys


def label(path):
    return os.path.basename(os.path.dirname(os.path.abspath(path))) or path


def key(row):
    return (row["dtype"], row["head_dim"], row["len"], row["batch"], row["heads"], row["causal"])


def main(paths):
    runs = [(label(p), {key(r): r for r in json.load(open(p))["rows"]}) for p in paths]
    first = runs[0][1]
    sdpa = sorted({impl for r in first.values() for impl in r if impl.startswith("sdpa-")})
    head = ["dtype", "E", "L", "B", "H", "causal", "pass"]
    print(" ".join(f"{h:>6}" for h in head), "|", " ".join(f"{n:>10}" for n, _ in runs), "|",
          " ".join(f"{n:>10}" for n in sdpa), "|", " ".join(f"{n + '/' + runs[0][0]:>16}" for n, _ in runs[1:]))
    for k, row in first.items():
        for ps in ("fwd", "bwd"):
            ours = [r.get(k, {}).get("ours", {}).get(f"{ps}_tflops") for _, r in runs]
            cells = [f"{x:10.1f}" if x else f"{'-':>10}" for x in ours]
            ref = [f"{row.get(i, {}).get(f'{ps}_tflops', 0):10.1f}" for i in sdpa]
            ratios = [f"{x / ours[0]:16.3f}" if x and ours[0] else f"{'-':>16}" for x in ours[1:]]
            print(" ".join(f"{str(v):>6}" for v in (*k, ps)), "|", " ".join(cells), "|", " ".join(ref), "|",
                  " ".join(ratios))


if __name__ == "__main__":
    main(sys.argv[1:])

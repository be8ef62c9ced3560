"""A/B of decode steps across source trees (scripts/snapshot.sh puts them under snapshots/, each built in
place): runs benchmarks/bench_decode.py in each tree in interleaved rounds (tree order reversed every other
round), then prints per row and implementation the median time of each tree and its ratio to the first tree's.
A tree given as PATH@VAR=VALUE[,VAR=VALUE...] runs with those environment variables set (one build measured
under several settings). On a GPU machine, after building the trees:

    python3 scripts/decode_compare.py snapshots/a snapshots/b --rounds 2 \\
        --args "--impls ours-graph,ours-paged-graph --batches 1,8,64 --caches 8192,32768,131072 --repeats 100"
"""
import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("trees", nargs="+", help="source trees, each with its extension built in place (PATH[@VAR=VALUE,...])")
p.add_argument("--rounds", type=int, default=2)
p.add_argument("--args", default="--impls ours-graph,ours-paged-graph --repeats 100",
               help="bench_decode.py arguments (the same for every tree)")
p.add_argument("--out", help="write every run's rows and the table's numbers here (JSON)")
args = p.parse_args()

runs = {tree: [] for tree in args.trees}
with tempfile.TemporaryDirectory() as tmp:
    for r in range(args.rounds):
        for i, tree in enumerate(args.trees if r % 2 == 0 else args.trees[::-1]):
            out_dir = os.path.join(tmp, f"r{r}_{i}")
            path, _, settings = tree.partition("@")
            root = os.path.abspath(path)
            env = dict(kv.split("=", 1) for kv in settings.split(",") if kv)
            cmd = [sys.executable, "benchmarks/bench_decode.py", "--no-plots", "--out-dir", out_dir,
                   *shlex.split(args.args)]
            done = subprocess.run(cmd, cwd=root, env={**os.environ, **env, "PYTHONPATH": root}, capture_output=True,
                                  text=True)
            if done.returncode != 0:
                sys.exit(f"{tree}: bench_decode.py failed:\n{done.stderr[-2000:]}")
            (path,) = [os.path.join(out_dir, f) for f in os.listdir(out_dir) if f.endswith(".json")]
            with open(path) as f:
                runs[tree].append(json.load(f)["rows"])


def key(row):
    return f"{row['kind']} B={row['batch']} C={row['cache']} E={row['head_dim']}"


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


first = args.trees[0]
table = {}
for row in runs[first][0]:
    for impl, value in row.items():
        if not (isinstance(value, dict) and "us" in value):
            continue
        times = {}
        for tree in args.trees:
            same = [r for rows in runs[tree] for r in rows if key(r) == key(row) and "us" in r.get(impl, {})]
            if same:
                times[tree] = median([r[impl]["us"] for r in same])
        table.setdefault(key(row), {})[impl] = times
        cells = "".join(f"  {os.path.basename(t.rstrip('/'))} {us:9.1f} ({us / times[first]:.3f})"
                        for t, us in times.items())
        print(f"{key(row):28} {impl:18}{cells}")
if args.out:
    with open(args.out, "w") as f:
        json.dump({"trees": args.trees, "args": args.args, "runs": runs, "median_us": table}, f, indent=1)

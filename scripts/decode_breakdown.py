"""Where a decode step's time goes: per-kernel GPU time (torch.profiler, eager calls) of
flash_attn_with_kvcache's step (the decode kernel, which appends the row, and any combine kernel), dense and
paged, beside SDPA's cuDNN and flash backends on the same dense cache, and graph-replay totals of each (the step
with and without new rows, a device-to-device copy of the K/V bytes). On a GPU machine:

    PYTHONPATH=$PWD python3 scripts/decode_breakdown.py --rows gqa-8-8192,mqa-64-8192 --out breakdown.json
"""
import argparse
import collections
import json
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import bench_decode as BD  # noqa: E402

import flashattn_ext  # noqa: E402
from flashattn_ext import _measure as M  # noqa: E402

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--rows", default="gqa-8-8192,gqa-64-1024,mqa-64-8192,mqa-8-8192,mha-1-32768,gqa-1-131072",
               help="comma list of kind-batch-cache (kind: mha, gqa (H/4 kv heads), mqa)")
p.add_argument("--heads", type=int, default=32)
p.add_argument("--head-dim", type=int, default=128)
p.add_argument("--page-size", type=int, default=256)
p.add_argument("--out", default="decode_breakdown.json")
args = p.parse_args()


def graph_of(fn):
    """One call of fn captured in a CUDA graph (median_us times many replays between two events)."""
    fn()
    torch.cuda.synchronize()
    return M.graph_replay(fn, steps=1)


def median_us(fns, reps=200, rounds=5):
    """Interleaved rounds of `reps` calls of each function: the median round's µs per call."""
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            for _ in range(10):
                fn()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            torch.cuda.synchronize()
            times[name].append(start.elapsed_time(end) * 1e3 / reps)
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def kernel_us(fn, calls=10):
    """GPU time per call of each kernel (and memset) fn launches."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    per_kernel = collections.defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[event.name[:80]] += event.device_time / calls
    return dict(per_kernel)


results = []
for spec in args.rows.split(","):
    kind, batch, cache = spec.split("-")
    batch, cache, heads = int(batch), int(cache), args.heads
    heads_kv = {"mha": heads, "gqa": heads // 4, "mqa": 1}[kind]
    t = BD.make_row(batch, cache, heads, heads_kv, args.head_dim, 1, args.page_size, torch.bfloat16, "cuda")
    full = t["cache_seqlens"] + 1
    read_only = lambda: flashattn_ext.flash_attn_with_kvcache(  # noqa: E731
        t["q"], t["k_cache"], t["v_cache"], cache_seqlens=full)
    # (bench_decode's steps: ours appends, SDPA reads the same dense cache)
    calls = {"step": BD.step_fn("ours", t), "read_only": read_only, "paged": BD.step_fn("ours-paged", t),
             "cudnn": BD.step_fn("sdpa-cudnn", t), "flash": BD.step_fn("sdpa-flash", t)}
    graphs = {name: graph_of(fn) for name, fn in calls.items()}
    graphs["copy"] = graph_of(BD.step_fn("copy", t))
    row = {"row": spec, "graph_us": median_us(graphs),
           "kernels_us": {name: kernel_us(calls[name]) for name in ("step", "paged", "cudnn", "flash")}}
    results.append(row)
    print(json.dumps(row), flush=True)
    del t, calls, graphs
    torch.cuda.empty_cache()
with open(args.out, "w") as f:
    json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": results}, f, indent=1)
print("wrote", args.out)

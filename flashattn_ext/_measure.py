"""Timing, FLOP and peak-memory helpers shared by `python -m flashattn_ext` and benchmarks/.

Conventions (DESIGN.md §5):
- FLOPs: forward 4·B·H·Lq·Lk·E, halved when causal (the FlashAttention papers' convention, not
  the exact count of the lower triangle); backward 2.5× forward.
- Time: median of repeats after warm-up; CUDA events on GPU, time.perf_counter on CPU.
- Peak extra memory of one forward+backward, inputs (q, k, v, dout) excluded. CUDA:
  torch.cuda.max_memory_allocated minus what was allocated before the call. CPU: torch's CPU
  allocator keeps no peak counter, so a fresh process (`python -m flashattn_ext._measure`)
  measures the resident-set peak above the resident set before the call.

CPU memory entry, one line per case:
    python -m flashattn_ext._measure --case ours:fp32:1,8,1024,64:causal --case sdpa:fp32:1,8,1024,64
"""
import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

# The accuracy rule (DESIGN.md §4): max|ours - ref| <= 2 * max|torch - ref| + atol with
# atol = REL_ATOL * max(max|ref|, 1); shared by the tests and the main job.
# Allowed slack beyond twice torch's own error, relative to the largest reference magnitude
# (at least 1: the tests feed unit-scale inputs, and an exactly-zero reference, as dq with a
# single key, still carries rounding of unit-sized intermediate terms).
# Forward (out, lse): ~4500 ulp for float64 (summation order over long rows), 8 ulp for
# float32, half an ulp (one rounding of the result) for bfloat16 / float16.
REL_ATOL = {
    torch.float64: 1e-12,
    torch.float32: 1e-6,
    torch.bfloat16: 2.0**-8,
    torch.float16: 2.0**-11,
}
# Gradients: the FlashAttention backward takes D = rowsum(dO * O) from the output as stored
# (rounded to the input dtype), while torch's CPU math path keeps the softmax in float32
# throughout; the rounding of O then enters dS = P (dP - D) in every column. Measured worst
# case (head_dim 1, head_dim_v 256) is ~20 float32 ulp and ~0.6 bfloat16 ulp, so the bound is
# ~80 ulp for float32 and one ulp for bfloat16 / float16.
REL_ATOL_GRAD = {
    torch.float64: 1e-12,
    torch.float32: 1e-5,
    torch.bfloat16: 2.0**-7,
    torch.float16: 2.0**-10,
}

DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

# name -> SDPA backend forced with torch.nn.attention.sdpa_kernel; "sdpa" lets torch choose.
SDPA_BACKENDS = {"sdpa-flash": "FLASH_ATTENTION", "sdpa-cudnn": "CUDNN_ATTENTION",
                 "sdpa-efficient": "EFFICIENT_ATTENTION", "sdpa-math": "MATH"}
IMPLS = ("ours", "ours-det", "sdpa") + tuple(SDPA_BACKENDS)


# ----------------------------------------------------------------------------------------- FLOPs
def attention_flops(batch, heads, len_q, len_k, head_dim, causal, mode="fwd"):
    """FLOPs of one pass: mode 'fwd', 'bwd' (2.5× fwd) or 'fwd_bwd' (3.5× fwd)."""
    fwd = 4.0 * batch * heads * len_q * len_k * head_dim * (0.5 if causal else 1.0)
    return fwd * {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}[mode]


def tflops(flops, ms):
    return flops / (ms * 1e-3) / 1e12 if ms and ms > 0 else float("nan")


# ----------------------------------------------------------------------------------- impls, inputs
def get_attention(name, enable_gqa=False):
    """Attention callable f(q, k, v, is_causal) on (B, H, L, E) for an entry of IMPLS; with enable_gqa
    the K / V heads may divide the query heads (SDPA's enable_gqa)."""
    if name == "ours":
        import flashattn_ext
        return lambda q, k, v, is_causal: flashattn_ext.scaled_dot_product_attention(q, k, v, is_causal=is_causal,
                                                                                      enable_gqa=enable_gqa)
    if name == "ours-det":  # ours with deterministic=True (bitwise-reproducible backward)
        import flashattn_ext
        return lambda q, k, v, is_causal: flashattn_ext.flash_attn_func(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=is_causal, deterministic=True).transpose(1, 2)
    if name == "sdpa":
        return lambda q, k, v, is_causal: F.scaled_dot_product_attention(q, k, v, is_causal=is_causal,
                                                                         enable_gqa=enable_gqa)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = getattr(SDPBackend, SDPA_BACKENDS[name])

    def forced(q, k, v, is_causal):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=enable_gqa)
    return forced


def quantize_fp8(x, dtype, per_head):
    """x (B, L, H, E) as float8 `dtype` scaled to its range, and the descale of FlashAttention-3's float8 API:
    per tensor (a float) or per (batch, head) (a float32 (B, H) tensor)."""
    x = x.detach()
    amax = (x.abs().amax(dim=(1, 3)) if per_head else x.abs().max()).float().clamp_min(1e-12)
    descale = amax / torch.finfo(dtype).max
    scaled = x / (descale[:, None, :, None] if per_head else descale)
    return scaled.to(dtype), (descale if per_head else descale.item())


def float8_call(q, k, v, causal):
    """A no-argument call of flash_attn_func on e4m3 copies of q, k, v (B, H, L, E), each scaled per (batch, head)
    to e4m3's range with FlashAttention-3's descales (the copies made here, once)."""
    import flashattn_ext
    (q8, qd), (k8, kd), (v8, vd) = (quantize_fp8(x.transpose(1, 2), torch.float8_e4m3fn, per_head=True)
                                    for x in (q, k, v))
    return lambda: flashattn_ext.flash_attn_func(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)


def make_inputs(batch, heads, length, head_dim, dtype, device, seed=0):
    """q, k, v (requiring grad) and dout, all (B, H, L, E), standard normal, drawn on `device` (a grid's
    134 M values per row took ~2 s on a 2-core CPU)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (batch, heads, length, head_dim)
    q, k, v, dout = (torch.randn(shape, generator=gen, dtype=torch.float32, device=device).to(dtype=dtype)
                     for _ in range(4))
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), dout


def fwd_bwd_fn(attn, q, k, v, dout, causal):
    """One forward + backward; gradients are returned (not accumulated into .grad)."""
    def run():
        out = attn(q, k, v, causal)
        return torch.autograd.grad(out, (q, k, v), dout)
    return run


def bwd_only_fn(attn, q, k, v, dout, causal):
    """Backward alone, replayed on a retained graph of one forward."""
    out = attn(q, k, v, causal)
    return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)


# ------------------------------------------------------------------------------------------ timing
def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (saying so) where matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not importable: no plots")
        return None
    return plt


def save_plot(plt, fig, path, dpi):
    """Lays out, writes and closes fig; returns path."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def median_ms(fn, device, warmup=2, repeats=10, min_repeats=2, budget_s=None, warmup_s=0.0):
    """Median wall time of fn() in ms. With budget_s, repeats shrink (not below min_repeats) so the
    timed calls take about budget_s, judged from the last warm-up call. warmup_s: warm-up calls go on
    until they have taken at least that long (a GPU needs ~0.1 s of load to reach its clocks again
    after a pause: rows of ~0.1 ms measured 20-40% slow after 5 calls of warm-up)."""
    cuda = torch.device(device).type == "cuda"
    est = None
    start, done = time.perf_counter(), 0
    while done < max(1, warmup) or time.perf_counter() - start < warmup_s:
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        est = time.perf_counter() - t0
        done += 1
    if budget_s is not None:
        repeats = max(min_repeats, min(repeats, int(budget_s / max(est, 1e-9))))
    times = []
    if cuda:
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(repeats)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        times = [start.elapsed_time(end) for start, end in events]
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def graph_replay(fn, steps=16, **capture_kwargs):
    """A callable that replays `steps` calls of fn captured back to back in one CUDA graph (fn must have run
    once outside the capture, for its lazy initialisation), with a `steps` attribute: median_ms of it over
    steps is a call's GPU time without launch latency. (With one call per replay, calls of ~15 µs measured the
    kernels alone in some processes and the kernels plus the replay's launch latency in others.)"""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, **capture_kwargs):
        for _ in range(steps):
            fn()

    def replay():
        graph.replay()
    replay.steps = steps
    return replay


def per_call_ms(fn, device, *args, **kwargs):
    """median_ms of fn per call of what it runs (a graph_replay's replay runs `steps` calls)."""
    return median_ms(fn, device, *args, **kwargs) / getattr(fn, "steps", 1)


# ------------------------------------------------------------------------------------ CUDA memory
def cuda_peak_extra_bytes(fn):
    """Peak CUDA memory of fn() above what was allocated before (inputs already allocated)."""
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


# ------------------------------------------------------------------------------------- CPU memory
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def _hwm_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmHWM in /proc/self/status")


def _reset_hwm():
    """Reset the kernel's resident-set peak to the current RSS (Linux >= 4.0); False if not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _measure_case_here(impl, dtype, shape, causal):
    """Runs in the measuring process. Returns (peak_extra_bytes, exact)."""
    attn = get_attention(impl)
    fwd_bwd_fn(attn, *make_inputs(1, 1, 16, shape[3], DTYPES[dtype], "cpu"), causal)()  # load libs, threads
    q, k, v, dout = make_inputs(*shape, DTYPES[dtype], "cpu")
    run = fwd_bwd_fn(attn, q, k, v, dout, causal)
    gc.collect()
    exact = _reset_hwm()
    base = _rss_bytes()
    peak_before = _hwm_bytes() if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    grads = run()
    peak = _hwm_bytes() if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    del grads
    # Without a resettable peak, an unchanged maxrss means the call stayed under an older peak:
    # the growth is then only an upper bound.
    return max(0, peak - base), exact or peak > peak_before


def _parse_case(text):
    parts = text.split(":")
    impl, dtype, shape = parts[0], parts[1], tuple(int(x) for x in parts[2].split(","))
    if impl not in IMPLS or dtype not in DTYPES or len(shape) != 4 or parts[3:] not in ([], ["causal"]):
        raise ValueError(f"bad case {text!r}: want IMPL:DTYPE:B,H,L,E[:causal], IMPL in {IMPLS}, "
                         f"DTYPE in {tuple(DTYPES)}")
    return impl, dtype, shape, parts[3:] == ["causal"]


def case_string(impl, dtype, shape, causal):
    return f"{impl}:{dtype}:{','.join(map(str, shape))}" + (":causal" if causal else "")


def cpu_peak_extra_bytes(cases, timeout_s=1800):
    """Peak extra CPU memory (bytes) of one fwd+bwd for each case (impl, dtype, (B,H,L,E), causal),
    measured in one fresh process. glibc's mmap threshold is fixed there so that freed large
    blocks go back to the OS at once, which keeps cases in one process independent. Returns a
    list of dicts {case, bytes, exact}."""
    cases = [case_string(*c) for c in cases]
    if not cases:
        return []
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072")
    cmd = [sys.executable, "-m", "flashattn_ext._measure", "--json"]
    for c in cases:
        cmd += ["--case", c]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"memory measurement failed ({' '.join(cmd)}):\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None):
    parser = argparse.ArgumentParser(description="Peak extra CPU memory of one attention fwd+bwd per case, "
                                                 "measured in this (fresh) process.")
    parser.add_argument("--case", action="append", required=True, help="IMPL:DTYPE:B,H,L,E[:causal]")
    parser.add_argument("--json", action="store_true", help="print one JSON list instead of lines")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    results = []
    for text in args.case:
        nbytes, exact = _measure_case_here(*_parse_case(text))
        results.append({"case": text, "bytes": nbytes, "exact": exact})
        if not args.json:
            print(f"{text:40s} {nbytes / 2**20:10.1f} MiB{'' if exact else ' (upper bound)'}", flush=True)
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()

"""python -m flashattn_ext: check and time attention on the best device here, beside torch SDPA.

For each problem: out and dq, dk, dv of ours and of torch SDPA (same dtype) against a float64
reference; a row per impl with max abs error, forward ms, forward+backward ms and peak extra
memory of forward+backward. Exit status 1 when ours breaks the accuracy rule (DESIGN.md §4):
max|ours - ref| <= 2 * max|torch - ref| + atol, for each of out, dq, dk, dv, with
atol = rel_atol * max(max|ref|, 1) and the slack of _measure.REL_ATOL / REL_ATOL_GRAD."""
import argparse
import sys

import torch

import flashattn_ext
from flashattn_ext import _measure as M


# (dtype name, B, H, L, E)
PROBLEMS = {"cpu": [("fp32", 1, 8, 1024, 64)],
            "cuda": [("bf16", 4, 16, 4096, 128), ("fp32", 4, 16, 4096, 128)]}


def reference(q, k, v, dout, causal, chunk_bytes=1 << 30):
    """float64 out, dq, dk, dv by plain softmax(q k^T * scale) v, over chunks of (batch, head)."""
    b, h, lq, e = q.shape
    lk = k.shape[2]
    flat = [t.detach().reshape(b * h, t.shape[2], t.shape[3]).double() for t in (q, k, v, dout)]
    mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril() if causal else None
    step = max(1, chunk_bytes // (8 * lq * lk * 4))
    results = [[] for _ in range(4)]
    for i in range(0, b * h, step):
        qc, kc, vc = (t[i:i + step].clone().requires_grad_() for t in flat[:3])
        scores = qc @ kc.transpose(-1, -2) / e ** 0.5
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        out = scores.softmax(-1) @ vc
        grads = torch.autograd.grad(out, (qc, kc, vc), flat[3][i:i + step])
        for acc, t in zip(results, (out.detach(),) + grads):
            acc.append(t)
    return [torch.cat(acc).reshape(b, h, -1, acc[0].shape[-1]) for acc in results]


def max_errors(attn, q, k, v, dout, causal, ref):
    out = attn(q, k, v, causal)
    got = (out,) + torch.autograd.grad(out, (q, k, v), dout)
    return [(g.double() - r).abs().max().item() for g, r in zip(got, ref)]


def peak_bytes(device, impls, dtype_name, shape, causal, inputs):
    if device == "cuda":
        return [M.cuda_peak_extra_bytes(M.fwd_bwd_fn(M.get_attention(i), *inputs, causal)) for i in impls]
    cases = [(i, dtype_name, shape, causal) for i in impls]
    return [r["bytes"] for r in M.cpu_peak_extra_bytes(cases)]


def run_problem(device, dtype_name, shape, causal):
    dtype = M.DTYPES[dtype_name]
    inputs = M.make_inputs(*shape, dtype, device)
    ref = reference(*inputs, causal)
    impls = ("ours", "sdpa")
    errors = {i: max_errors(M.get_attention(i), *inputs, causal, ref) for i in impls}
    rel_out, rel_grad = M.REL_ATOL[dtype], M.REL_ATOL_GRAD[dtype]
    atol = [rel * max(r.abs().max().item(), 1.0) for rel, r in zip((rel_out,) + (rel_grad,) * 3, ref)]
    bound = [2 * t + a for t, a in zip(errors["sdpa"], atol)]
    ok = all(o <= b for o, b in zip(errors["ours"], bound))
    budget = 1.0 if device == "cpu" else None
    times = {}
    for i in impls:
        attn = M.get_attention(i)
        fwd = M.median_ms(lambda: attn(*inputs[:3], causal), device, budget_s=budget)
        both = M.median_ms(M.fwd_bwd_fn(attn, *inputs, causal), device, budget_s=budget)
        times[i] = (fwd, both)
    peaks = dict(zip(impls, peak_bytes(device, impls, dtype_name, shape, causal, inputs)))

    b, h, l, e = shape
    print(f"\n{dtype_name} B={b} H={h} L={l} E={e} causal={causal} on {device}   "
          f"errors vs float64 reference: out / dq / dk / dv")
    print(f"  {'impl':6s} {'max abs error (out, dq, dk, dv)':44s} {'fwd ms':>9s} {'fwd+bwd ms':>11s} "
          f"{'peak extra MiB':>15s}")
    for i in impls:
        errs = " ".join(f"{x:.2e}" for x in errors[i])
        print(f"  {i:6s} {errs:44s} {times[i][0]:9.2f} {times[i][1]:11.2f} {peaks[i] / 2**20:15.1f}")
    verdict = "OK" if ok else "FAIL"
    print(f"  {'bound':6s} {' '.join(f'{x:.2e}' for x in bound):44s} "
          f"rule: max|ours-ref| <= 2*max|sdpa-ref| + atol  -> {verdict}")
    return ok


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m flashattn_ext", description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when usable, else cpu")
    args = parser.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() and flashattn_ext.has_cuda_kernels() else "cpu")
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    else:
        print(f"device: cpu ({torch.get_num_threads()} threads), torch {torch.__version__}")
    ok = True
    for dtype_name, *shape in PROBLEMS[device]:
        for causal in (False, True):
            ok &= run_problem(device, dtype_name, tuple(shape), causal)
    print("\nall problems within the accuracy rule" if ok else "\nACCURACY RULE BROKEN (see FAIL above)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

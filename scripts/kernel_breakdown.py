"""Per-kernel GPU time of one forward and one backward call, ours beside SDPA backends, from
torch.profiler: shows what the small kernels around the main ones (D = rowsum(dO * O), the
dQ conversion, memsets) cost next to it. On a GPU machine:

    python3 scripts/kernel_breakdown.py --head-dims 64,128 --lens 1024,4096 --impls ours,sdpa-flash
"""
import argparse
import collections

import torch
from torch.profiler import ProfilerActivity, profile

from flashattn_ext import _measure as M

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--dtype", default="bf16")
p.add_argument("--head-dims", default="64,128")
p.add_argument("--lens", default="1024,4096")
p.add_argument("--causal", type=int, default=0)
p.add_argument("--impls", default="ours,sdpa-flash")
p.add_argument("--calls", type=int, default=5, help="profiled calls per case (times are per call)")
args = p.parse_args()
dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
torch.backends.cuda.matmul.allow_tf32 = False  # (fp32: as in benchmarks/bench_gpu.py)
torch.backends.cudnn.allow_tf32 = False

for E in map(int, args.head_dims.split(",")):
    for L in map(int, args.lens.split(",")):
        B, H = max(1, 16384 // L), 2048 // E
        q, k, v, dout = M.make_inputs(B, H, L, E, dtype, "cuda")
        for impl in args.impls.split(","):
            attn = M.get_attention(impl)
            fwd = lambda: attn(q, k, v, bool(args.causal))  # noqa: E731
            bwd = M.bwd_only_fn(attn, q, k, v, dout, bool(args.causal))
            for name, fn in (("fwd", fwd), ("bwd", bwd)):
                for _ in range(3):
                    fn()
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(args.calls):
                        fn()
                    torch.cuda.synchronize()
                per_kernel = collections.Counter()
                for e in prof.events():
                    if e.device_type == torch.autograd.DeviceType.CUDA:
                        per_kernel[e.name[:70]] += e.device_time / args.calls
                total = sum(per_kernel.values())
                print(f"{args.dtype} E={E} L={L} B={B} H={H} causal={args.causal} {impl} {name}: "
                      f"{total / 1000:.3f} ms on the GPU")
                for kname, us in per_kernel.most_common():
                    print(f"    {us:9.1f} us  {100 * us / total:5.1f}%  {kname}")

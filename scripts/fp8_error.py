"""Max abs error of the float8 forward (flash_attn_func with q_descale, k_descale, v_descale) on
unit-scale inputs, against an fp32 reference: attention in fp32 on the dequantized tensors (the
error of the computation), and on the unquantized inputs (the quantization's error too); beside
it the bf16 call on the same inputs. Prints a markdown table.

    python3 scripts/fp8_error.py [--device cuda] [--dtype e4m3|e5m2]"""
import argparse

import torch
import torch.nn.functional as F

from flashattn_ext import flash_attn_func
from flashattn_ext._measure import quantize_fp8 as quantize

FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def dequantize(x8, descale):
    d = descale[:, None, :, None] if isinstance(descale, torch.Tensor) else descale
    return x8.float() * d


def reference(q, k, v, causal):
    """fp32 attention, flash_attn_func's layout and bottom-right causal mask (L = S here)."""
    out = F.scaled_dot_product_attention(*(t.float().transpose(1, 2) for t in (q, k, v)), is_causal=causal)
    return out.transpose(1, 2)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="e4m3", choices=sorted(FP8))
    args = parser.parse_args()
    dtype = FP8[args.dtype]
    torch.manual_seed(0)
    print("| B, L, H, E | causal | descales | fp8 vs fp32 on dequantized | fp8 vs fp32 on unquantized "
          "| bf16 vs fp32 |")
    print("|---|:---:|---|---:|---:|---:|")
    for batch, length, heads, dim in ((2, 512, 4, 64), (1, 1024, 4, 128), (1, 512, 2, 256)):
        q, k, v = (torch.randn(batch, length, heads, dim, device=args.device) for _ in range(3))
        for causal in (False, True):
            ref = reference(q, k, v, causal)
            bf16 = flash_attn_func(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=causal).float()
            for per_head in (False, True):
                (q8, qd), (k8, kd), (v8, vd) = (quantize(t, dtype, per_head) for t in (q, k, v))
                out = flash_attn_func(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd).float()
                ref_deq = reference(dequantize(q8, qd), dequantize(k8, kd), dequantize(v8, vd), causal)
                print(f"| {batch}, {length}, {heads}, {dim} | {'yes' if causal else 'no'} | "
                      f"{'per head' if per_head else 'per tensor'} | {(out - ref_deq).abs().max():.2e} | "
                      f"{(out - ref).abs().max():.2e} | {(bf16 - ref).abs().max():.2e} |")


if __name__ == "__main__":
    main()

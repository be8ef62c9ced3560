"""Writes the translation units that instantiate the CUDA kernel templates: one .cu per
(family, head-dim tier), each instantiating the family's templates for the dtypes that tier
serves. The table below is the whole list; a new tier or dtype is one entry.

    python scripts/generate_kernels.py           # (re)write the files
    python scripts/generate_kernels.py --check   # fail if a committed file differs (CI)
"""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINE = 110  # instantiations longer than this wrap after the last ", " that fits

F64, F32, BF16, F16, E4M3 = "double", "float", "__nv_bfloat16", "__half", "__nv_fp8_e4m3"
HALF = (BF16, F16)

# family: (folder, file prefix, header, namespace, declarations: ({T} dtype, {D} tier) per (dtype, tier),
#          {tier: (dtypes, description of the tier in the file's first line)})
FAMILIES = {
    "simt_fwd": ("simt", "fwd_simt", "fwd_simt.cuh", "simt",
                 lambda t, d: ["void fwd<{T}, {D}>(const FwdParams&, int, cudaStream_t)"],
                 {d: ((F64, F32) + HALF if d == 128 else (F32,) + HALF,
                      f"Forward SIMT kernels, output-column tier {d}.") for d in (32, 64, 128, 256)}),
    "simt_fwd_qres": ("simt", "fwd_simt_qres", "fwd_simt_qres.cuh", "simt",
                      lambda t, d: ["bool fwd_qres<{T}, {D}>(const FwdParams&, FwdKernel, int, cudaStream_t)"],
                      {64: ((F32,), "Q-resident forward SIMT kernels (fp32), head dims up to 64."),
                       128: ((F32,) + HALF, "Q-resident forward SIMT kernels, head dims up to 128.")}),
    "simt_bwd": ("simt", "bwd_simt", "bwd_simt.cuh", "simt",
                 lambda t, d: ["void bwd_dkdv<{T}, {D}>(const BwdParams&, const void*, void*, int, cudaStream_t)",
                            "void bwd_dq<{T}, {D}>(const BwdParams&, const void*, int, cudaStream_t)"],
                 {d: ((F64, F32) + HALF if d == 64 else (F32,) + HALF,
                      f"Backward SIMT kernels, output-column tier {d}.") for d in (32, 64, 128)}),
    "simt_bwd_kvres": ("simt", "bwd_simt_kvres", "bwd_simt_kvres.cuh", "simt",
                       lambda t, d: ["bool bwd_dkdv_kvres<{T}, {D}>(const BwdParams&, const void*, void*, cudaStream_t)"],
                       {d: ((F32,) + HALF, f"dK/dV SIMT kernel with the key tile resident in smem, head dims up "
                                           f"to {d}.") for d in (64, 128)}),
    "sm80_fwd": ("sm80", "fwd_sm80", "fwd_sm80.cuh", "sm80",
                 lambda t, d: ["bool fwd<{T}, {D}>(const FwdParams&, FwdKernel, cudaStream_t)"] + (
                     ["size_t fwd_workspace_bytes<{T}, {D}>(const FwdParams&, FwdKernel)"] if t in HALF else []),
                 {32: (HALF, "Tensor-core forward kernels, head dims up to 32 (fp16/bf16): half the dim-64 products."),
                  64: ((F64,) + HALF, "Tensor-core forward kernels, head dims up to 64."),
                  96: (HALF, "Tensor-core forward kernels, head dims 65..96 (fp16/bf16): 3/4 of the dim-128 products."),
                  128: ((F64,) + HALF, "Tensor-core forward kernels, head dims up to 128."),
                  192: (HALF, "Tensor-core forward kernels, head dims 129..192 (fp16/bf16): 3/4 of the dim-256 "
                              "products."),
                  256: (HALF, "Tensor-core forward kernels, head dims up to 256 (fp16/bf16; fp64 accumulators would "
                              "not fit).")}),
    "sm80_bwd": ("sm80", "bwd_sm80", "bwd_sm80.cuh", "sm80",
                 lambda t, d: ["bool bwd_dkdv<{T}, {D}>(const BwdParams&, BwdKernel, const void*, const DqAccum&, "
                            "const DkDvTail&, cudaStream_t)"],
                 {32: (HALF, "Tensor-core dK/dV/dQ kernels, head dims up to 32 (fp16/bf16)."),
                  64: ((F64,) + HALF, "Tensor-core dK/dV/dQ kernels, head dims up to 64."),
                  96: (HALF, "Tensor-core dK/dV/dQ kernels, head dims 65..96 (fp16/bf16)."),
                  128: ((F64,) + HALF, "Tensor-core dK/dV/dQ kernels, head dims up to 128."),
                  192: (HALF, "Tensor-core dK/dV/dQ kernels, head dims 129..192 (fp16/bf16), output columns split in "
                              "two."),
                  256: (HALF, "Tensor-core dK/dV/dQ kernels, head dims up to 256 (fp16/bf16), output columns split "
                              "in two.")}),
    # (a file per head dim: the forward's kernels compiled in parallel; dim 64 also with three consumers)
    "sm90_fwd": ("sm90", "fwd_sm90", "fwd_sm90.cuh", "sm90",
                 lambda t, d: [f"bool {f}<{{T}}, {{D}}, {c}>({args})" for c in ((2, 3) if d == 64 else (2,))
                               for f, args in (("fwd_ws_ready", "const FwdParams&, FwdMaps&"),
                                               ("fwd_wgmma", "const FwdParams&, const FwdMaps&, cudaStream_t"))],
                 {64: (HALF, "Hopper forward (wgmma, warp-specialized), head dim 64: two or three consumers."),
                  96: (HALF, "Hopper forward (wgmma, warp-specialized), head dim 96."),
                  128: (HALF + (E4M3,), "Hopper forward (wgmma, warp-specialized), head dim 128 (float8 e4m3 too)."),
                  256: (HALF, "Hopper forward (wgmma, warp-specialized), head dim 256.")}),
}


def wrap(line):
    """line, broken after the last ", " that fits LINE columns, continuations aligned after "("."""
    indent = " " * (line.index("(") + 1)
    out = []
    while len(line) > LINE:
        cut = line.rindex(", ", 0, LINE - 1) + 2
        out.append(line[:cut].rstrip())
        line = indent + line[cut:]
    return "\n".join(out + [line])


def translation_unit(header, namespace, declarations, dtypes, description):
    lines = [f"// {description}", f'#include "{header}"', "", f"namespace flashattn::cuda::{namespace} {{"]
    for dtype, tier in dtypes:
        lines += [wrap("template " + d.format(T=dtype, D=tier) + ";") for d in declarations(dtype, tier)]
    return "\n".join(lines + [f"}}  // namespace flashattn::cuda::{namespace}", ""])


def files():
    """{path relative to the repository: contents}"""
    out = {}
    for folder, prefix, header, namespace, declarations, tiers in FAMILIES.values():
        for tier, (dtypes, description) in tiers.items():
            path = os.path.join("csrc", "cuda", folder, f"{prefix}_hdim{tier}.cu")
            out[path] = translation_unit(header, namespace, declarations, [(t, tier) for t in dtypes], description)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the committed files, write nothing")
    args = parser.parse_args()
    stale = []
    for path, text in files().items():
        full = os.path.join(ROOT, path)
        current = open(full).read() if os.path.exists(full) else None
        if current == text:
            continue
        stale.append(path)
        if not args.check:
            with open(full, "w") as f:
                f.write(text)
    generated = set(files())
    strays = sorted(os.path.relpath(os.path.join(d, n), ROOT) for d, _, names in os.walk(os.path.join(ROOT, "csrc"))
                    for n in names if "_hdim" in n and n.endswith(".cu")
                    and os.path.relpath(os.path.join(d, n), ROOT) not in generated)
    if strays:
        print("generate_kernels: instantiation files the table does not list (add them to FAMILIES): "
              + ", ".join(strays))
        return 1
    if args.check and stale:
        print("generate_kernels: these files differ from what scripts/generate_kernels.py writes: " + ", ".join(stale))
        return 1
    print(f"generate_kernels: {len(files())} files, {len(stale)} {'differ' if args.check else 'written'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

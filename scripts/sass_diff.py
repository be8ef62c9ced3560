"""Which tensor-core kernels a change alters, without a GPU:

    python scripts/sass_diff.py [--ref REF] [FILE.cu ...]

compiles each file (default: every csrc/cuda/sm80/*.cu) as it is at git ref REF (default HEAD)
and as it is in the working tree, for sm_90a with sass_blocks.py's flags, and prints per kernel its
registers and spill bytes (ptxas) in both (kernels matched by name and template arguments), and
`same` where the two SASS listings are identical, else both instruction counts and, for their key
loops (sass_blocks.key_loop: the loop over key tiles), `loop same` where the loop's instructions are
identical (branch targets masked) or both loops' sizes. A change meant for one kernel should leave
the others `same`: one that moves another kernel's registers or key loop (docs/kernels/
sm80_forward.md: such moves cost 1-5%) shows here before it costs a device call.
"""
import argparse
import concurrent.futures
import glob
import os
import re
import subprocess
import tempfile

import sass_blocks as sb


def compile_file(root, rel, out_dir):
    """{kernel: (registers, spill bytes, [(address, SASS instruction)])} of one file."""
    cubin = os.path.join(out_dir, os.path.basename(rel) + ".cubin")
    flags = [f if not f.startswith("-I") else "-I" + os.path.join(root, "csrc") for f in sb.NVCC_FLAGS]
    ptxas = subprocess.run(["nvcc", *flags, "-Xptxas", "-v", os.path.join(root, rel), "-o", cubin],
                           check=True, capture_output=True, text=True).stderr
    usage, name = {}, None
    for line in ptxas.splitlines():
        m = re.search(r"Compiling entry function '(\S+)'", line)
        if m:
            name, spills = m.group(1), 0
        m = re.search(r"(\d+) bytes spill stores", line)
        if m and name:
            spills = int(m.group(1))
        m = re.search(r"Used (\d+) registers", line)
        if m and name:
            usage[name] = (int(m.group(1)), spills)
            name = None
    return {fn: usage.get(fn, (0, 0)) + (sb.instructions(body),) for fn, body in sb.cuobjdump_sass(cubin).items()}


def loop_text(lines):
    """The key loop's instructions (sass_blocks.key_loop; else the largest loop's), branch targets masked
    (code moved before the loop shifts them)."""
    loop = sb.key_loop(lines) or sb.largest_loop(lines)
    return [re.sub(r"0x[0-9a-f]+", "X", b) for a, b in lines if loop[0] <= a <= loop[1]] if loop else []


def short(fn):
    """The demangled name without its parameter list (template arguments may hold parentheses too)."""
    name = subprocess.run(["c++filt", fn], capture_output=True, text=True).stdout.strip() or fn
    if name.endswith(")"):
        depth = 0
        for i in range(len(name) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(name[i], 0)
            if depth == 0:
                name = name[:i]
                break
    return name.replace("flashattn::cuda::", "").replace("__nv_bfloat16", "bf16")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ref", default="HEAD")
    ap.add_argument("files", nargs="*")
    args = ap.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    files = args.files or sorted(glob.glob(os.path.join(root, "csrc/cuda/sm80/*.cu")))
    files = [os.path.relpath(os.path.abspath(f), root) for f in files]
    with tempfile.TemporaryDirectory() as tmp:
        ref_root = os.path.join(tmp, "ref")
        os.makedirs(ref_root)
        archive = subprocess.run(["git", "-C", root, "archive", args.ref, "csrc"], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", ref_root], input=archive, check=True)
        jobs = [(r, f, os.path.join(tmp, tag)) for f in files for tag, r in (("old", ref_root), ("new", root))]
        for _, _, d in jobs:
            os.makedirs(d, exist_ok=True)
        sb.tool_dir()  # (fetched once before the threads: two extracting the tools at once collide)
        with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
            results = list(pool.map(lambda j: compile_file(*j), jobs))
    changed = 0
    for i, f in enumerate(files):
        # Kernels matched by name and template arguments, so that a changed parameter list still
        # compares the two.
        old, new = ({short(fn): v for fn, v in r.items()} for r in (results[2 * i], results[2 * i + 1]))
        print(f"{f}:")
        for fn in sorted(set(old) | set(new)):
            if fn not in old or fn not in new:
                print(f"  {'added' if fn in new else 'removed':8} {fn}")
                changed += 1
                continue
            (r0, s0, l0), (r1, s1, l1) = old[fn], new[fn]
            same = [b for _, b in l0] == [b for _, b in l1]
            changed += not same
            k0, k1 = loop_text(l0), loop_text(l1)
            loop = "same" if k0 == k1 else f"{len(k0)} -> {len(k1)}"
            state = "same" if same else f"{len(l0)} -> {len(l1)} instr, loop {loop}"
            print(f"  regs {r0:3d} -> {r1:3d}  spills {s0:3d} -> {s1:3d}  {state:40}  {fn}")
    print(f"{changed} kernel(s) differ from {args.ref}")


if __name__ == "__main__":
    main()

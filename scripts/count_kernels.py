"""Counts the kernels (entry functions) a build holds for one architecture: compiles every .cu under
csrc/cuda to a cubin with scripts/compile_cuda.sh's flags and counts the ELF symbols marked as entry
points, by folder and by kernel template.

    python scripts/count_kernels.py [--arch 90a] [--jobs 2]
"""
import argparse
import collections
import glob
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = ["-std=c++17", "-O3", "--expt-relaxed-constexpr", "-Icsrc", "-D__CUDA_NO_HALF_OPERATORS__",
         "-D__CUDA_NO_HALF_CONVERSIONS__", "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__"]


def entries(cubin):
    """Mangled names of the entry functions of a cubin (ELF symbols with st_other 0x10)."""
    out = subprocess.run(["readelf", "-sW", cubin], capture_output=True, text=True).stdout
    return [line.split()[-1] for line in out.splitlines() if " FUNC " in line and "<other>: 10]" in line]


def template_name(mangled):
    """The kernel's name past flashattn::cuda (anonymous namespaces left out): the length-prefixed
    identifiers of its nested name, up to its template arguments."""
    if not mangled.startswith("_ZN"):
        return mangled
    parts, i = [], 3
    while i < len(mangled) and mangled[i].isdigit():
        j = i
        while mangled[j].isdigit():
            j += 1
        n = int(mangled[i:j])
        parts.append(mangled[j:j + n])
        i = j + n
    return "::".join(x for x in parts[2:] if not x.startswith("_GLOBAL__N_"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="90a")
    ap.add_argument("--jobs", type=int, default=os.cpu_count())
    args = ap.parse_args()
    nvcc = os.environ.get("NVCC", "nvcc")
    files = sorted(glob.glob(os.path.join(ROOT, "csrc", "cuda", "**", "*.cu"), recursive=True))
    with tempfile.TemporaryDirectory() as tmp:
        def build(path):
            cubin = os.path.join(tmp, os.path.relpath(path, ROOT).replace("/", "_") + ".cubin")
            subprocess.run([nvcc, *FLAGS, f"-arch=sm_{args.arch}", "-cubin", path, "-o", cubin], cwd=ROOT,
                           check=True)
            return path, entries(cubin)
        with ThreadPoolExecutor(args.jobs) as pool:
            results = list(pool.map(build, files))
    by_folder, by_template = collections.Counter(), collections.Counter()
    for path, names in results:
        by_folder[os.path.relpath(os.path.dirname(path), os.path.join(ROOT, "csrc", "cuda")) or "."] += len(names)
        for name in names:
            by_template[template_name(name)] += 1
    total = sum(by_folder.values())
    print(f"sm_{args.arch}: {total} kernels in {len(files)} files")
    for folder, n in sorted(by_folder.items()):
        print(f"  {folder:8s} {n}")
    for name, n in by_template.most_common():
        print(f"  {n:4d}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

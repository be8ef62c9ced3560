"""SASS of one kernel, per basic block, without a GPU: what a loop executes per iteration.

    python scripts/sass_blocks.py csrc/cuda/sm80/bwd_sm80_hdim128.cu bwd_dkdv_kernelI13__nv_bfloat16Li128ELb0

compiles the file for sm_90a with nvcc (the flags of scripts/compile_cuda.sh), disassembles it
with cuobjdump (which runs nvdisasm), picks the first function whose mangled name contains the given text, and prints
for its key loop (the shortest backward branch's range that holds a tensor-core product: a persistent kernel's
loop over key tiles, not the one over its work items), else its largest loop, each basic block: address,
instruction count and the most frequent opcodes. cuobjdump and nvdisasm are taken from PATH, else from the
nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm wheels, fetched once with pip into
~/.cache/flashattn_sass (the CUDA toolkit on the development machine has nvcc and ptxas only).
"""
import collections
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NVCC_FLAGS = ["-std=c++17", "-O3", "--expt-relaxed-constexpr", "-I" + os.path.join(ROOT, "csrc"),
              "-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
              "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__",
              "-DFLASHATTN_SM90A", "-gencode=arch=compute_90a,code=sm_90a", "-cubin"]  # (sm_90a: the wgmma kernels too)


def tool_dir():
    """A directory holding cuobjdump and nvdisasm, or None when both are on PATH."""
    if shutil.which("cuobjdump") and shutil.which("nvdisasm"):
        return None
    cache = os.path.expanduser("~/.cache/flashattn_sass")
    found = lambda: glob.glob(os.path.join(cache, "**", "bin", "nvdisasm"), recursive=True)
    if not found():
        os.makedirs(cache, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-d", cache, "nvidia-cuda-cuobjdump",
                        "nvidia-cuda-nvdisasm"], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for wheel in glob.glob(os.path.join(cache, "nvidia_cuda_*.whl")):
            zipfile.ZipFile(wheel).extractall(cache)
    bin_dir = os.path.dirname(found()[0])
    for tool in ("cuobjdump", "nvdisasm"):
        os.chmod(os.path.join(bin_dir, tool), 0o755)
    return bin_dir


def cuobjdump_sass(cubin):
    """cuobjdump -sass of a cubin: {mangled function name: its SASS listing}."""
    env = dict(os.environ)
    extra = tool_dir()
    if extra:
        env["PATH"] = extra + os.pathsep + env["PATH"]
    text = subprocess.run(["cuobjdump", "-sass", cubin], check=True, capture_output=True, text=True, env=env).stdout
    return {body.split("\n")[0].strip(): body for body in re.split(r"\n\s*Function : ", text)[1:]}


def function_sass(cu_file, name_part):
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        subprocess.run(["nvcc", *NVCC_FLAGS, cu_file, "-o", cubin], check=True)
        functions = cuobjdump_sass(cubin)
    for name, body in functions.items():
        if name_part in name:
            return body
    sys.exit(f"sass_blocks: no function matching {name_part!r} in {cu_file}")


def instructions(body):
    """[(address, instruction text)] of a function's listing."""
    return [(int(m.group(1), 16), m.group(2).strip()) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", body)]


def largest_loop(ins):
    """(first, last) address of the longest backward branch's range, or None."""
    back = [(int(t, 16), a) for a, b in ins for t in re.findall(r"BRA[^;]*?0x([0-9a-f]+)", b) if int(t, 16) < a]
    return max(back, key=lambda x: x[1] - x[0]) if back else None


def key_loop(ins):
    """(first, last) address of the shortest backward branch's range that holds a tensor-core product
    (HMMA, HGMMA, QGMMA), or None."""
    back = [(int(t, 16), a) for a, b in ins for t in re.findall(r"BRA[^;]*?0x([0-9a-f]+)", b) if int(t, 16) < a]
    products = [a for a, b in ins if re.search(r"\b(HMMA|HGMMA|QGMMA)\b", b)]
    holding = [(lo, hi) for lo, hi in back if any(lo <= a <= hi for a in products)]
    return min(holding, key=lambda x: x[1] - x[0]) if holding else None


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    body = function_sass(sys.argv[1], sys.argv[2])
    print(body.split("\n")[0])
    ins = instructions(body)
    targets = {int(t, 16) for _, b in ins for t in re.findall(r"BRA[^;]*?0x([0-9a-f]+)", b)}
    loop, kind = key_loop(ins), "key loop"
    if loop is None:
        loop, kind = largest_loop(ins), "largest loop"
    if loop is None:
        sys.exit("sass_blocks: no loop")
    lo, hi = loop
    print(f"{kind}: {hex(lo)} .. {hex(hi)}, {sum(lo <= a <= hi for a, _ in ins)} instructions")
    blocks, cur = [], None
    for a, b in ins:
        if not lo <= a <= hi:
            continue
        if cur is None or a in targets:
            cur = [a, collections.Counter()]
            blocks.append(cur)
        words = b.split()
        op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
        cur[1][op.split(".")[0]] += 1
        if "BRA" in b or "EXIT" in b:
            cur = None
    for a, ops in blocks:
        print(f"{hex(a):>8} {sum(ops.values()):5d}  " + " ".join(f"{k} {v}" for k, v in ops.most_common(8)))


if __name__ == "__main__":
    main()

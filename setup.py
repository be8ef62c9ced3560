"""Build of flashattn_ext: one extension, flashattn_ext._C, on the LibTorch stable ABI.

Environment:
  FLASHATTN_BUILD=auto|cpu|cuda  auto (default) builds the CUDA kernels when nvcc is found and
                                 torch is a CUDA build; cpu forces the CPU-only extension;
                                 cuda forces CUDA (and fails if it cannot be built).
  TORCH_CUDA_ARCH_LIST           CUDA architectures, e.g. "8.0;9.0"; default below.
  MAX_JOBS                       parallel compile jobs (honoured by torch's ninja build).
"""
import glob
import os
import platform
import shutil

import torch
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

# Every architecture nvcc 13 supports that these kernels serve (sm_75 and up).
DEFAULT_CUDA_ARCHS = "7.5;8.0;8.6;8.9;9.0;10.0;12.0"

HERE = os.path.dirname(os.path.abspath(__file__))
# Stable ABI of torch 2.10 and the Python 3.9 limited API: one build loads in any later torch/CPython.
TORCH_TARGET = "-DTORCH_TARGET_VERSION=0x020a000000000000"
PY_LIMITED = "-DPy_LIMITED_API=0x03090000"


X86 = platform.machine().lower() in ("x86_64", "amd64")
AVX512_SOURCE = "csrc/cpu/kernels_avx512.cpp"


def cxx_flags(msvc):
    """Host compiler flags: GCC/Clang spelling, or MSVC's (cl.exe) on Windows. x86-64 builds
    target AVX2 + FMA (any CPU from 2013 on); the AVX-512 kernels are built beside them
    (BuildWithAVX512) and picked at run time."""
    if msvc:
        flags = ["/O2", "/std:c++17", TORCH_TARGET, PY_LIMITED]
        return flags + ["/arch:AVX2", "-DFLASHATTN_HAVE_AVX512"] if X86 else flags
    flags = ["-O3", "-std=c++17", TORCH_TARGET, PY_LIMITED, "-fvisibility=hidden"]
    return flags + ["-mavx2", "-mfma", "-mf16c", "-DFLASHATTN_HAVE_AVX512"] if X86 else flags


def avx512_flags(msvc):
    return ["/arch:AVX512"] if msvc else ["-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512dq", "-fPIC"]


def object_current(obj, record, command):
    """Whether obj was built by `command` (as `record` holds it) and is newer than every file its
    dependency list (`record`'s other lines: the compiler's -MMD output) names."""
    if not (os.path.exists(obj) and os.path.exists(record)):
        return False
    with open(record) as f:
        lines = f.read().split("\n", 1)
    if lines[0] != command or len(lines) < 2:
        return False
    deps = lines[1].replace("\\\n", " ").split(":", 1)[-1].split()
    built = os.path.getmtime(obj)
    return all(os.path.exists(d) and os.path.getmtime(d) <= built for d in deps)


class BuildWithAVX512(BuildExtension):
    """Adds the host compiler flags in its spelling (the compiler is known only here), and
    compiles kernels_avx512.cpp on its own with AVX-512 flags (setuptools has no per-file
    flags) and links its object after all others: see the comment at the top of that file.
    With GCC / Clang that object is rebuilt only when its command or a file it includes changed
    (ninja does this for the other sources; a rebuild of a few kernels need not wait ~10 s for it)."""

    def build_extensions(self):
        msvc = self.compiler.compiler_type == "msvc"
        for ext in self.extensions:
            ext.extra_compile_args["cxx"] = cxx_flags(msvc) + ext.extra_compile_args["cxx"]
        if X86:
            for ext in self.extensions:
                flags = ext.extra_compile_args["cxx"] + avx512_flags(msvc)
                obj = self.compiler.object_filenames([AVX512_SOURCE], output_dir=self.build_temp)[0]
                deps = obj + ".d"
                command = "" if msvc else repr((self.compiler.compiler_so, ext.include_dirs, flags))
                if msvc or not object_current(obj, obj + ".record", command):
                    obj = self.compiler.compile([AVX512_SOURCE], output_dir=self.build_temp,
                                                include_dirs=ext.include_dirs,
                                                extra_postargs=flags + ([] if msvc else ["-MMD", "-MF", deps]))[0]
                    if not msvc:
                        with open(deps) as f, open(obj + ".record", "w") as record:
                            record.write(command + "\n" + f.read())
                ext.extra_objects += [obj]
        super().build_extensions()


def want_cuda():
    mode = os.environ.get("FLASHATTN_BUILD", "auto").lower()
    if mode not in ("auto", "cpu", "cuda"):
        raise ValueError(f"FLASHATTN_BUILD must be auto, cpu or cuda, got {mode!r}")
    possible = torch.version.cuda is not None and (
        shutil.which("nvcc") is not None or os.environ.get("CUDA_HOME") is not None)
    if mode == "cuda" and not possible:
        raise RuntimeError("FLASHATTN_BUILD=cuda needs nvcc and a CUDA build of torch")
    return possible if mode == "auto" else mode == "cuda"


def cuda_gencode_flags():
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST", DEFAULT_CUDA_ARCHS)
    flags = []
    for arch in archs.replace(",", ";").replace(" ", ";").split(";"):
        if not arch:
            continue
        num = arch.replace(".", "").replace("+PTX", "")
        # sm_90 code is built for sm_90a, whose wgmma the Hopper kernels use (an sm_90a cubin runs
        # on every sm_90 GPU: H100, H200, GH200); forward-compatible PTX stays plain compute_90.
        cubin = "90a" if num == "90" else num
        flags.append(f"-gencode=arch=compute_{cubin},code=sm_{cubin}")
        if cubin == "90a":  # the kernel plan may choose the wgmma kernels (csrc/cuda/dispatch.cu)
            flags.append("-DFLASHATTN_SM90A")
        if arch.endswith("+PTX"):
            flags.append(f"-gencode=arch=compute_{num},code=compute_{num}")
    return flags


def extension():
    rel = lambda pattern: sorted(os.path.relpath(p, HERE) for p in glob.glob(os.path.join(HERE, pattern), recursive=True))
    # The kernel plan (csrc/cuda/plan.cpp) is plain C++: built without CUDA too, for its tests.
    sources = rel("csrc/*.cpp") + rel("csrc/ops/*.cpp") + [p for p in rel("csrc/cpu/*.cpp") if p != AVX512_SOURCE] + rel("csrc/cuda/*.cpp")
    common = dict(name="flashattn_ext._C", sources=sources, py_limited_api=True)
    if not want_cuda():
        return CppExtension(extra_compile_args={"cxx": []}, **common)
    common["sources"] += rel("csrc/cuda/**/*.cu")
    nvcc = ["-O3", "-std=c++17", TORCH_TARGET, "--expt-relaxed-constexpr", "-lineinfo"] + cuda_gencode_flags()
    return CUDAExtension(extra_compile_args={"cxx": ["-DFLASHATTN_WITH_CUDA"],
                                             "nvcc": nvcc + ["-DFLASHATTN_WITH_CUDA"]},
                         define_macros=[("USE_CUDA", None)], **common)


setup(
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildWithAVX512},
    options={"bdist_wheel": {"py_limited_api": "cp39"}},
)

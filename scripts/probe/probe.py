"""Does this torch carry an exception out of a stable-ABI kernel? Builds tiny ops that throw
(probe.cpp) and calls them. torch 2.13 raises RuntimeError for each; torch 2.11 (CUDA 13.0
build, Python 3.12) segfaults at the first, catch3, whose exception never leaves the kernel:
there a throw crashes even when it is caught, and so did formatting a number through a
std::ostream (csrc/ops/ does neither), while a regular (non-stable) op that throws works
(plain.py). Run from the repository root: python scripts/probe/probe.py [cflags]."""
import faulthandler, sys, torch
from torch.utils import cpp_extension
faulthandler.enable()
flags = sys.argv[1:]
path = cpp_extension.load("probe_ext", ["scripts/probe/probe.cpp"], extra_cflags=["-O2", "-std=c++17"] + flags,
                          is_python_module=False, verbose=False)
for name, call in [("catch3", lambda: torch.ops.probe.catch3(1)), ("throw2", lambda: torch.ops.probe.throw2(1)), ("throw1", lambda: torch.ops.probe.throw1(torch.ones(2))),
                   ("throw0", lambda: torch.ops.probe.throw0())]:
    print(name, flush=True)
    try:
        call()
    except RuntimeError as e:
        print("  raised", str(e)[:60], flush=True)

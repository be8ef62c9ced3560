"""Control for probe.py: the same throws from a regular TORCH_LIBRARY op (not stable ABI)."""
import faulthandler, torch
from torch.utils import cpp_extension
faulthandler.enable()
cpp_extension.load("plain_ext", ["scripts/probe/plain.cpp"], is_python_module=False)
for name in ["plain_throw", "plain_std"]:
    print(name, flush=True)
    try:
        getattr(torch.ops.plainprobe, name)(1)
    except RuntimeError as e:
        print("  raised", str(e)[:50], flush=True)

"""Argument checks of flashattn::fwd, in Python, with the messages of csrc/ops.cpp.

csrc/ops.cpp checks every call of the op and stays the contract. These run first on the
public API and in the fake kernels: torch.compile then reports bad input at trace time, and
a bad argument never reaches the C++ kernel, whose exceptions some torch builds fail to
carry across the stable ABI (torch 2.11 segfaults on any exception a stable-ABI kernel
throws; scripts/probe reproduces it; torch 2.13 raises it)."""
import torch

MAX_HEAD_DIM = 256
DTYPE_NAMES = {torch.float64: "float64", torch.float32: "float32", torch.bfloat16: "bfloat16",
               torch.float16: "float16"}


def _dtype_name(dtype):
    return DTYPE_NAMES.get(dtype) or str(dtype).replace("torch.", "")


def _shape(t):
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _check_tensor(t, name):
    if t.dim() != 4:
        raise RuntimeError(f"flashattn: argument '{name}' must have 4 dimensions (batch, heads, seq_len, head_dim), "
                           f"got shape {_shape(t)}")
    if t.shape[3] > 1 and t.numel() > 0 and t.stride(3) != 1:
        raise RuntimeError(f"flashattn: argument '{name}' must have a contiguous last dimension (stride 1), got "
                           f"stride {t.stride(3)} for shape {_shape(t)}; call .contiguous() on it first")
    if t.dtype not in DTYPE_NAMES:
        raise RuntimeError(f"flashattn: argument '{name}' has dtype {_dtype_name(t.dtype)}; supported dtypes are "
                           f"float64, float32, bfloat16 and float16")


def _check_same_device(ref, ref_name, t, name):
    if t.device != ref.device:
        raise RuntimeError(f"flashattn: argument '{name}' is on device {t.device} but '{ref_name}' is on "
                           f"{ref.device}; they must be on the same device")


def _check_same(ref, ref_name, t, name):
    if t.dtype != ref.dtype:
        raise RuntimeError(f"flashattn: argument '{name}' has dtype {_dtype_name(t.dtype)} but '{ref_name}' has "
                           f"dtype {_dtype_name(ref.dtype)}; they must match")
    _check_same_device(ref, ref_name, t, name)


def check_same_device(**tensors):
    """All given tensors (None skipped) on one device. The fake kernels also run when real
    and meta tensors are mixed; this refuses that as the real kernels refuse mixed devices."""
    (ref_name, ref), *rest = [(n, t) for n, t in tensors.items() if t is not None]
    for name, t in rest:
        _check_same_device(ref, ref_name, t, name)


def _check_size(t, name, dim, expected, what):
    if t.shape[dim] != expected:
        raise RuntimeError(f"flashattn: argument '{name}' has {what} {t.shape[dim]} (shape {_shape(t)}) but "
                           f"{expected} was expected")


def check_fwd_args(q, k, v, causal):
    """The checks of check_qkv in csrc/ops.cpp."""
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        _check_tensor(t, name)
    _check_same(q, "q", k, "k")
    _check_same(q, "q", v, "v")
    batch, heads_q, _, head_dim = q.shape
    heads_kv, len_k = k.shape[1], k.shape[2]
    _check_size(k, "k", 0, batch, "batch size")
    _check_size(v, "v", 0, batch, "batch size")
    _check_size(v, "v", 1, heads_kv, "number of heads (must equal k's)")
    _check_size(v, "v", 2, len_k, "sequence length (must equal k's)")
    _check_size(k, "k", 3, head_dim, "head_dim (must equal q's)")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise RuntimeError(f"flashattn: head_dim of q and k must be between 1 and {MAX_HEAD_DIM}, got {head_dim}")
    if not 1 <= v.shape[3] <= MAX_HEAD_DIM:
        raise RuntimeError(f"flashattn: head_dim of v must be between 1 and {MAX_HEAD_DIM}, got {v.shape[3]}")
    if not ((heads_kv == 0 and heads_q == 0) or (heads_kv > 0 and heads_q % heads_kv == 0)):
        raise RuntimeError(f"flashattn: the number of query heads ({heads_q}) must be a multiple of the number of "
                           f"key/value heads ({heads_kv})")
    if causal not in (0, 1, 2):
        raise RuntimeError(f"flashattn: argument 'causal' must be 0 (none), 1 (top-left) or 2 (bottom-right), "
                           f"got {causal}")

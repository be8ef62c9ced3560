"""Send torch.nn.functional.scaled_dot_product_attention calls to our kernels, unmodified code
included:

    with flashattn_ext.sdpa.enabled():
        out = model(x)            # every F.scaled_dot_product_attention call inside runs ours

    flashattn_ext.sdpa.enable()   # the same until flashattn_ext.sdpa.disable()

A TorchFunctionMode sees each SDPA call and runs flashattn_ext.scaled_dot_product_attention
when we take the inputs: CPU tensors, or CUDA tensors when this build has the CUDA kernels;
float64/float32/bfloat16/float16; head dims 1..256; plain tensors with attn_mask None, a bool
or float tensor that broadcasts, or a torch.nn.attention.bias.CausalBias; or jagged nested
tensors with no mask. Anything else (other tensor subclasses, strided or padded nested
tensors, other dtypes or devices, larger head dims, arguments SDPA itself would refuse) goes
to torch unchanged, so torch answers it as it always does.

On CUDA with torch >= 2.11 there is also SDPA's own hook: importing flashattn_ext registers
the name "flashattn_ext" with torch.nn.attention, and
torch.nn.attention.activate_flash_attention_impl("flashattn_ext") makes SDPA's flash backend
run our kernels (see sdpa_backend.py)."""
import contextlib
import sys

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ._checks import DTYPE_NAMES, MAX_HEAD_DIM
from ._sdpa_inputs import is_causal_bias, scaled_dot_product_attention
from .sdpa_backend import register_with_torch

_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_POSITIONAL = 6  # scale and enable_gqa are keyword-only
_SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


def _bind(args, kwargs):
    """SDPA's arguments by name, or None when they do not bind (torch will say why)."""
    if len(args) > _SDPA_POSITIONAL or any(name not in _SDPA_ARGS for name in kwargs):
        return None
    bound = dict(_SDPA_DEFAULTS, **dict(zip(_SDPA_ARGS, args)))
    for name, value in kwargs.items():
        if name in bound and _SDPA_ARGS.index(name) < len(args):
            return None
        bound[name] = value
    return bound if all(name in bound for name in ("query", "key", "value")) else None


def _device_taken(device):
    if device.type == "cpu":
        return True
    from . import has_cuda_kernels
    return device.type == "cuda" and has_cuda_kernels()


def _plain(t):
    return type(t) is torch.Tensor or type(t) is torch.nn.Parameter


def _jagged(t):
    """A jagged nested tensor (batch, heads, j, head_dim) with no holes, as ours takes it."""
    return (t.is_nested and t.layout == torch.jagged and t.dim() == 4 and t._ragged_idx == 2
            and t.lengths() is None)


def _tensors_taken(query, key, value, enable_gqa, nested):
    """Dtype, device, shapes, head dims and heads of query, key, value."""
    if query.dtype not in DTYPE_NAMES or any(t.dtype != query.dtype or t.device != query.device for t in (key, value)):
        return False
    if not _device_taken(query.device):
        return False
    if nested:
        if key.shape[0] != query.shape[0] or value.shape[0] != key.shape[0]:
            return False
        if not (key.offsets() is value.offsets() or torch.equal(key.offsets(), value.offsets())):
            return False
    elif key.shape[:-3] != query.shape[:-3] or value.shape[:-3] != query.shape[:-3] or value.shape[-2] != key.shape[-2]:
        return False
    if key.shape[-1] != query.shape[-1] or value.shape[-3] != key.shape[-3]:
        return False
    if not (1 <= query.shape[-1] <= MAX_HEAD_DIM and 1 <= value.shape[-1] <= MAX_HEAD_DIM):
        return False
    heads_q, heads_k = query.shape[-3], key.shape[-3]
    return heads_q == heads_k or (enable_gqa and heads_k > 0 and heads_q % heads_k == 0)


def _mask_taken(attn_mask, query, key, is_causal):
    if attn_mask is None:
        return True
    if is_causal:
        return False
    if is_causal_bias(attn_mask):
        variants = sys.modules["torch.nn.attention.bias"].CausalVariant
        return (attn_mask.seq_len_q, attn_mask.seq_len_kv) == (query.shape[-2], key.shape[-2]) and \
            attn_mask.variant in (variants.UPPER_LEFT, variants.LOWER_RIGHT)
    if not (isinstance(attn_mask, torch.Tensor) and _plain(attn_mask)) or attn_mask.is_nested:
        return False
    if attn_mask.device != query.device or attn_mask.dtype not in (torch.bool, query.dtype, torch.float32):
        return False
    target = tuple(query.shape[:-2]) + (query.shape[-2], key.shape[-2])
    shape = tuple(attn_mask.shape)
    return len(shape) <= len(target) and all(s in (1, t) for s, t in zip(reversed(shape), reversed(target)))


def takes(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """True when flashattn_ext.scaled_dot_product_attention computes this SDPA call as torch
    would; False sends it to torch."""
    tensors = (query, key, value)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return False
    if not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        return False
    if any(t.is_nested for t in tensors):
        # jagged nested tensors run as a variable-length batch, with no mask
        return all(_jagged(t) for t in tensors) and attn_mask is None and \
            _tensors_taken(query, key, value, enable_gqa, nested=True)
    if not all(_plain(t) for t in tensors) or query.dim() < 3 or any(t.dim() != query.dim() for t in (key, value)):
        return False
    if any(t.shape[-1] > 1 and t.stride(-1) != 1 for t in tensors):
        return False  # ours reads the head dim in place; torch copies such inputs
    return _tensors_taken(query, key, value, enable_gqa, nested=False) and \
        _mask_taken(attn_mask, query, key, is_causal)


class SDPAMode(TorchFunctionMode):
    """Runs F.scaled_dot_product_attention calls that `takes` accepts on our kernels; every
    other call, SDPA or not, goes on unchanged."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            bound = _bind(args, kwargs)
            if bound is not None and takes(**bound):
                return scaled_dot_product_attention(**bound)
        return func(*args, **kwargs)


_enabled = []  # the modes enable() entered, innermost last


def enable():
    """Send SDPA calls to our kernels until disable()."""
    mode = SDPAMode()
    mode.__enter__()
    _enabled.append(mode)


def disable():
    """Undo the last enable(); nothing to undo is an error."""
    if not _enabled:
        raise RuntimeError("flashattn_ext.sdpa.disable(): no enable() to undo")
    _enabled.pop().__exit__(None, None, None)


def is_enabled():
    """Whether an enable() is in force (the enabled() context manager is not counted)."""
    return bool(_enabled)


@contextlib.contextmanager
def enabled():
    """Send SDPA calls inside the block to our kernels."""
    with SDPAMode():
        yield


register_with_torch()

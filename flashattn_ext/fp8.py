"""Float8 (e4m3 / e5m2) inputs of the forward, with FlashAttention-3's descale conventions.

A call computes attention over the dequantized tensors q * q_descale, k * k_descale,
v * v_descale and returns bfloat16. It runs the bfloat16 kernels: the values are dequantized here
with torch ops, as exactly as bfloat16 allows. A float8 value converts to bfloat16 exactly, so
per-tensor descales leave q, k, v as they are and go into the softmax scale (q_descale *
k_descale) and into the output (v_descale times the kernels' bfloat16 output in fp32, rounded to
bfloat16). Per-(batch,
kv head) descales cannot go into the one scale of the call: q_descale * k_descale multiplies q
(in fp32, rounded to bfloat16 once) and v_descale the output, each query head taking its kv
head's. Forward only: no gradient reaches float8 inputs or the descales.

On an sm_90 GPU a call of e4m3 tensors with head_dim == head_dim_v == 128 and no feature beyond causal
runs the float8 kernel instead (Fp8Call.run_kernel): both products on float8 tensor cores, P rounded
to e4m3, the descales applied per (batch, kv head) in the kernel, V handed over transposed (one
copy of v, its keys in the order the kernel's P fragments take them)."""
import numbers

import torch

from . import ops as _ops
from ._checks import check_features, check_fwd_args

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
OUT_DTYPE = torch.bfloat16  # FlashAttention-3's output dtype for float8 inputs
_DESCALES = ("q_descale", "k_descale", "v_descale")


def requested(q, k, v, q_descale, k_descale, v_descale):
    """Whether a call takes this path: a float8 input or a descale given."""
    return (q_descale is not None or k_descale is not None or v_descale is not None or q.dtype in FP8_DTYPES
            or k.dtype in FP8_DTYPES or v.dtype in FP8_DTYPES)


def _dtype_name(dtype):
    return str(dtype).replace("torch.", "")


class Fp8Call:
    """A float8 call after its checks: run() computes it through the bfloat16 path on the
    dequantized tensors, run_kernel() through the float8 kernel where that takes it."""

    def __init__(self, q, k, v, softmax_scale, scale, qk, per_row, out_factor, kernel_descales):
        self._fp8 = (q, k, v)  # the op's (batch, heads, len, dim) views, float8
        self._softmax_scale = softmax_scale  # the call's (the kernel applies the descales itself)
        self.scale = scale  # the softmax scale, per-tensor q_descale * k_descale in it
        self._qk, self._per_row = qk, per_row  # a (groups, heads_kv) q_descale * k_descale, or None
        self._out_factor = out_factor  # None (1), a float, or broadcastable to (batch, heads, len, 1) in fp32
        # ((groups, heads_kv) float32 q_descale * k_descale and v_descale, contiguous) for the kernel, or None
        self._kernel_descales = kernel_descales

    def dequantized(self):
        """q, k, v in bfloat16 (exact), q times a per-head q_descale * k_descale (one rounding)."""
        q, k, v = (t.to(OUT_DTYPE) for t in self._fp8)
        if self._qk is not None:
            q = (q * self._per_row(self._qk)).to(OUT_DTYPE)
        return q, k, v

    def run(self, attention):
        """attention(q, k, v, scale) -> (out, *rest) on the dequantized tensors, autocast off (so
        that it stays bfloat16), then out times v_descale, in bfloat16."""
        q, k, v = self.dequantized()
        with torch.autocast(q.device.type, enabled=False):
            out, *rest = attention(q, k, v, self.scale)
        if self._out_factor is not None:
            out = (out * self._out_factor).to(OUT_DTYPE)
        return (out, *rest)

    def run_kernel(self, causal):
        """(out, lse) from the float8 kernel, or None where it does not take the call (then run())."""
        if self._kernel_descales is None:
            return None
        q, k, v = self._fp8
        qk, vd = self._kernel_descales
        out, lse, error = _ops.fwd_fp8_kernel()(q.view(torch.uint8), k.view(torch.uint8), v.view(torch.uint8), qk,
                                                vd, self._softmax_scale, causal)
        if error:
            if error.startswith("Unavailable|"):
                return None
            _ops._raise(error)
        return out, lse


# The float8 kernel where it takes a call; False runs every call through the bfloat16 path (to compare).
kernel_enabled = True
_SM90 = {}
_TABLES = {}  # (device, groups, heads_kv, value) -> a float32 (groups, heads_kv) table of a per-tensor descale
_MAX_TABLES = 64


def _kernel_takes(q, v, cu_seqlens_q, features):
    """Whether the float8 kernel can take the call: e4m3 on an sm_90 GPU, head_dim == head_dim_v == 128,
    fixed lengths, no option beyond causal (features: the call's keywords), not traced (a traced call
    keeps to the bfloat16 path's ops, which have fake kernels)."""
    def off(name, value):
        return name == "scale_name" or value is None or (not isinstance(value, torch.Tensor)
                                                         and value in (0, 0.0, (-1, -1)))
    return (features is not None and kernel_enabled and cu_seqlens_q is None and q.is_cuda
            and q.dtype == torch.float8_e4m3fn and q.shape[-1] == 128 and v.shape[-1] == 128
            and not torch.compiler.is_compiling() and all(off(*f) for f in features.items()) and _sm90(q.device))


def _table(x, groups, heads_kv, device):
    """x (a number, a one-element or a (groups, heads_kv) tensor) as a contiguous float32 (groups, heads_kv)
    table; a number's table is made once (outside CUDA-graph capture) and kept."""
    if isinstance(x, torch.Tensor):
        return x.to(torch.float32).expand(groups, heads_kv).contiguous()
    key = (device, groups, heads_kv, x)
    table = _TABLES.get(key)
    if table is None:
        table = torch.full((groups, heads_kv), x, dtype=torch.float32, device=device)
        if len(_TABLES) < _MAX_TABLES and not torch.cuda.is_current_stream_capturing():
            _TABLES[key] = table
    return table


def _sm90(device):
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM90:
        _SM90[index] = torch.cuda.get_device_capability(index) == (9, 0)
    return _SM90[index]


def prepare(q, k, v, descales, scale, dropout_p, causal, layout, cu_seqlens_q=None, cu_seqlens_k=None,
            features=None):
    """Fp8Call for q, k, v (the op's views, rank already checked) and descales = (q_descale,
    k_descale, v_descale), after every check of the float8 rules; scale and dropout_p as floats;
    cu_seqlens_* for a variable-length batch (descales then per sequence); features: the call's other
    keywords where the float8 kernel may take it (None: it may not)."""
    _check_dtypes(q, k, v, descales)
    for name, t in (("q", q), ("k", k), ("v", v)) + tuple(zip(_DESCALES, descales)):
        if isinstance(t, torch.Tensor) and t.requires_grad and torch.is_grad_enabled():
            raise RuntimeError(f"flashattn_ext: float8 attention is forward only, but argument '{name}' requires "
                               f"grad; detach it or call under torch.no_grad()")
    if dropout_p != 0.0:
        raise ValueError(f"flashattn_ext: dropout_p must be 0 with float8 inputs (a forward-only, inference call), "
                         f"got {dropout_p}")
    check_fwd_args(q, k, v, causal, layout, float8=True)
    if cu_seqlens_q is None:
        groups, what = q.shape[0], "batch"
    else:
        check_features(q, k, causal, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
        groups, what = cu_seqlens_q.shape[0] - 1, "num_sequences"
    heads_q, heads_kv = q.shape[1], k.shape[1]
    on_kernel = _kernel_takes(q, v, cu_seqlens_q, features)
    # (the kernel reads one-element descales on the device: no host read, no synchronization)
    q_d, k_d, v_d = (_descale(d, name, (groups, heads_kv), what, q.device, read_on_host=not on_kernel)
                     for d, name in zip(descales, _DESCALES))

    def per_row(factor):
        """A (groups, heads_kv) fp32 factor broadcastable to (batch, heads_q, len_q, 1): each query
        head takes its kv head's, each row of a variable-length batch its sequence's."""
        factor = factor.repeat_interleave(heads_q // heads_kv if heads_kv else 1, dim=1)
        if cu_seqlens_q is None:
            return factor[:, :, None, None]
        return _rows_of_sequences(factor, cu_seqlens_q, q.shape[2]).t()[None, :, :, None]
    qk = q_d * k_d
    per_head_qk = isinstance(qk, torch.Tensor)
    kernel_descales = None
    if on_kernel:
        kernel_descales = (_table(qk, groups, heads_kv, q.device), _table(v_d, groups, heads_kv, q.device))
    out_factor = per_row(v_d) if isinstance(v_d, torch.Tensor) else (None if v_d == 1.0 else v_d)
    return Fp8Call(q, k, v, scale, scale if per_head_qk else scale * qk, qk if per_head_qk else None, per_row, out_factor,
                   kernel_descales)


def _check_dtypes(q, k, v, descales):
    dtypes = (q.dtype, k.dtype, v.dtype)
    if not any(d in FP8_DTYPES for d in dtypes):
        name = next(n for n, d in zip(_DESCALES, descales) if d is not None)
        raise ValueError(f"flashattn_ext: {name} applies to float8 inputs (float8_e4m3fn, float8_e5m2) only; q, k "
                         f"and v have dtype {_dtype_name(q.dtype)}, so {name} must be None")
    if len(set(dtypes)) != 1:
        raise ValueError(f"flashattn_ext: q, k and v must have one float8 dtype, got q {_dtype_name(q.dtype)}, k "
                         f"{_dtype_name(k.dtype)} and v {_dtype_name(v.dtype)}")


def _descale(value, name, shape, what, device, read_on_host=True):
    """A descale as a float (None = 1, a number, a one-element tensor: per tensor) or a float32
    tensor of `shape` (per (batch or sequence, kv head)); read_on_host=False leaves a one-element
    tensor on its device, as a `shape` view of its value."""
    if value is None:
        return 1.0
    if not isinstance(value, torch.Tensor):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"flashattn_ext: {name} must be None, a real number (per tensor) or a float32 tensor, "
                            f"got {value!r}")
        return float(value)
    rule = f"a float32 tensor of shape ({what}, heads_kv) = {tuple(shape)} or of one element (per tensor)"
    if value.dtype != torch.float32:
        raise ValueError(f"flashattn_ext: {name} must be {rule}, got dtype {_dtype_name(value.dtype)}")
    if value.device != device:
        raise ValueError(f"flashattn_ext: {name} is on device {value.device} but q is on {device}; they must be on "
                         f"the same device")
    if value.numel() == 1:
        if not read_on_host or (value.is_cuda and torch.cuda.is_current_stream_capturing()):
            # Not read on the host under CUDA-graph capture (which forbids it): used as a (groups,
            # heads_kv) tensor of its value, so each replay reads the value the descale then holds.
            return value.reshape(1, 1).expand(shape)
        return value.item()  # into the softmax scale: exact (a host sync for a CUDA tensor)
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"flashattn_ext: {name} must be {rule}, got shape {tuple(value.shape)}")
    return value


def _rows_of_sequences(factor, cu_seqlens, rows):
    """factor (num_sequences, heads) repeated for each of the `rows` packed rows (rows, heads).
    Rows past the last offset (offsets the op will refuse) take 0; no offset is read on the host."""
    row = torch.arange(rows, dtype=cu_seqlens.dtype, device=cu_seqlens.device)
    sequence = torch.searchsorted(cu_seqlens[1:], row, right=True)  # in [0, num_sequences]
    return torch.cat([factor, factor.new_zeros(1, factor.shape[1])])[sequence]

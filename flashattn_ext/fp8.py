"""Float8 (e4m3 / e5m2) inputs of the forward, with FlashAttention-3's descale conventions.

A call computes attention over the dequantized tensors q * q_descale, k * k_descale,
v * v_descale and returns bfloat16. It runs the bfloat16 kernels: the values are dequantized here
with torch ops, as exactly as bfloat16 allows. A float8 value converts to bfloat16 exactly, so
per-tensor descales leave q, k, v as they are and go into the softmax scale (q_descale *
k_descale) and into the output (v_descale times the kernels' bfloat16 output in fp32, rounded to
bfloat16). Per-(batch,
kv head) descales cannot go into the one scale of the call: q_descale * k_descale multiplies q
(in fp32, rounded to bfloat16 once) and v_descale the output, each query head taking its kv
head's. Forward only: no gradient reaches float8 inputs or the descales."""
import numbers

import torch

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
    """A float8 call made ready for the bfloat16 path: q, k, v (bfloat16, the op's (batch,
    heads, len, dim) views), the softmax scale with the per-tensor descales in it, and run()
    for the attention over them."""

    def __init__(self, q, k, v, scale, out_factor):
        self.q, self.k, self.v, self.scale = q, k, v, scale
        self._out_factor = out_factor  # None (1), a float, or broadcastable to (batch, heads, len, 1) in fp32

    def run(self, attention):
        """attention(q, k, v, scale) -> (out, *rest) on the dequantized tensors, autocast off (so
        that it stays bfloat16), then out times v_descale, in bfloat16."""
        with torch.autocast(self.q.device.type, enabled=False):
            out, *rest = attention(self.q, self.k, self.v, self.scale)
        if self._out_factor is not None:
            out = (out * self._out_factor).to(OUT_DTYPE)
        return (out, *rest)


def prepare(q, k, v, descales, scale, dropout_p, causal, layout, cu_seqlens_q=None, cu_seqlens_k=None):
    """Fp8Call for q, k, v (the op's views, rank already checked) and descales = (q_descale,
    k_descale, v_descale), after every check of the float8 rules; scale and dropout_p as floats;
    cu_seqlens_* for a variable-length batch (descales then per sequence)."""
    _check_dtypes(q, k, v, descales)
    for name, t in (("q", q), ("k", k), ("v", v)) + tuple(zip(_DESCALES, descales)):
        if isinstance(t, torch.Tensor) and t.requires_grad and torch.is_grad_enabled():
            raise RuntimeError(f"flashattn_ext: float8 attention is forward only, but argument '{name}' requires "
                               f"grad; detach it or call under torch.no_grad()")
    if dropout_p != 0.0:
        raise ValueError(f"flashattn_ext: dropout_p must be 0 with float8 inputs (a forward-only, inference call), "
                         f"got {dropout_p}")
    q, k, v = (t.to(OUT_DTYPE) for t in (q, k, v))  # exact
    check_fwd_args(q, k, v, causal, layout)
    if cu_seqlens_q is None:
        groups, what = q.shape[0], "batch"
    else:
        check_features(q, k, causal, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
        groups, what = cu_seqlens_q.shape[0] - 1, "num_sequences"
    heads_q, heads_kv = q.shape[1], k.shape[1]
    q_d, k_d, v_d = (_descale(d, name, (groups, heads_kv), what, q.device) for d, name in zip(descales, _DESCALES))

    def per_row(factor):
        """A (groups, heads_kv) fp32 factor broadcastable to (batch, heads_q, len_q, 1): each query
        head takes its kv head's, each row of a variable-length batch its sequence's."""
        factor = factor.repeat_interleave(heads_q // heads_kv if heads_kv else 1, dim=1)
        if cu_seqlens_q is None:
            return factor[:, :, None, None]
        return _rows_of_sequences(factor, cu_seqlens_q, q.shape[2]).t()[None, :, :, None]

    qk = q_d * k_d
    if isinstance(qk, torch.Tensor):
        q = (q * per_row(qk)).to(OUT_DTYPE)
    else:
        scale = scale * qk
    out_factor = per_row(v_d) if isinstance(v_d, torch.Tensor) else (None if v_d == 1.0 else v_d)
    return Fp8Call(q, k, v, scale, out_factor)


def _check_dtypes(q, k, v, descales):
    dtypes = (q.dtype, k.dtype, v.dtype)
    if not any(d in FP8_DTYPES for d in dtypes):
        name = next(n for n, d in zip(_DESCALES, descales) if d is not None)
        raise ValueError(f"flashattn_ext: {name} applies to float8 inputs (float8_e4m3fn, float8_e5m2) only; q, k "
                         f"and v have dtype {_dtype_name(q.dtype)}, so {name} must be None")
    if len(set(dtypes)) != 1:
        raise ValueError(f"flashattn_ext: q, k and v must have one float8 dtype, got q {_dtype_name(q.dtype)}, k "
                         f"{_dtype_name(k.dtype)} and v {_dtype_name(v.dtype)}")


def _descale(value, name, shape, what, device):
    """A descale as a float (None = 1, a number, a one-element tensor: per tensor) or a float32
    tensor of `shape` (per (batch or sequence, kv head))."""
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
        if value.is_cuda and torch.cuda.is_current_stream_capturing():
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

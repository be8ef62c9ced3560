"""Argument checks of flashattn::fwd, in Python, with the messages of csrc/ops/.

csrc/ops/ checks every call of the op and stays the contract. These run first on the
public API and in the fake kernels: torch.compile then reports bad input at trace time, and
a bad argument never reaches the C++ kernel, whose exceptions some torch builds fail to
carry across the stable ABI (torch 2.11 segfaults on any exception a stable-ABI kernel
throws; scripts/probe reproduces it; torch 2.13 raises it)."""
import math

import torch

MAX_HEAD_DIM = 256
DTYPE_NAMES = {torch.float64: "float64", torch.float32: "float32", torch.bfloat16: "bfloat16",
               torch.float16: "float16"}


# The largest |scale| the op takes (csrc/ops/params.cpp: scale * log2(e) must fit in the accumulation type): fp32, fp64.
# (The fast paths compare against the fp32 one and leave any other scale to the checked path.)
_SCALE_LIMITS = tuple(torch.finfo(t).max / math.log2(math.e) for t in (torch.float32, torch.float64))
FP32_SCALE_LIMIT = _SCALE_LIMITS[0]


def check_scale(scale, dtype, name="scale", where="flashattn_ext"):
    """The op's rule for the scale (a float), in a message naming the argument as the caller's function names it
    (scale, softmax_scale)."""
    limit = _SCALE_LIMITS[1] if dtype == torch.float64 else _SCALE_LIMITS[0]  # (torch 2.11's dynamo: no bool index)
    if not -limit <= scale <= limit:  # (NaN too)
        raise ValueError(f"{where}: {name} must be finite with |{name}| <= {limit:.6g} (scale * log2(e) must fit in "
                         f"the accumulation type), got {scale}")


def _dtype_name(dtype):
    return DTYPE_NAMES.get(dtype) or str(dtype).replace("torch.", "")


# Where the dimensions of a (batch, heads, len, dim) view of the ops sit in the tensor the user
# passed: flash_attn_func's (batch, len, heads, dim) and flash_attn_varlen_func's (total, heads,
# dim) (the view is (1, heads, total, dim)). Messages show the shape the user passed.
_USER_DIMS = {"bhld": (0, 1, 2, 3), "blhd": (0, 2, 1, 3), "thd": (2, 1, 3)}


def _shape(t, layout="bhld"):
    dims = tuple(t.shape)
    if t.dim() == 4:
        dims = tuple(dims[i] for i in _USER_DIMS[layout])
    return "[" + ", ".join(str(s) for s in dims) + "]"


def check_layout(t, name):
    """A dense tensor: sparse, mkldnn and other layouts have no strides to read in place."""
    if t.layout != torch.strided:
        raise ValueError(f"flashattn: argument '{name}' must be a dense (strided) tensor, got layout "
                         f"{str(t.layout).replace('torch.', '')}; call .to_dense() on it first")


def _check_tensor(t, name, layout="bhld", float8=False):
    check_layout(t, name)
    if t.dim() != 4:
        raise RuntimeError(f"flashattn: argument '{name}' must have 4 dimensions (batch, heads, seq_len, head_dim), "
                           f"got shape {_shape(t)}")
    if t.shape[3] > 1 and t.numel() > 0 and t.stride(3) != 1:
        raise RuntimeError(f"flashattn: argument '{name}' must have a contiguous last dimension (stride 1), got "
                           f"stride {t.stride(3)} for shape {_shape(t, layout)}; call .contiguous() on it first")
    if t.dtype not in DTYPE_NAMES and not (float8 and t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)):
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


def _check_size(t, name, dim, expected, what, layout):
    if t.shape[dim] != expected:
        raise RuntimeError(f"flashattn: argument '{name}' has {what} {t.shape[dim]} (shape {_shape(t, layout)}) but "
                           f"{expected} was expected")


def check_fwd_args(q, k, v, causal, layout="bhld", paged=False, float8=False):
    """The checks of check_qkv in csrc/ops/tensors.cpp; `layout` says how the caller passed q, k, v
    (see _USER_DIMS), for the shapes the messages show; paged: k and v are the pages of a
    block_table (their first dimension counts blocks, not sequences); float8: float8 dtypes allowed
    (fp8.py checks their rules)."""
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        _check_tensor(t, name, layout, float8)
    _check_same(q, "q", k, "k")
    _check_same(q, "q", v, "v")
    batch, heads_q, _, head_dim = q.shape
    heads_kv, len_k = k.shape[1], k.shape[2]
    if paged:
        _check_size(v, "v", 0, k.shape[0], "number of blocks (must equal k's)", layout)
    else:
        _check_size(k, "k", 0, batch, "batch size", layout)
        _check_size(v, "v", 0, batch, "batch size", layout)
    _check_size(v, "v", 1, heads_kv, "number of heads (must equal k's)", layout)
    _check_size(v, "v", 2, len_k, "sequence length (must equal k's)", layout)
    _check_size(k, "k", 3, head_dim, "head_dim (must equal q's)", layout)
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


def _same_device(a, b):
    return a.device == b.device


def _check_cu_seqlens_meta(cu, name, q, n):
    if cu.dtype != torch.int32:
        raise RuntimeError(f"flashattn: argument '{name}' must have dtype int32, got {_dtype_name(cu.dtype)}")
    if cu.dim() != 1 or cu.shape[0] < 1 or not cu.is_contiguous():
        raise RuntimeError(f"flashattn: argument '{name}' must be a contiguous 1-D tensor of batch + 1 >= 1 offsets, "
                           f"got shape {_shape(cu)}")
    if cu.shape[0] != n:
        raise RuntimeError(f"flashattn: arguments 'cu_seqlens_q' and 'cu_seqlens_k' must have the same length "
                           f"(batch + 1), got {n} and {cu.shape[0]}")
    if not _same_device(cu, q):
        raise RuntimeError(f"flashattn: argument '{name}' is on device {cu.device} but 'q' is on {q.device}; they "
                           f"must be on the same device")


def check_cu_seqlens_values(cu, name, total, max_seqlen, max_name):
    """The value checks of check_cu_seqlens in csrc/ops/params.cpp (they read the tensor, so they run
    on the public API in eager mode, not on fake tensors)."""
    c = cu.tolist()
    if c[0] != 0:
        raise RuntimeError(f"flashattn: argument '{name}' must start at 0, got {c[0]}")
    for i in range(len(c) - 1):
        if c[i + 1] < c[i]:
            raise RuntimeError(f"flashattn: argument '{name}' must be non-decreasing, got {c[i]} then {c[i + 1]} "
                               f"at index {i + 1}")
    if c[-1] != total:
        raise RuntimeError(f"flashattn: argument '{name}' must end at the total number of rows {total}, got {c[-1]}")
    longest = max((b - a for a, b in zip(c, c[1:])), default=0)
    if max_seqlen < longest:
        raise RuntimeError(f"flashattn: argument '{max_name}' ({max_seqlen}) is smaller than the longest sequence "
                           f"in '{name}' ({longest})")


def refuse_forward_only_in_backward(seqused_k, leftpad_k, block_table):
    """The backward refuses the forward-only features (as csrc/ops/attention.cpp's bwd does)."""
    if block_table is not None:
        raise RuntimeError("flashattn: the backward of a call with a 'block_table' (paged k / v) is not supported: "
                           "such calls are forward only (decode steps)")
    if seqused_k is not None or leftpad_k is not None:
        raise RuntimeError("flashattn: the backward of a call with 'seqused_k' / 'leftpad_k' (per-sequence key "
                           "ranges) is not supported: such calls are forward only (decode steps)")


def _check_key_range_meta(t, name, q, batch):
    if t.dtype != torch.int32:
        raise RuntimeError(f"flashattn: argument '{name}' must have dtype int32, got {_dtype_name(t.dtype)}")
    if t.dim() != 1 or t.shape[0] != batch or not t.is_contiguous():
        raise RuntimeError(f"flashattn: argument '{name}' must be a contiguous 1-D tensor of shape [{batch}] (batch), "
                           f"got shape {_shape(t)}")
    if not _same_device(t, q):
        raise RuntimeError(f"flashattn: argument '{name}' is on device {t.device} but 'q' is on {q.device}; they "
                           f"must be on the same device")


def _check_block_table(t, q, k, varlen):
    """The checks of check_block_table in csrc/ops/params.cpp; returns len_k (pages x page_size)."""
    if varlen:
        raise RuntimeError("flashattn: a 'block_table' (paged k / v) cannot be combined with cu_seqlens (a "
                           "variable-length batch); give per-sequence lengths as seqused_k")
    if t.dtype != torch.int32:
        raise RuntimeError(f"flashattn: argument 'block_table' must have dtype int32, got {_dtype_name(t.dtype)}")
    batch = q.shape[0]
    if t.dim() != 2 or t.shape[0] != batch or t.shape[1] < 1 or t.stride(1) != 1:
        raise RuntimeError(f"flashattn: argument 'block_table' must be a (batch = {batch}, pages >= 1) tensor with a "
                           f"contiguous last dimension, got shape {_shape(t)}")
    if not _same_device(t, q):
        raise RuntimeError(f"flashattn: argument 'block_table' is on device {t.device} but 'q' is on {q.device}; "
                           f"they must be on the same device")
    if k.shape[0] < 1 or k.shape[2] < 1:
        raise RuntimeError(f"flashattn: with a block_table, k and v must be (num_blocks, heads, page_size, head_dim) "
                           f"pages with at least one block of at least one row, got k of shape {_shape(k)}")
    return t.shape[1] * k.shape[2]


def _check_key_ranges(q, seqused_k, leftpad_k, attn_bias, varlen):
    if seqused_k is None:
        raise RuntimeError("flashattn: argument 'leftpad_k' needs 'seqused_k' (the end of each sequence's keys)")
    if varlen:
        raise RuntimeError("flashattn: 'seqused_k' / 'leftpad_k' describe a padded batch; they cannot be combined "
                           "with cu_seqlens (a variable-length batch)")
    if attn_bias is not None:
        raise RuntimeError("flashattn: the combination attn_bias + seqused_k (per-sequence key ranges) is not "
                           "supported; mask the keys in the bias instead")
    _check_key_range_meta(seqused_k, "seqused_k", q, q.shape[0])
    if leftpad_k is not None:
        _check_key_range_meta(leftpad_k, "leftpad_k", q, q.shape[0])


def check_features(q, k, causal, attn_bias=None, window_left=-1, window_right=-1, alibi_slopes=None, softcap=0.0,
                   dropout_p=0.0, rng_state=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0,
                   max_seqlen_k=0, seqused_k=None, leftpad_k=None, block_table=None):
    """The checks of check_and_fill_features in csrc/ops/params.cpp that need no tensor values
    (q, k already passed check_fwd_args)."""
    if window_left < -1 or window_right < -1:
        raise RuntimeError(f"flashattn: argument 'window_size' must be (left, right) with each >= 0, or -1 for "
                           f"unbounded, got ({window_left}, {window_right})")
    if not softcap >= 0.0:
        raise RuntimeError(f"flashattn: argument 'softcap' must be >= 0 (0 = off), got {softcap}")
    if not 0.0 <= dropout_p < 1.0:
        raise RuntimeError(f"flashattn: argument 'dropout_p' must be in [0, 1), got {dropout_p}")
    batch, heads_q, len_q = q.shape[0], q.shape[1], q.shape[2]
    len_k = k.shape[2]
    if block_table is not None:
        len_k = _check_block_table(block_table, q, k, cu_seqlens_q is not None or cu_seqlens_k is not None)
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        if cu_seqlens_q is None or cu_seqlens_k is None:
            raise RuntimeError("flashattn: 'cu_seqlens_q' and 'cu_seqlens_k' must be given together")
        if batch != 1:
            raise RuntimeError(f"flashattn: with cu_seqlens, q, k and v must be (1, heads, total, head_dim) views of "
                               f"packed (total, heads, head_dim) tensors, got batch size {batch}")
        if attn_bias is not None:
            raise RuntimeError("flashattn: the combination attn_bias + cu_seqlens (variable-length batches) is not "
                               "supported; give a padded batch to use a mask")
        n = cu_seqlens_q.shape[0] if cu_seqlens_q.dim() == 1 else 0
        _check_cu_seqlens_meta(cu_seqlens_q, "cu_seqlens_q", q, n)
        _check_cu_seqlens_meta(cu_seqlens_k, "cu_seqlens_k", q, n)
        batch = n - 1
    if seqused_k is not None or leftpad_k is not None:
        _check_key_ranges(q, seqused_k, leftpad_k, attn_bias, cu_seqlens_q is not None or cu_seqlens_k is not None)
    if alibi_slopes is not None:
        a = alibi_slopes
        if not ((a.dim() == 1 and a.shape[0] == heads_q) or (a.dim() == 2 and tuple(a.shape) == (batch, heads_q))):
            raise RuntimeError(f"flashattn: argument 'alibi_slopes' must have shape [{heads_q}] (heads) or [{batch}, "
                               f"{heads_q}] (batch, heads), got {_shape(a)}")
        if a.dtype != torch.float32:
            raise RuntimeError(f"flashattn: argument 'alibi_slopes' must have dtype float32, got "
                               f"{_dtype_name(a.dtype)}")
        if a.numel() > 0 and a.stride(-1) != 1:
            raise RuntimeError("flashattn: argument 'alibi_slopes' must have a contiguous last dimension (stride 1)")
        if not _same_device(a, q):
            raise RuntimeError(f"flashattn: argument 'alibi_slopes' is on device {a.device} but 'q' is on {q.device}; "
                               f"they must be on the same device")
    if attn_bias is not None:
        m = attn_bias
        full = (batch, heads_q, len_q, len_k)
        if m.dim() != 4 or any(s not in (f, 1) for s, f in zip(m.shape, full)):
            raise RuntimeError(f"flashattn: argument 'attn_bias' must have shape [{batch}, {heads_q}, {len_q}, "
                               f"{len_k}] (batch, heads, len_q, len_k), each dimension possibly 1 (broadcast), got "
                               f"{_shape(m)}")
        if m.dtype not in (torch.bool, q.dtype, torch.float32):
            raise RuntimeError(f"flashattn: argument 'attn_bias' has dtype {_dtype_name(m.dtype)}; it must be bool "
                               f"(True = take part), or float in the query's dtype ({_dtype_name(q.dtype)}) or float32")
        if not _same_device(m, q):
            raise RuntimeError(f"flashattn: argument 'attn_bias' is on device {m.device} but 'q' is on {q.device}; "
                               f"they must be on the same device")
    if dropout_p > 0.0:
        if rng_state is None:
            raise RuntimeError("flashattn: dropout_p > 0 needs argument 'rng_state' (int64 [seed, offset], on the CPU "
                               "or on q's device)")
        r = rng_state
        if ((r.device.type != "cpu" and not _same_device(r, q)) or r.dtype != torch.int64 or r.dim() != 1
                or r.shape[0] != 2 or not r.is_contiguous()):
            raise RuntimeError(f"flashattn: argument 'rng_state' must be a contiguous int64 tensor [seed, offset] on "
                               f"the CPU or on q's device, got shape {_shape(r)} and dtype {_dtype_name(r.dtype)} "
                               f"on {r.device}")


# Signatures (call_signature) of calls whose argument checks all passed: a public function
# repeating one skips its checks, ~10 us of Python per call (a 2-core CPU), longer than the
# kernels of a small call. Bounded: emptied when full.
_PASSED = set()
_PASSED_MAX = 4096


def call_signature(q, k, v, *flags):
    """Everything the value-independent checks of a call read of q, k and v (shapes, strides,
    dtypes, devices) with the call's other arguments that they read (`flags`, hashable); None
    where they may read more: a traced call, one inside a torch.func transform (its tensors
    wrap others), a tensor subclass, a layout without strides."""
    if torch.compiler.is_compiling() or _transforms_active() or not (
            type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor):
        return None
    if q.layout is not _STRIDED or k.layout is not _STRIDED or v.layout is not _STRIDED:
        return None
    try:
        qs, ks, vs = q.stride(), k.stride(), v.stride()
    except RuntimeError:  # strides that cannot be read (a strided nested tensor): the checks say why
        return None
    if qs and (qs[-1] != 1 or ks[-1] != 1 or vs[-1] != 1):  # (copied on the way: ops.rows_contiguous)
        return None
    return (q.shape, qs, q.dtype, q.device, k.shape, ks, k.dtype, k.device, v.shape, vs, v.dtype, v.device, flags)


_transforms_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: True)
_STRIDED = torch.strided  # (layouts are singletons: compared by identity, without a lookup in torch)


def passed_before(signature):
    """Whether a call of this signature passed every check before (None: never; the set is not
    read then, so that torch.compile traces no access to it)."""
    return signature is not None and signature in _PASSED


def remember_passed(signature):
    """Records that a call of this signature passed every check (None: not recorded)."""
    if signature is None:
        return
    if len(_PASSED) >= _PASSED_MAX:
        _PASSED.clear()
    _PASSED.add(signature)

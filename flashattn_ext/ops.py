"""The two ops, flashattn::fwd and flashattn::bwd (C++), with their fake kernels for
torch.compile and the autograd formula that connects them.

Optional features of both ops (keyword arguments; each default is "off"):
  attn_bias      bool (True = take part) or float tensor added to the scores, shape
                 (batch, heads_q, len_q, len_k) with any dimension 1 or of stride 0 (broadcast)
  window_left, window_right   sliding window aligned bottom-right (flash-attn), -1 = unbounded
  alibi_slopes   float32 (heads_q,) or (batch, heads_q): -slope * |i + len_k - len_q - j| added
  softcap        softcap * tanh(s / softcap) on the scaled scores, before bias and masks
  dropout_p, rng_state        dropout of the probabilities; rng_state = int64 [seed, offset], on the
                 CPU or on q's device (read there by the kernels: graph-capture safe)
  cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k   variable-length batch: q, k, v are
                 (1, heads, total, dim) views, lse is (1, heads_q, total_q)
  seqused_k, leftpad_k        per-sequence key ranges of a padded batch, int32 (batch,): sequence b's
                 keys are rows leftpad_k[b] <= j < seqused_k[b] of k, v (leftpad_k None: from 0);
                 causal (bottom-right), window and ALiBi align against that length. Values are
                 read only by the kernels, on every device (no wait for the device: decode
                 steps, CUDA graphs): a sequence outside 0 <= leftpad_k <= seqused_k <= len_k
                 reads no key and gets NaN out and lse rows. Forward only: a backward raises.
  block_table    paged k / v, int32 (batch, pages): k and v are (num_blocks, heads_kv, page_size, dim)
                 pages, and key row j of sequence b is row j % page_size of block
                 block_table[b, j // page_size] (len_k = pages * page_size). CPU blocks of pages
                 that hold keys (of a sequence whose key range is in range) must be in
                 [0, num_blocks); CUDA ones are clamped into it. Forward only.
flashattn::bwd also takes bias_requires_grad and returns the bias gradient as a fourth tensor.

flashattn::kvcache_append(k_cache, v_cache, k, v, seqlens, batch_idx=None, block_table=None,
leftpad=None, rotary_cos=None, rotary_sin=None, rotary_interleaved=True, q=None, q_rotated=None,
q_rows_consecutive=False) -> seqused writes a KV-cache step's new keys and values into its caches
in place, rotated with rotary tables, and q rotated into q_rotated (see kvcache_append below;
flash_attn_with_kvcache calls it).

The C++ library defines the ops and registers, for CPU and CUDA, the underscored kernels _fwd,
_bwd, _fwd_plain, _bwd_plain (a call without optional features: only the arguments it reads),
_dropout_mask, _kvcache_append and _kvcache_step (a common decode step: the append and the
attention in one call), which throw nothing (on torch < 2.13 an exception
leaving a stable-ABI kernel kills the process): they return an error string, which the kernels
registered here for fwd, bwd, dropout_mask and kvcache_append raise as a Python exception
(torch.OutOfMemoryError for a failed allocation). The public functions call the underscored
kernels directly on eager CPU/CUDA tensors (one dispatch less), and the ops everywhere else
(torch.compile, meta and fake tensors, tensor subclasses)."""
import torch

from . import _C  # noqa: F401  (loading the library registers the ops)
from ._checks import (check_cu_seqlens_values, check_features, check_fwd_args, check_same_device,
                      refuse_forward_only_in_backward)

CAUSAL_NONE, CAUSAL_TOP_LEFT, CAUSAL_BOTTOM_RIGHT = 0, 1, 2

# The feature arguments shared by fwd and bwd, in schema order, with their defaults.
FEATURES = (("attn_bias", None), ("window_left", -1), ("window_right", -1), ("alibi_slopes", None),
            ("softcap", 0.0), ("dropout_p", 0.0), ("rng_state", None), ("cu_seqlens_q", None),
            ("cu_seqlens_k", None), ("max_seqlen_q", 0), ("max_seqlen_k", 0), ("seqused_k", None),
            ("leftpad_k", None), ("block_table", None))
_FEATURE_NAMES = tuple(name for name, _ in FEATURES)
_N_FIXED_FWD_ARGS = 6  # q, k, v, scale, causal, deterministic
_BIAS_INDEX = _N_FIXED_FWD_ARGS  # attn_bias is the first feature argument


def _kernel(name):
    """The C++ callable of underscored kernel `name` (see the module docstring), looked up once; its
    OpOverload's __call__ is a Python frame around it."""
    overload = getattr(torch.ops.flashattn, name).default
    return getattr(overload, "_op", overload)


_FWD_KERNEL, _BWD_KERNEL = _kernel("_fwd"), _kernel("_bwd")
_FWD_PLAIN_KERNEL, _BWD_PLAIN_KERNEL = _kernel("_fwd_plain"), _kernel("_bwd_plain")
_KVCACHE_APPEND_KERNEL, _KVCACHE_STEP_KERNEL = _kernel("_kvcache_append"), _kernel("_kvcache_step")


_FWD_FP8_KERNEL = []


def fwd_fp8_kernel():
    """The C++ callable of _fwd_fp8 (fp8.py), looked up on first use."""
    if not _FWD_FP8_KERNEL:
        _FWD_FP8_KERNEL.append(_kernel("_fwd_fp8"))
    return _FWD_FP8_KERNEL[0]


def _lse_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _empty_like_layout(like, heads, length, dim):
    """Mirror of empty_like_layout in csrc/ops/tensors.cpp: keep a (batch, len, heads, dim) memory
    order when `like` is a transposed flash-attn view, else contiguous."""
    b = like.shape[0]
    if like.shape[1] > 1 and like.shape[2] > 1 and like.stride(1) < like.stride(2):
        return like.new_empty((b, length, heads, dim)).transpose(1, 2)
    return like.new_empty((b, heads, length, dim))


def new_rng_state(device=None):
    """[seed, offset] for one dropout call, drawn by torch's generator of `device` (default: the
    CPU), on that device: torch.manual_seed reproduces the call, and a CUDA graph that captured
    the draw draws again on every replay (as torch's own dropout does)."""
    if device is not None and device.type == "cuda":
        return torch.randint(0, 2**63 - 1, (2,), dtype=torch.int64, device=device)
    return torch.randint(0, 2**63 - 1, (2,), dtype=torch.int64, device="cpu")


def _raise(error):
    """Raises the error string of an underscored C++ kernel: "<Python exception type>|<message>"."""
    kind, _, message = error.partition("|")
    raise (torch.OutOfMemoryError if kind == "OutOfMemoryError" else RuntimeError)(message)


def run_fwd(*args, **features):
    """The C++ forward on CPU/CUDA tensors, its error raised in Python."""
    out, lse, error = _FWD_KERNEL(*args, **features)
    if error:
        _raise(error)
    return out, lse


def run_bwd(*args, **features):
    """The C++ backward on CPU/CUDA tensors, its error raised in Python."""
    dq, dk, dv, dbias, error = _BWD_KERNEL(*args, **features)
    if error:
        _raise(error)
    return dq, dk, dv, dbias


def run_fwd_plain(q, k, v, scale, causal):
    """run_fwd of a call without optional features."""
    out, lse, error = _FWD_PLAIN_KERNEL(q, k, v, scale, causal)
    if error:
        _raise(error)
    return out, lse


def run_bwd_plain(dout, q, k, v, out, lse, dlse, scale, causal, deterministic):
    """run_bwd of a call without optional features: dq, dk, dv."""
    dq, dk, dv, error = _BWD_PLAIN_KERNEL(dout, q, k, v, out, lse, dlse, scale, causal, deterministic)
    if error:
        _raise(error)
    return dq, dk, dv


def _eager(t):
    """A plain CPU/CUDA tensor outside tracing: the guarded kernels can be called directly."""
    return type(t) is torch.Tensor and (t.is_cpu or t.is_cuda) and not torch.compiler.is_compiling()


def run_kvcache_append(k_cache, v_cache, k, v, seqlens, batch_idx=None, block_table=None, leftpad=None,
                       rotary_cos=None, rotary_sin=None, rotary_interleaved=True, q=None, q_rotated=None,
                       q_rows_consecutive=False):
    """The C++ KV-cache append on CPU/CUDA tensors (in place), its error raised in Python: seqused."""
    seqused, error = _KVCACHE_APPEND_KERNEL(k_cache, v_cache, k, v, seqlens, batch_idx, block_table, leftpad,
                                            rotary_cos, rotary_sin, rotary_interleaved, q, q_rotated,
                                            q_rows_consecutive)
    if error:
        _raise(error)
    return seqused


def run_kvcache_step(k_cache, v_cache, q, k, v, seqlens, block_table, leftpad, rotary_cos, rotary_sin,
                     rotary_interleaved, scale, causal):
    """A common decode step of flash_attn_with_kvcache in one C++ call (_kvcache_fast.py, whose
    checks it needs): the append of run_kvcache_append where there are new rows, rotary tables,
    pages or left padding (seqlens: int32 (batch,), or None with none of them), then run_fwd on the
    caches with the key ranges, causal bottom-right; q, k, v, the caches and out in
    flash_attn_with_kvcache's (batch, len, heads, dim) layout. (out, lse)."""
    out, lse, error = _KVCACHE_STEP_KERNEL(k_cache, v_cache, q, k, v, seqlens, block_table, leftpad, rotary_cos,
                                           rotary_sin, rotary_interleaved, scale, causal)
    if error:
        _raise(error)
    return out, lse


def kvcache_append(k_cache, v_cache, k, v, seqlens, batch_idx=None, block_table=None, leftpad=None, rotary_cos=None,
                   rotary_sin=None, rotary_interleaved=True, q=None, q_rotated=None, q_rows_consecutive=False):
    """flashattn::kvcache_append: k, v (batch, len_new, heads_kv, dim) written into k_cache, v_cache
    in place at keys seqlens[b].. of each sequence (its row batch_idx[b], or its pages through
    block_table); returns seqused = seqlens + len_new (int32 (batch,)), -1 for a sequence whose
    values allow no step: 0 <= seqlens <= cache length - len_new, 0 <= leftpad <= seqlens, its row
    a row of the cache, the blocks of the pages that hold its keys (leftpad.. seqused - 1) blocks
    of the cache, and with rotary tables every position it uses below their rows. Such a sequence
    writes nothing.

    rotary_cos, rotary_sin (positions, rotary_dim / 2), in the caches' dtype or float32: the first
    rotary_dim features of new key row t are written rotated at position seqlens[b] + t, pairs
    (2m, 2m + 1) when rotary_interleaved, else (m, m + rotary_dim / 2), computed in float32
    (float64 for float64) and rounded once; q (batch, len_q, heads_q, dim) is written rotated into
    q_rotated (its shape, written here), row i at seqlens[b] + i when q_rows_consecutive, else at
    seqlens[b] (q's rows unrotated for a sequence that breaks a rule). One launch on CUDA. Eager
    CPU/CUDA tensors take the C++ kernel directly."""
    args = (k_cache, v_cache, k, v, seqlens, batch_idx, block_table, leftpad, rotary_cos, rotary_sin,
            rotary_interleaved, q, q_rotated, q_rows_consecutive)
    if _eager(k_cache):
        return run_kvcache_append(*args)
    return torch.ops.flashattn.kvcache_append.default(*args)


def _check_cu_seqlens_on_device(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """The value checks C++ leaves to Python for CUDA offsets (it never copies them to the
    host): done here unless a CUDA graph is being captured, where they are trusted (the kernels
    still clamp them into the tensors)."""
    if cu_seqlens_q is None or not cu_seqlens_q.is_cuda or torch.cuda.is_current_stream_capturing():
        return
    check_cu_seqlens_values(cu_seqlens_q, "cu_seqlens_q", q.shape[2], max_seqlen_q, "max_seqlen_q")
    if cu_seqlens_k is not None:
        check_cu_seqlens_values(cu_seqlens_k, "cu_seqlens_k", k.shape[2], max_seqlen_k, "max_seqlen_k")


def _fwd_kernel(q, k, v, scale, causal, deterministic=False, attn_bias=None, window_left=-1, window_right=-1,
                alibi_slopes=None, softcap=0.0, dropout_p=0.0, rng_state=None, cu_seqlens_q=None, cu_seqlens_k=None,
                max_seqlen_q=0, max_seqlen_k=0, seqused_k=None, leftpad_k=None, block_table=None):
    _check_cu_seqlens_on_device(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return run_fwd(q, k, v, scale, causal, deterministic, attn_bias, window_left, window_right, alibi_slopes, softcap,
                   dropout_p, rng_state, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, leftpad_k,
                   block_table)


def _bwd_kernel(dout, q, k, v, out, lse, dlse, scale, causal, deterministic, attn_bias=None, window_left=-1,
                window_right=-1, alibi_slopes=None, softcap=0.0, dropout_p=0.0, rng_state=None, cu_seqlens_q=None,
                cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0, seqused_k=None, leftpad_k=None, block_table=None,
                bias_requires_grad=False):
    refuse_forward_only_in_backward(seqused_k, leftpad_k, block_table)
    _check_cu_seqlens_on_device(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return run_bwd(dout, q, k, v, out, lse, dlse, scale, causal, deterministic, attn_bias, window_left, window_right,
                   alibi_slopes, softcap, dropout_p, rng_state, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                   None, None, None, bias_requires_grad)


def _dropout_mask_kernel(rng_state, batch, heads, len_q, len_k, dropout_p):
    mask, error = torch.ops.flashattn._dropout_mask.default(rng_state, batch, heads, len_q, len_k, dropout_p)
    if error:
        _raise(error)
    return mask


def autocast_inputs(device_type, q, k, v, attn_bias):
    """q, k, v and attn_bias as computed in an autocast region of device_type (unchanged outside
    one): in the autocast dtype, as torch's scaled_dot_product_attention; a float32 bias stays
    float32 (the kernels read it as it is)."""
    if not torch.is_autocast_enabled(device_type):
        return q, k, v, attn_bias
    dtype = torch.get_autocast_dtype(device_type)
    cast = lambda t: t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t  # noqa: E731
    if attn_bias is not None and attn_bias.is_floating_point() and attn_bias.dtype != torch.float32:
        attn_bias = cast(attn_bias)
    return cast(q), cast(k), cast(v), attn_bias


def _autocast_fwd(device_type):
    def kernel(q, k, v, scale, causal, deterministic=False, attn_bias=None, *features):
        q, k, v, attn_bias = autocast_inputs(device_type, q, k, v, attn_bias)
        with torch.autocast(device_type, enabled=False):
            return torch.ops.flashattn.fwd.default(q, k, v, scale, causal, deterministic, attn_bias, *features)
    return kernel


# Whether this build carries the CUDA kernels (a constant, which torch.compile can trace).
HAS_CUDA_KERNELS = torch._C._dispatch_has_kernel_for_dispatch_key("flashattn::_fwd", "CUDA")

_lib = torch.library.Library("flashattn", "IMPL")
for _key in ("CPU", "CUDA") if HAS_CUDA_KERNELS else ("CPU",):
    _lib.impl("fwd", _fwd_kernel, _key)
    _lib.impl("bwd", _bwd_kernel, _key)
    _lib.impl("kvcache_append", run_kvcache_append, _key)
_lib.impl("dropout_mask", _dropout_mask_kernel, "CPU")
_lib.impl("fwd", _autocast_fwd("cpu"), "AutocastCPU")
_lib.impl("fwd", _autocast_fwd("cuda"), "AutocastCUDA")


def dropout_mask(rng_state, batch, heads, len_q, len_k, dropout_p):
    """Test helper: the keep mask (True = kept) of the ops' dropout for rng_state (int64
    [seed, offset], on any device), as a bool (batch, heads, len_q, len_k) CPU tensor; small
    shapes only (at most 2**28 elements)."""
    sizes = (batch, heads, len_q, len_k)
    if any(not isinstance(n, int) or n < 0 for n in sizes) or batch * heads * len_q * len_k > 2**28:
        raise ValueError(f"flashattn: dropout_mask is a test helper for small shapes (batch, heads, len_q, len_k "
                         f"non-negative ints, at most 2**28 elements in all), got {sizes}")
    return torch.ops.flashattn.dropout_mask(rng_state.cpu(), batch, heads, len_q, len_k, float(dropout_p))


@torch.library.register_fake("flashattn::fwd")
def _fwd_fake(q, k, v, scale, causal, deterministic=False, attn_bias=None, window_left=-1, window_right=-1,
              alibi_slopes=None, softcap=0.0, dropout_p=0.0, rng_state=None, cu_seqlens_q=None, cu_seqlens_k=None,
              max_seqlen_q=0, max_seqlen_k=0, seqused_k=None, leftpad_k=None, block_table=None):
    check_fwd_args(q, k, v, causal, paged=block_table is not None)
    check_features(q, k, causal, attn_bias, window_left, window_right, alibi_slopes, softcap, dropout_p, rng_state,
                   cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, leftpad_k, block_table)
    out = _empty_like_layout(q, q.shape[1], q.shape[2], v.shape[3])
    lse = q.new_empty((q.shape[0], q.shape[1], q.shape[2]), dtype=_lse_dtype(q.dtype))
    return out, lse


@torch.library.register_fake("flashattn::kvcache_append")
def _kvcache_append_fake(k_cache, v_cache, k, v, seqlens, batch_idx=None, block_table=None, leftpad=None,
                         rotary_cos=None, rotary_sin=None, rotary_interleaved=True, q=None, q_rotated=None,
                         q_rows_consecutive=False):
    return seqlens.new_empty(seqlens.shape)


@torch.library.register_fake("flashattn::bwd")
def _bwd_fake(dout, q, k, v, out, lse, dlse, scale, causal, deterministic, attn_bias=None, window_left=-1,
              window_right=-1, alibi_slopes=None, softcap=0.0, dropout_p=0.0, rng_state=None, cu_seqlens_q=None,
              cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0, seqused_k=None, leftpad_k=None, block_table=None,
              bias_requires_grad=False):
    refuse_forward_only_in_backward(seqused_k, leftpad_k, block_table)
    check_same_device(q=q, k=k, v=v, dout=dout, out=out, lse=lse, dlse=dlse)
    dbias = q.new_empty((q.shape[0] if bias_requires_grad else 0, q.shape[1], q.shape[2], k.shape[2]),
                        dtype=_lse_dtype(q.dtype))
    return (_empty_like_layout(q, q.shape[1], q.shape[2], q.shape[3]),
            _empty_like_layout(k, k.shape[1], k.shape[2], k.shape[3]),
            _empty_like_layout(v, v.shape[1], v.shape[2], v.shape[3]), dbias)


def _run_fwd_call(q, k, v, attn_bias, scale, causal, deterministic, features):
    """run_fwd of one call; `features`: the feature arguments given besides attn_bias, by name.
    A call with none takes the plain kernel (each argument costs the dispatcher time)."""
    if attn_bias is None and not features:
        return run_fwd_plain(q, k, v, scale, causal)
    return run_fwd(q, k, v, scale, causal, deterministic, attn_bias, **features)


def _save_plain(ctx, q, k, v, out, lse, call):
    """What the backward of a call without optional features needs; `call` = (scale, causal,
    deterministic)."""
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.features = None
    ctx.call = call
    ctx.set_materialize_grads(False)


def _save_for_backward(ctx, q, k, v, attn_bias, scale, causal, deterministic, features, out, lse):
    """What the backward needs; `features` as in _run_fwd_call. Only the features given are
    walked (none for a plain call)."""
    if attn_bias is None and not features:
        _save_plain(ctx, q, k, v, out, lse, (scale, causal, deterministic))
        return
    given = dict(features, attn_bias=attn_bias)
    ctx.tensor_names = tuple(name for name, x in given.items() if isinstance(x, torch.Tensor))
    ctx.save_for_backward(q, k, v, out, lse, *(given[name] for name in ctx.tensor_names))
    ctx.features = {name: x for name, x in given.items() if not isinstance(x, torch.Tensor)}
    ctx.call = (scale, causal, deterministic)
    ctx.set_materialize_grads(False)


def _fwd_setup_context(ctx, inputs, output):
    # `inputs` holds the arguments as the caller passed them (trailing defaults left out).
    q, k, v, scale, causal = inputs[:5]
    deterministic = inputs[5] if len(inputs) > 5 else False
    features = dict(zip(_FEATURE_NAMES, inputs[_N_FIXED_FWD_ARGS:]))
    ctx.n_inputs = len(inputs)
    _save_for_backward(ctx, q, k, v, features.pop("attn_bias", None), scale, causal, deterministic, features,
                       *output)


def rows_contiguous(t):
    """t where its last dimension is contiguous (or has one element), else a copy that is: the ops read each row's
    head dims as one run. Gradients from reductions arrive expanded (stride 0), and torch's SDPA and flash-attn
    take a strided, transposed or expanded head dim of their inputs by copying it too. None, or a tensor without
    strides (sparse, strided nested), is returned as it is, for the checks to name."""
    try:
        if t.stride(-1) == 1 or t.shape[-1] <= 1:
            return t
    except (AttributeError, RuntimeError, IndexError, TypeError):
        return t
    return t.contiguous()


def _gradients(ctx, dout, dlse, bias_needs_grad):
    """dq, dk, dv and the bias gradient (None unless a float bias needs it)."""
    q, k, v, out, lse, *tensors = ctx.saved_tensors
    scale, causal, deterministic = ctx.call
    features = {}
    if ctx.features is not None:
        features = dict(ctx.features)
        features.update(zip(ctx.tensor_names, tensors))
        refuse_forward_only_in_backward(features.get("seqused_k"), features.get("leftpad_k"),
                                        features.get("block_table"))
    dout = torch.zeros_like(out) if dout is None else rows_contiguous(dout)
    if dlse is not None:
        dlse = dlse.contiguous()
    deterministic = deterministic or torch.are_deterministic_algorithms_enabled()
    eager, recorded = _eager(q), torch.is_grad_enabled()  # recorded: create_graph=True
    if eager and not recorded and ctx.features is None:
        return (*run_bwd_plain(dout, q, k, v, out, lse, dlse, scale, causal, deterministic), None)
    bias = features.get("attn_bias")
    bias_grad = bias is not None and bias.is_floating_point() and bias_needs_grad
    if not eager:
        dq, dk, dv, dbias = torch.ops.flashattn.bwd.default(dout, q, k, v, out, lse, dlse, scale, causal,
                                                           deterministic, **features, bias_requires_grad=bias_grad)
    elif recorded:  # positional, as autograd.Function takes them
        dq, dk, dv, dbias = _BwdRecorded.apply(dout, q, k, v, out, lse, dlse, scale, causal, deterministic,
                                               *(features.get(name, default) for name, default in FEATURES),
                                               bias_grad)
    else:
        dq, dk, dv, dbias = run_bwd(dout, q, k, v, out, lse, dlse, scale, causal, deterministic, **features,
                                    bias_requires_grad=bias_grad)
    if not bias_grad:
        return dq, dk, dv, None
    # Summed where the bias broadcast, in the accumulation dtype, before rounding to the bias's dtype.
    broadcast = [d for d in range(4) if bias.shape[d] == 1 and dbias.shape[d] != 1]
    return dq, dk, dv, (dbias.sum(broadcast, keepdim=True) if broadcast else dbias).to(bias.dtype)


def _fwd_backward(ctx, dout, dlse):
    needs = ctx.needs_input_grad
    dq, dk, dv, dbias = _gradients(ctx, dout, dlse, len(needs) > _BIAS_INDEX and needs[_BIAS_INDEX])
    return ((dq, dk, dv, None, None, None, dbias) + (None,) * (len(FEATURES) - 1))[:ctx.n_inputs]


def _bwd_setup_context(ctx, inputs, output):
    pass


def _bwd_backward(ctx, *grads):
    raise RuntimeError("flashattn: double backward (differentiating the attention backward again, e.g. "
                       "torch.autograd.grad(..., create_graph=True) followed by another backward) is not "
                       "supported")


class _BwdRecorded(torch.autograd.Function):
    """The backward where autograd records it (create_graph=True, torch.func.grad): its own
    backward raises. In torch.func's style (forward and setup_context apart), which the
    registered formula of flashattn::bwd is not."""

    @staticmethod
    def forward(*args):
        return run_bwd(*args)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        _bwd_backward(ctx, *grads)


torch.library.register_autograd("flashattn::fwd", _fwd_backward, setup_context=_fwd_setup_context)
torch.library.register_autograd("flashattn::bwd", _bwd_backward, setup_context=_bwd_setup_context)


class _FwdWithGradForTransforms(torch.autograd.Function):
    """flashattn::fwd with the formula registered above, applied directly. The registered path
    rebuilds the op's argument list from its schema on every call (torch/_library/autograd.py:
    fill_defaults reads schema.arguments once per argument), ~90 us of Python per call on a 2-core
    CPU with torch 2.13: longer than the whole kernel of a small call (bf16, L = 1024, causal:
    ~40 us on an H200), whose timing then measures the CPU. The arguments come as q, k, v,
    attn_bias (those that take gradients) and one tuple of the rest: apply() costs per argument.

    forward and setup_context apart, as torch.func transforms (grad, vjp) require; apply() then
    binds the arguments through inspect.signature on every call (~30 us), so calls outside a
    transform take _FwdWithGrad, the same steps in one forward."""

    @staticmethod
    def forward(q, k, v, attn_bias, rest):
        return _run_fwd_call(q, k, v, attn_bias, *rest)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, attn_bias, rest = inputs
        _save_for_backward(ctx, q, k, v, attn_bias, *rest, *output)

    @staticmethod
    def backward(ctx, dout, dlse):  # gradients of q, k, v, attn_bias (apply's index 3); none for rest
        return *_gradients(ctx, dout, dlse, ctx.needs_input_grad[3]), None


class _FwdWithGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, attn_bias, scale, causal, deterministic, features):
        output = _run_fwd_call(q, k, v, attn_bias, scale, causal, deterministic, features)
        _save_for_backward(ctx, q, k, v, attn_bias, scale, causal, deterministic, features, *output)
        return output

    @staticmethod
    def backward(ctx, dout, dlse):  # gradients of q, k, v, attn_bias; none for the rest
        return *_gradients(ctx, dout, dlse, ctx.needs_input_grad[3]), None, None, None, None


class _PlainFwdWithGrad(torch.autograd.Function):
    """_FwdWithGrad of a call without optional features: apply() takes fewer arguments, and the
    forward calls the plain kernel directly."""

    @staticmethod
    def forward(ctx, q, k, v, scale, causal, deterministic):
        out, lse, error = _FWD_PLAIN_KERNEL(q, k, v, scale, causal)
        if error:
            _raise(error)
        _save_plain(ctx, q, k, v, out, lse, (scale, causal, deterministic))
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):  # gradients of q, k, v; none for the rest
        return *_gradients(ctx, dout, dlse, False)[:3], None, None, None


_transforms_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: True)
# autograd.Function.apply outside torch.func transforms, without its per-call Python: the C++
# apply it ends in, after unwrapping tensors left over from an exited transform as it does.
_apply_fwd_with_grad = super(torch.autograd.Function, _FwdWithGrad).apply
_apply_plain_fwd_with_grad = super(torch.autograd.Function, _PlainFwdWithGrad).apply
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead


def fwd_plain(q, k, v, scale, causal, deterministic=False):
    """fwd of a call without optional features (where the public functions take a call whose
    signature passed the checks before)."""
    if _any_autocast():
        q, k, v, _ = autocast_inputs(q.device.type, q, k, v, None)
    if not _eager(q):
        return torch.ops.flashattn.fwd.default(q, k, v, scale, causal, deterministic)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        if _transforms_active():
            return _FwdWithGradForTransforms.apply(q, k, v, None, (scale, causal, deterministic, {}))
        return _apply_plain_fwd_with_grad(_unwrap_if_dead(q), _unwrap_if_dead(k), _unwrap_if_dead(v), scale, causal,
                                          deterministic)
    return run_fwd_plain(q, k, v, scale, causal)


def fwd(q, k, v, scale, causal, deterministic=False, **features):
    """flashattn::fwd, differentiable; `features` as the op names them. Where autograd records
    the call (outside torch.compile, which traces the op's registered formula), through
    _FwdWithGrad (_PlainFwdWithGrad without features: fwd_plain)."""
    if not features:
        return fwd_plain(q, k, v, scale, causal, deterministic)
    unknown = [name for name in features if name not in _FEATURE_NAMES]  # (no set ops: torch 2.11's dynamo)
    if unknown:
        raise TypeError(f"flashattn_ext: unknown feature arguments {sorted(unknown)}")
    bias = features.pop("attn_bias", None)
    if _any_autocast():
        q, k, v, bias = autocast_inputs(q.device.type, q, k, v, bias)
    if not _eager(q):
        return torch.ops.flashattn.fwd.default(q, k, v, scale, causal, deterministic, bias, **features)
    if features.get("cu_seqlens_q") is not None:  # CUDA offsets are checked in Python (see _fwd_kernel)
        _check_cu_seqlens_on_device(q, k, features["cu_seqlens_q"], features.get("cu_seqlens_k"),
                                    features.get("max_seqlen_q", 0), features.get("max_seqlen_k", 0))
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or (
            bias is not None and bias.requires_grad)):
        if _transforms_active():
            return _FwdWithGradForTransforms.apply(q, k, v, bias, (scale, causal, deterministic, features))
        return _apply_fwd_with_grad(_unwrap_if_dead(q), _unwrap_if_dead(k), _unwrap_if_dead(v),
                                    bias if bias is None else _unwrap_if_dead(bias), scale, causal, deterministic,
                                    features)
    return _run_fwd_call(q, k, v, bias, scale, causal, deterministic, features)


_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)

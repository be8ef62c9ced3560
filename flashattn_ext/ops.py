"""The two ops, flashattn::fwd and flashattn::bwd (C++), with their fake kernels for
torch.compile and the autograd formula that connects them.

Optional features of both ops (keyword arguments; each default is "off"):
  attn_bias      bool (True = take part) or float tensor added to the scores, shape
                 (batch, heads_q, len_q, len_k) with any dimension 1 or of stride 0 (broadcast)
  window_left, window_right   sliding window aligned bottom-right (flash-attn), -1 = unbounded
  alibi_slopes   float32 (heads_q,) or (batch, heads_q): -slope * |i + len_k - len_q - j| added
  softcap        softcap * tanh(s / softcap) on the scaled scores, before bias and masks
  dropout_p, rng_state        dropout of the probabilities; rng_state = int64 CPU [seed, offset]
  cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k   variable-length batch: q, k, v are
                 (1, heads, total, dim) views, lse is (1, heads_q, total_q)
flashattn::bwd also takes bias_requires_grad and returns the bias gradient as a fourth tensor."""
import torch

from . import _C  # noqa: F401  (loading the library registers the ops)
from ._checks import check_features, check_fwd_args, check_same_device

CAUSAL_NONE, CAUSAL_TOP_LEFT, CAUSAL_BOTTOM_RIGHT = 0, 1, 2

# The feature arguments shared by fwd and bwd, in schema order, with their defaults.
FEATURES = (("attn_bias", None), ("window_left", -1), ("window_right", -1), ("alibi_slopes", None),
            ("softcap", 0.0), ("dropout_p", 0.0), ("rng_state", None), ("cu_seqlens_q", None),
            ("cu_seqlens_k", None), ("max_seqlen_q", 0), ("max_seqlen_k", 0))
_FEATURES_OFF = tuple(default for _, default in FEATURES)
_N_FIXED_FWD_ARGS = 6  # q, k, v, scale, causal, deterministic
_BIAS_INDEX = _N_FIXED_FWD_ARGS  # attn_bias is the first feature argument


def _lse_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _empty_like_layout(like, heads, length, dim):
    """Mirror of empty_like_layout in csrc/ops.cpp: keep a (batch, len, heads, dim) memory
    order when `like` is a transposed flash-attn view, else contiguous."""
    b = like.shape[0]
    if like.shape[1] > 1 and like.shape[2] > 1 and like.stride(1) < like.stride(2):
        return like.new_empty((b, length, heads, dim)).transpose(1, 2)
    return like.new_empty((b, heads, length, dim))


def new_rng_state():
    """[seed, offset] for one dropout call, drawn from torch's default CPU generator, so that
    torch.manual_seed reproduces the call (on CPU and on CUDA alike)."""
    return torch.randint(0, 2**63 - 1, (2,), dtype=torch.int64, device="cpu")


def dropout_mask(rng_state, batch, heads, len_q, len_k, dropout_p):
    """Test helper: the keep mask (True = kept) of the ops' dropout for rng_state, as a bool
    (batch, heads, len_q, len_k) CPU tensor; small shapes only."""
    return torch.ops.flashattn.dropout_mask(rng_state, batch, heads, len_q, len_k, float(dropout_p))


@torch.library.register_fake("flashattn::fwd")
def _fwd_fake(q, k, v, scale, causal, deterministic=False, attn_bias=None, window_left=-1, window_right=-1,
              alibi_slopes=None, softcap=0.0, dropout_p=0.0, rng_state=None, cu_seqlens_q=None, cu_seqlens_k=None,
              max_seqlen_q=0, max_seqlen_k=0):
    check_fwd_args(q, k, v, causal)
    check_features(q, k, causal, attn_bias, window_left, window_right, alibi_slopes, softcap, dropout_p, rng_state,
                   cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    out = _empty_like_layout(q, q.shape[1], q.shape[2], v.shape[3])
    lse = q.new_empty((q.shape[0], q.shape[1], q.shape[2]), dtype=_lse_dtype(q.dtype))
    return out, lse


@torch.library.register_fake("flashattn::bwd")
def _bwd_fake(dout, q, k, v, out, lse, dlse, scale, causal, deterministic, attn_bias=None, window_left=-1,
              window_right=-1, alibi_slopes=None, softcap=0.0, dropout_p=0.0, rng_state=None, cu_seqlens_q=None,
              cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0, bias_requires_grad=False):
    check_same_device(q=q, k=k, v=v, dout=dout, out=out, lse=lse, dlse=dlse)
    dbias = q.new_empty((q.shape[0] if bias_requires_grad else 0, q.shape[1], q.shape[2], k.shape[2]),
                        dtype=_lse_dtype(q.dtype))
    return (_empty_like_layout(q, q.shape[1], q.shape[2], q.shape[3]),
            _empty_like_layout(k, k.shape[1], k.shape[2], k.shape[3]),
            _empty_like_layout(v, v.shape[1], v.shape[2], v.shape[3]), dbias)


def _save_for_backward(ctx, q, k, v, scale, causal, deterministic, features, out, lse):
    """What the backward needs; `features` holds every feature argument in schema order."""
    ctx.tensor_slots = tuple(i for i, x in enumerate(features) if isinstance(x, torch.Tensor))
    ctx.save_for_backward(q, k, v, out, lse, *(features[i] for i in ctx.tensor_slots))
    ctx.features = tuple(None if isinstance(x, torch.Tensor) else x for x in features)
    ctx.scale, ctx.causal, ctx.deterministic = scale, causal, deterministic
    ctx.set_materialize_grads(False)


def _fwd_setup_context(ctx, inputs, output):
    # `inputs` holds the arguments as the caller passed them (trailing defaults left out).
    q, k, v, scale, causal = inputs[:5]
    deterministic = inputs[5] if len(inputs) > 5 else False
    given = tuple(inputs[_N_FIXED_FWD_ARGS:])
    ctx.n_inputs = len(inputs)
    _save_for_backward(ctx, q, k, v, scale, causal, deterministic,
                       given + tuple(default for _, default in FEATURES[len(given):]), *output)


def _last_dim_contiguous(t):
    # Gradients from reductions arrive expanded (stride 0 everywhere); the op reads rows in
    # place and needs unit stride along head_dim.
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def _gradients(ctx, dout, dlse, bias_needs_grad):
    """dq, dk, dv and the bias gradient (None unless a float bias needs it)."""
    q, k, v, out, lse, *tensors = ctx.saved_tensors
    features = list(ctx.features)
    for i, t in zip(ctx.tensor_slots, tensors):
        features[i] = t
    bias = features[0]  # attn_bias
    bias_grad = bias is not None and bias.is_floating_point() and bias_needs_grad
    if dout is None:
        dout = torch.zeros_like(out)
    if dlse is not None:
        dlse = dlse.contiguous()
    dq, dk, dv, dbias = torch.ops.flashattn.bwd.default(
        _last_dim_contiguous(dout), q, k, v, out, lse, dlse, ctx.scale, ctx.causal,
        ctx.deterministic or torch.are_deterministic_algorithms_enabled(), *features, bias_grad)
    if not bias_grad:
        return dq, dk, dv, None
    broadcast = [d for d in range(4) if bias.shape[d] == 1 and dbias.shape[d] != 1]  # sum where it broadcast
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


torch.library.register_autograd("flashattn::fwd", _fwd_backward, setup_context=_fwd_setup_context)
torch.library.register_autograd("flashattn::bwd", _bwd_backward, setup_context=_bwd_setup_context)


class _FwdWithGrad(torch.autograd.Function):
    """flashattn::fwd with the formula registered above, applied directly. The registered path
    rebuilds the op's argument list from its schema on every call (torch/_library/autograd.py:
    fill_defaults reads schema.arguments once per argument), ~90 us of Python per call on a 2-core
    CPU with torch 2.13: longer than the whole kernel of a small call (bf16, L = 1024, causal:
    ~40 us on an H200), whose timing then measures the CPU. The arguments come as q, k, v,
    attn_bias (those that take gradients) and one tuple of the rest: apply() costs per argument."""

    @staticmethod
    def forward(ctx, q, k, v, attn_bias, rest):
        scale, causal, deterministic, *others = rest
        features = (attn_bias, *others)
        out, lse = torch.ops.flashattn.fwd.default(q, k, v, scale, causal, deterministic, *features)
        _save_for_backward(ctx, q, k, v, scale, causal, deterministic, features, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):  # gradients of q, k, v, attn_bias (apply's index 3); none for rest
        return *_gradients(ctx, dout, dlse, ctx.needs_input_grad[3]), None


def fwd(q, k, v, scale, causal, deterministic=False, **features):
    """flashattn::fwd, differentiable; `features` as the op names them. Where autograd records
    the call (outside torch.compile, which traces the op's registered formula), through
    _FwdWithGrad."""
    values = tuple(features.pop(name, default) for name, default in FEATURES) if features else _FEATURES_OFF
    if features:
        raise TypeError(f"flashattn_ext: unknown feature arguments {sorted(features)}")
    bias = values[0]
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or (
            bias is not None and bias.requires_grad)) and not torch.compiler.is_compiling():
        return _FwdWithGrad.apply(q, k, v, bias, (scale, causal, deterministic) + values[1:])
    return torch.ops.flashattn.fwd.default(q, k, v, scale, causal, deterministic, *values)

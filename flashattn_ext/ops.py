"""The two ops, flashattn::fwd and flashattn::bwd (C++), with their fake kernels for
torch.compile and the autograd formula that connects them."""
import torch

from . import _C  # noqa: F401  (loading the library registers the ops)
from ._checks import check_fwd_args, check_same_device

CAUSAL_NONE, CAUSAL_TOP_LEFT, CAUSAL_BOTTOM_RIGHT = 0, 1, 2


def _lse_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _empty_like_layout(like, heads, length, dim):
    """Mirror of empty_like_layout in csrc/ops.cpp: keep a (batch, len, heads, dim) memory
    order when `like` is a transposed flash-attn view, else contiguous."""
    b = like.shape[0]
    if like.shape[1] > 1 and like.shape[2] > 1 and like.stride(1) < like.stride(2):
        return like.new_empty((b, length, heads, dim)).transpose(1, 2)
    return like.new_empty((b, heads, length, dim))


@torch.library.register_fake("flashattn::fwd")
def _fwd_fake(q, k, v, scale, causal, deterministic=False):
    check_fwd_args(q, k, v, causal)
    out = _empty_like_layout(q, q.shape[1], q.shape[2], v.shape[3])
    lse = q.new_empty((q.shape[0], q.shape[1], q.shape[2]), dtype=_lse_dtype(q.dtype))
    return out, lse


@torch.library.register_fake("flashattn::bwd")
def _bwd_fake(dout, q, k, v, out, lse, dlse, scale, causal, deterministic):
    check_same_device(q=q, k=k, v=v, dout=dout, out=out, lse=lse, dlse=dlse)
    return (_empty_like_layout(q, q.shape[1], q.shape[2], q.shape[3]),
            _empty_like_layout(k, k.shape[1], k.shape[2], k.shape[3]),
            _empty_like_layout(v, v.shape[1], v.shape[2], v.shape[3]))


def _fwd_setup_context(ctx, inputs, output):
    q, k, v, scale, causal, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.scale, ctx.causal, ctx.deterministic = scale, causal, deterministic
    ctx.set_materialize_grads(False)


def _last_dim_contiguous(t):
    # Gradients from reductions arrive expanded (stride 0 everywhere); the op reads rows in
    # place and needs unit stride along head_dim.
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def _fwd_backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    if dlse is not None:
        dlse = dlse.contiguous()
    dq, dk, dv = torch.ops.flashattn.bwd(_last_dim_contiguous(dout), q, k, v, out, lse, dlse, ctx.scale,
                                         ctx.causal, ctx.deterministic or torch.are_deterministic_algorithms_enabled())
    return dq, dk, dv, None, None, None


def _bwd_setup_context(ctx, inputs, output):
    pass


def _bwd_backward(ctx, *grads):
    raise RuntimeError("flashattn: double backward (differentiating the attention backward again, e.g. "
                       "torch.autograd.grad(..., create_graph=True) followed by another backward) is not "
                       "supported")


torch.library.register_autograd("flashattn::fwd", _fwd_backward, setup_context=_fwd_setup_context)
torch.library.register_autograd("flashattn::bwd", _bwd_backward, setup_context=_bwd_setup_context)

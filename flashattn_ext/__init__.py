"""flashattn_ext: exact attention the FlashAttention way (tiled, online softmax, O(L) memory)."""
from . import ops  # noqa: F401  (registers the ops, fake kernels and autograd)
from .functional import flash_attn_func, flash_attn_varlen_func, scaled_dot_product_attention
from .kvcache import flash_attn_with_kvcache

__all__ = ["scaled_dot_product_attention", "flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"]
__version__ = "0.1.0"


def has_cuda_kernels():
    """True when this build carries the CUDA kernels."""
    import torch
    return torch._C._dispatch_has_kernel_for_dispatch_key("flashattn::fwd", "CUDA")

"""flashattn_ext: exact attention the FlashAttention way (tiled, online softmax, O(L) memory)."""
from . import ops  # noqa: F401  (registers the ops, fake kernels and autograd)
from . import nn  # noqa: F401  (flashattn_ext.nn.MultiheadAttention, flashattn_ext.nn.Attention)
from ._sdpa_inputs import scaled_dot_product_attention
from .attention_fn import attention
from .bert_padding import pad_input, unpad_input
from .flash_attn_interface import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                                   flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                                   flash_attn_varlen_qkvpacked_func)
from .kvcache import flash_attn_with_kvcache
from .plan import kernel_plan
from . import sdpa  # noqa: F401,E402  (the SDPA mode; registers "flashattn_ext" with torch.nn.attention)

__all__ = ["scaled_dot_product_attention", "attention", "flash_attn_func", "flash_attn_varlen_func",
           "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func", "flash_attn_varlen_qkvpacked_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_with_kvcache", "unpad_input", "pad_input", "kernel_plan"]
__version__ = "0.1.0"


def has_cuda_kernels():
    """True when this build carries the CUDA kernels."""
    return ops.HAS_CUDA_KERNELS

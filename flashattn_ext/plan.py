"""kernel_plan: the CUDA kernel a call runs on, as the kernel plan (csrc/cuda/plan.cpp) chooses it."""
import os

import torch

from ._checks import check_features, check_fwd_args
from .ops import _raise, new_rng_state

_DEVICE_KEYS = ("arch", "sms", "smem", "sm90a")


def _device_limits(device):
    """[major, minor, SMs, shared memory per block, sm_90a built] of a `device` dict, checked."""
    keys = set(device) if isinstance(device, dict) else set()
    if not isinstance(device, dict) or not keys <= set(_DEVICE_KEYS) or not {"arch", "sms", "smem"} <= keys:
        raise ValueError(f"flashattn: kernel_plan argument 'device' must be a dict with keys 'arch' (major, minor), "
                         f"'sms', 'smem' and optionally 'sm90a' (bool), got {device!r}")
    arch, sms, smem, sm90a = device["arch"], device["sms"], device["smem"], device.get("sm90a", True)
    if (not isinstance(arch, (tuple, list)) or len(arch) != 2 or not all(isinstance(x, int) for x in arch)
            or arch[0] < 1 or arch[1] < 0):
        raise ValueError(f"flashattn: kernel_plan device 'arch' must be (major, minor) with major >= 1 and minor >= 0, "
                         f"got {arch!r}")
    for name, value in (("sms", sms), ("smem", smem)):
        if not isinstance(value, int) or isinstance(value, bool) or value < (1 if name == "sms" else 0):
            raise ValueError(f"flashattn: kernel_plan device '{name}' must be an int >= {1 if name == 'sms' else 0}, "
                             f"got {value!r}")
    if not isinstance(sm90a, bool):
        raise ValueError(f"flashattn: kernel_plan device 'sm90a' must be a bool, got {sm90a!r}")
    return [arch[0], arch[1], sms, smem, int(sm90a)]


def kernel_plan(q, k, v, causal=0, *, backward=False, deterministic=False, bias_requires_grad=False, device=None,
                kernels=None, smem_limit=None, **features):
    """The CUDA kernel family and head-dim tier that the forward (or, `backward`, the dK/dV step of
    the backward) of this call runs on, e.g. "sm90_wgmma_ws/128", "sm80_decode/64", "simt/256x2"
    (two column slices); names in docs/architecture.md.

    q, k, v: (batch, heads, len, dim) as the ops take them; `causal` 0 (none), 1 (top-left) or 2
    (bottom-right, ops.CAUSAL_*); `features`: the ops' keywords (attn_bias, window_left, window_right,
    alibi_slopes, softcap, dropout_p, cu_seqlens_q, seqused_k, block_table, ...). `device`: None plans
    for the tensors' CUDA device; a dict fakes a GPU, e.g. {"arch": (8, 6), "sms": 84, "smem": 101376}
    (smem: shared memory a block may opt into; "sm90a": whether the build has sm_90a code, default
    True), and works on CPU tensors. `kernels` / `smem_limit`: the values of FLASHATTN_CUDA_KERNELS /
    FLASHATTN_CUDA_SMEM_LIMIT to plan with (default: this process's environment)."""
    check_fwd_args(q, k, v, causal, paged=features.get("block_table") is not None)
    if features.get("dropout_p", 0.0) and features.get("rng_state") is None:
        features["rng_state"] = new_rng_state()
    check_features(q, k, causal, **features)
    limits = [] if device is None else _device_limits(device)
    if kernels is None:
        kernels = os.environ.get("FLASHATTN_CUDA_KERNELS")
    if smem_limit is None:
        smem_limit = os.environ.get("FLASHATTN_CUDA_SMEM_LIMIT")
    f = dict(attn_bias=None, window_left=-1, window_right=-1, alibi_slopes=None, softcap=0.0, dropout_p=0.0,
             rng_state=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0, seqused_k=None,
             leftpad_k=None, block_table=None)
    f.update(features)
    plan, error = torch.ops.flashattn._kernel_plan.default(
        q, k, v, int(causal), bool(backward), bool(deterministic), f["attn_bias"], f["window_left"],
        f["window_right"], f["alibi_slopes"], float(f["softcap"]), float(f["dropout_p"]), f["rng_state"],
        f["cu_seqlens_q"], f["cu_seqlens_k"], f["max_seqlen_q"], f["max_seqlen_k"], f["seqused_k"], f["leftpad_k"],
        f["block_table"], bool(bias_requires_grad), limits,
        None if kernels is None else str(kernels), None if smem_limit is None else str(smem_limit))
    if error:
        _raise(error)
    return plan

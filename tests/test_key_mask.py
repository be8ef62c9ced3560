"""A key padding mask: a bias of shape (batch or 1, 1, 1, len_k), SDPA's attn_mask broadcast over the heads
and the query rows, bool or float (in the inputs' dtype or float32), against the float64 reference with the
accuracy rule of DESIGN §4, forward and backward (the mask takes no gradient). On sm_90 the Hopper kernels
take such calls (sm90/key_bias.cuh): the CUDA calls here are sized so that an sm_90 GPU plans them there
(enough query tiles for every SM, rows that see enough keys), which the test checks; other GPUs run the
sm80/ kernels' feature variants, the CPU its own. Key lengths that no key tile divides, causal (bottom-right)
and not, GQA, key tiles masked whole, rows that see no key."""
import os

import pytest
import torch

from feature_reference import attention_ref, check_features
from flashattn_ext import kernel_plan
from reference import BOTTOM_RIGHT, NONE

op = torch.ops.flashattn.fwd


def _shape(device, causal):
    """(batch, heads_kv, group, len_q, len_k). CUDA: 2 x 200-row query tiles of 128 (dim 64 at >= 2048 keys:
    192) per head, heads for more than a block per SM (a persistent grid; causal ones at 96 and 128 walk in
    pairs of a heavy and a light tile); rows that see >= 1000 keys, causal (bottom-right) 2200 on average (the
    Hopper forward's bars: 512, dim 64 causal 1024). CPU: small."""
    if device != "cuda":
        return 2, 1, 2, 70, 150 if causal == NONE else 170
    len_q, len_k = 200, 2300 if causal != NONE else 1000
    group, sms = 3, torch.cuda.get_device_properties(device).multi_processor_count
    return 2, sms // (2 * 2 * group) + 1, group, len_q, len_k


def _key_mask(kind, batch, len_q, len_k, causal, dtype, device):
    """(batch, 1, 1, len_k): keys kept at random (70%), the first quarter masked (whole key tiles); with two
    batches the second one's keys below len_k - len_q / 2 masked, so that its first rows see no key under a
    bottom-right causal mask, and every key of it without one."""
    keep = torch.rand(batch, 1, 1, len_k, device=device) > 0.3
    keep[..., : len_k // 4] = False
    if batch == 2:
        keep[1, ..., : len_k - len_q // 2 if causal != NONE else len_k] = False
    if kind == "bool":
        return keep
    m = torch.randn(keep.shape, device=device, dtype=torch.float32 if kind == "float32" else dtype)
    return m.masked_fill(~keep, float("-inf"))


def _plans_on_hopper(device):
    """Whether this process plans the call on the Hopper kernels where they take it (sm_90, kernels and
    shared memory not limited to other families')."""
    return (device == "cuda" and torch.cuda.get_device_capability() == (9, 0) and
            os.environ.get("FLASHATTN_CUDA_KERNELS", "") in ("", "wgmma") and
            not os.environ.get("FLASHATTN_CUDA_SMEM_LIMIT"))


@pytest.mark.parametrize("causal", [NONE, BOTTOM_RIGHT], ids=["none", "bottom_right"])
@pytest.mark.parametrize("kind,per_batch", [("bool", True), ("float", False), ("float32", True)],
                         ids=["bool_B", "float_1", "float32_B"])
@pytest.mark.parametrize("dim", [64, 96, 128, 256])
def test_key_mask(device, dim, kind, per_batch, causal):
    dtype = torch.float16 if kind == "float32" else torch.bfloat16
    batch, heads_kv, group, len_q, len_k = _shape(device, causal)
    make = lambda h, n: torch.randn(batch, h, n, dim, dtype=dtype, device=device).requires_grad_()
    q, k, v = make(heads_kv * group, len_q), make(heads_kv, len_k), make(heads_kv, len_k)
    m = _key_mask(kind, batch if per_batch else 1, len_q, len_k, causal, dtype, device)
    if _plans_on_hopper(device):
        assert kernel_plan(q, k, v, causal, attn_bias=m).startswith("sm90_wgmma_ws")
        assert kernel_plan(q, k, v, causal, backward=True, attn_bias=m) == f"sm90_wgmma/{dim}"
    scale = dim**-0.5
    got = check_features(lambda q, k, v: op(q, k, v, scale, causal, False, attn_bias=m),
                         lambda q, k, v: attention_ref(q, k, v, scale, causal, bias=m), [q, k, v])
    # rows that see no key: out 0, lse -inf (and, by the accuracy check, zero gradients)
    dead = got["lse"] == float("-inf")
    assert dead.any() == per_batch
    if per_batch:
        assert dead[0].sum() == 0 and dead[1].all(-1).all() == (causal == NONE)
    assert torch.all(got["out"][dead] == 0)

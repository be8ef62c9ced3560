"""A bias other than a key vector: SDPA's attn_mask per head, per query row or both, (1, H, Lq, Lk), (B, 1, Lq, Lk),
(B, H, Lq, Lk), (1, 1, Lq, Lk) and (B, H, 1, Lk), bool or float (in the inputs' dtype or float32), without a
gradient, against the float64 reference with the accuracy rule of DESIGN §4, forward and backward. On sm_90 the
Hopper kernels' row variants take such calls where the plan sends them (the forward: dims 128 and 256, bool or
16-bit bias rows whose tensor map encodes, copied tile by tile with TMA; the backward: dims 128 and 256, any such
bias, read into registers), which the test checks through kernel_plan; the CUDA calls are sized as test_key_mask's
so that an sm_90 GPU plans them there. Other GPUs run the sm80/ kernels' feature variants, the CPU its own. Lq != Lk,
lengths that no tile divides, causal (bottom-right) and not, GQA, rows whose keys are all masked (out 0, lse -inf,
zero gradients), rows of a stride that a tensor map cannot take."""
import pytest
import torch

from feature_reference import attention_ref, check_features
from flashattn_ext import kernel_plan
from reference import BOTTOM_RIGHT, NONE
from test_key_mask import _plans_on_hopper, _shape

op = torch.ops.flashattn.fwd

# The bias's broadcast: which of (batch, heads, query rows) it has (1 where broadcast).
FORMS = {"1H": (False, True, True), "B1": (True, False, True), "BH": (True, True, True), "11": (False, False, True),
         "BH1": (True, True, False)}


def _bias(form, kind, batch, heads, len_q, len_k, dtype, device, row_pad):
    """A bias of the form's shape, a view of rows of len_k + row_pad keys (row_pad 0: rows padded to 16 bytes'
    worth, as a tensor map needs): keys kept at random (80%), a band of whole key tiles masked, and (with query
    rows) rows 5 and 6 of every head masked whole; float kinds add N(0, 1) values where kept, -inf elsewhere."""
    per_batch, per_head, per_row = FORMS[form]
    shape = (batch if per_batch else 1, heads if per_head else 1, len_q if per_row else 1, len_k)
    stored = shape[:3] + (len_k + row_pad if row_pad else -(-len_k // 16) * 16,)
    keep = (torch.rand(stored, device=device) > 0.2)[..., :len_k]
    keep[..., len_k // 3: len_k // 3 + 64] = False
    if per_row:
        keep[:, :, 5:7] = False
    if kind == "bool":
        return keep
    b = torch.randn(stored, device=device, dtype=torch.float32 if kind == "float32" else dtype)[..., :len_k]
    return b.masked_fill_(~keep, float("-inf"))  # (in place: the view's strides kept)


def _hopper_forward_takes(dim, m):
    """The plan's rule for the Hopper forward's bias rows (FwdParams::tma_row_bias, kFwdRowBiasTier): dims 64, 128
    and 256, bool or 16-bit values, a row dimension of its own, keys contiguous, base and strides 16-byte aligned."""
    size = m.element_size()
    strides = [s for s, n in zip(m.stride()[:3], m.shape[:3]) if n > 1]
    return (dim in (64, 128, 256) and size <= 2 and m.shape[2] > 1 and m.stride(3) == 1 and m.data_ptr() % 16 == 0
            and all(s * size % 16 == 0 for s in strides))


FORMS_CASES = [("1H", "bool", NONE, 0), ("B1", "float", BOTTOM_RIGHT, 0), ("BH", "float32", NONE, 0),
               ("11", "float", NONE, 0), ("BH1", "bool", BOTTOM_RIGHT, 0)]
# (rows of an odd stride: a tensor map cannot step them; where the row form would run)
CASES = [(dim,) + c for dim in (64, 96, 128, 256) for c in FORMS_CASES] + [
    (dim, "BH", "float", NONE, 1) for dim in (128, 256)]


@pytest.mark.parametrize("dim,form,kind,causal,row_pad", CASES,
                         ids=[f"{c[0]}-{c[1]}_{c[2]}{'_causal' if c[3] != NONE else ''}{'_odd_rows' if c[4] else ''}"
                              for c in CASES])
def test_full_bias(device, dim, form, kind, causal, row_pad):
    dtype = torch.float16 if kind == "float32" else torch.bfloat16
    batch, heads_kv, group, len_q, len_k = _shape(device, causal)
    make = lambda h, n: torch.randn(batch, h, n, dim, dtype=dtype, device=device).requires_grad_()
    q, k, v = make(heads_kv * group, len_q), make(heads_kv, len_k), make(heads_kv, len_k)
    m = _bias(form, kind, batch, heads_kv * group, len_q, len_k, dtype, device, row_pad)
    if _plans_on_hopper(device):
        fwd = kernel_plan(q, k, v, causal, attn_bias=m)
        assert fwd.startswith("sm90_wgmma_ws") == _hopper_forward_takes(dim, m), (fwd, m.shape, m.stride())
        bwd = kernel_plan(q, k, v, causal, backward=True, attn_bias=m)
        assert (bwd == f"sm90_wgmma/{dim}") == (dim in (128, 256)), bwd
    scale = dim**-0.5
    got = check_features(lambda q, k, v: op(q, k, v, scale, causal, False, attn_bias=m),
                         lambda q, k, v: attention_ref(q, k, v, scale, causal, bias=m), [q, k, v])
    # rows whose keys are all masked: out 0, lse -inf (and, by the accuracy check, zero gradients)
    dead = got["lse"] == float("-inf")
    assert bool(dead[:, :, 5:7].all()) == FORMS[form][2]
    assert not dead[:, :, :5].any()
    assert torch.all(got["out"][dead] == 0)

"""An nn.Module using the attention: a small multi-head attention block trained a few SGD
steps gives the same losses and weights with torch's SDPA and with flashattn_ext's."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import flashattn_ext


class SelfAttention(nn.Module):
    def __init__(self, dim, heads, kv_heads, attention):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.qkv = nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim)
        self.proj = nn.Linear(heads * self.head_dim, dim)
        self.attention = attention

    def forward(self, x, causal):
        b, l, _ = x.shape
        qkv = self.qkv(x).view(b, l, self.heads + 2 * self.kv_heads, self.head_dim).transpose(1, 2)
        q, k, v = qkv.split([self.heads, self.kv_heads, self.kv_heads], dim=1)
        out = self.attention(q, k, v, is_causal=causal, enable_gqa=self.heads != self.kv_heads)
        return x + self.proj(out.transpose(1, 2).reshape(b, l, -1))


def _train(attention, dtype, device, causal, kv_heads, steps=5):
    torch.manual_seed(1)
    blocks = [SelfAttention(32, 4, kv_heads, attention) for _ in range(2)]
    model = nn.ModuleList(blocks).to(device=device, dtype=dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 24, 32, dtype=dtype, device=device)
    target = torch.randn(2, 24, 32, dtype=dtype, device=device)
    losses = []
    for _ in range(steps):
        h = x
        for block in model:
            h = block(h, causal)
        loss = F.mse_loss(h, target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)], ids=["fp64", "fp32"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_training_matches_torch_sdpa(device, dtype, tol, causal, kv_heads):
    ref_losses, ref_params = _train(F.scaled_dot_product_attention, dtype, device, causal, kv_heads)
    losses, params = _train(flashattn_ext.scaled_dot_product_attention, dtype, device, causal, kv_heads)
    assert losses[-1] < losses[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=tol, atol=tol)
    for p, r in zip(params, ref_params):
        torch.testing.assert_close(p, r, rtol=tol, atol=tol)

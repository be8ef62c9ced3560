"""Padding helpers with flash_attn.bert_padding's names and results: unpad_input turns a
padded batch and its mask into the packed rows and cu_seqlens that flash_attn_varlen_func
takes, pad_input puts packed rows back into a zero-padded batch. Both are differentiable."""
import torch

__all__ = ["pad_input", "unpad_input"]


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """hidden_states (batch, seq_len, ...), attention_mask (batch, seq_len), bool or int,
    nonzero = a token; unused_mask (optional, same shape): positions allocated but unused,
    packed with the tokens (counted in cu_seqlens, not in seqused).

    Returns (hidden_states (total, ...), indices (total,) int64 into the flattened batch,
    cu_seqlens (batch + 1,) int32, max_seqlen_in_batch (int), seqused (batch,) int32: the
    tokens of attention_mask per sequence). Tokens keep their order within each sequence;
    they need not be contiguous (left or right padding alike)."""
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() < 2:
        got = tuple(hidden_states.shape) if isinstance(hidden_states, torch.Tensor) else type(hidden_states).__name__
        raise ValueError(f"flashattn_ext: hidden_states must be a tensor (batch, seq_len, ...), got {got}")
    for name, m in (("attention_mask", attention_mask), ("unused_mask", unused_mask)):
        if m is not None and (not isinstance(m, torch.Tensor) or tuple(m.shape) != tuple(hidden_states.shape[:2])):
            raise ValueError(f"flashattn_ext: {name} must be a tensor of shape (batch, seq_len) = "
                             f"{tuple(hidden_states.shape[:2])}, got "
                             f"{tuple(m.shape) if isinstance(m, torch.Tensor) else type(m).__name__}")
    used = attention_mask != 0
    taken = used | (unused_mask != 0) if unused_mask is not None else used
    seqlens = taken.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(taken.flatten()).flatten()
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    max_seqlen = int(seqlens.max().item()) if seqlens.numel() else 0
    rows = hidden_states.reshape(-1, *hidden_states.shape[2:]).index_select(0, indices)
    return rows, indices, cu_seqlens, max_seqlen, used.sum(dim=-1, dtype=torch.int32)


def pad_input(hidden_states, indices, batch, seqlen):
    """hidden_states (total, ...) rows at `indices` of a flattened (batch * seqlen) batch, as
    unpad_input returned them. Returns (batch, seqlen, ...) with zeros at the other places."""
    if not isinstance(indices, torch.Tensor) or indices.dim() != 1 or indices.shape[0] != hidden_states.shape[0]:
        raise ValueError(f"flashattn_ext: indices must be a 1-D tensor with one entry per row of hidden_states "
                         f"({hidden_states.shape[0]}), got "
                         f"{tuple(indices.shape) if isinstance(indices, torch.Tensor) else type(indices).__name__}")
    out = hidden_states.new_zeros((batch * seqlen, *hidden_states.shape[1:]))
    out = out.index_put((indices,), hidden_states)
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])

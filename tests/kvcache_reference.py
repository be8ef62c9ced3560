"""Plain reference for flash_attn_with_kvcache, one sequence at a time: build each sequence's
keys and values explicitly (its cache row, or its pages laid end to end), rotate with complex
multiplication, append, then softmax attention over the visible keys, in the dtype of the
inputs (float64 for the reference, the input dtype for "torch in the same dtype")."""
import torch


def rotate(x, cos, sin, positions, interleaved):
    """x (L, heads, E) rotated at positions (L,). float64: feature pairs as complex numbers
    times cos + i sin; other dtypes: the same product with real ops in x's dtype (torch's own
    rounding). Pairs (2m, 2m + 1) when interleaved, else (m, m + rotary_dim / 2)."""
    half = cos.shape[1]
    c, s = cos[positions].to(x.dtype)[:, None, :], sin[positions].to(x.dtype)[:, None, :]
    part = x[..., :2 * half]
    re, im = (part[..., 0::2], part[..., 1::2]) if interleaved else (part[..., :half], part[..., half:])
    if x.dtype == torch.float64:
        z = torch.complex(re, im) * torch.complex(c, s)
        re, im = z.real, z.imag
    else:
        re, im = re * c - im * s, re * s + im * c
    rotated = torch.stack((re, im), dim=-1).flatten(-2) if interleaved else torch.cat((re, im), dim=-1)
    return torch.cat((rotated, x[..., 2 * half:]), dim=-1)


def rotate_rounded_once(x, cos, sin, positions, interleaved):
    """x (L, heads, E) rotated at positions (L,) with torch's elementwise ops in float32 (float64
    for float64 inputs), each product and sum rounded on its own, then rounded once to x's dtype:
    the bits the rotary inside flashattn::kvcache_append must give."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    half = cos.shape[1]
    c, s = cos[positions].to(acc)[:, None, :], sin[positions].to(acc)[:, None, :]
    part = x[..., :2 * half].to(acc)
    x1, x2 = (part[..., 0::2], part[..., 1::2]) if interleaved else (part[..., :half], part[..., half:])
    first, second = x1 * c - x2 * s, x1 * s + x2 * c
    rotated = torch.stack((first, second), dim=-1).flatten(-2) if interleaved else torch.cat((first, second), dim=-1)
    return torch.cat((rotated.to(x.dtype), x[..., 2 * half:]), dim=-1)


def sequence_cache(cache, b, batch_idx, block_table):
    """(C, Hkv, E) copy of sequence b's keys (or values)."""
    if block_table is not None:
        return torch.cat([cache[blk] for blk in block_table[b]], dim=0)
    return cache[b if batch_idx is None else batch_idx[b]].clone()


def write_key(cache, b, position, value, batch_idx, block_table):
    """cache entry of sequence b at `position` = value."""
    if block_table is not None:
        page = cache.shape[1]
        cache[block_table[b][position // page], position % page] = value
    else:
        cache[b if batch_idx is None else batch_idx[b], position] = value


def kvcache_ref(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, seqlens=None, batch_idx=None,
                leftpad=None, block_table=None, scale=None, causal=False, window=(-1, -1), softcap=0.0,
                interleaved=True, alibi=None):
    """(out (B, Lq, H, Ev), lse (B, H, Lq), k_cache after, v_cache after); index arguments as
    Python lists (seqlens an int list, None = every sequence full)."""
    batch, len_q, heads, dim = q.shape
    if k is not None:  # (the caches returned after the append; a read-only step returns them as they are)
        k_cache, v_cache = k_cache.clone(), v_cache.clone()
    scale = dim ** -0.5 if scale is None else scale
    len_new = 0 if k is None else k.shape[1]
    outs, lses = [], []
    for b in range(batch):
        cache_len = sequence_cache(k_cache, b, batch_idx, block_table).shape[0]
        start = cache_len if seqlens is None else seqlens[b]
        first = 0 if leftpad is None else leftpad[b]
        qb = q[b]
        if rotary_cos is not None:
            rows = torch.arange(len_q) if (causal or window != (-1, -1)) else torch.zeros(len_q, dtype=torch.long)
            qb = rotate(qb, rotary_cos, rotary_sin, start + rows, interleaved)
        if len_new:
            kb = k[b]
            if rotary_cos is not None:
                kb = rotate(kb, rotary_cos, rotary_sin, start + torch.arange(len_new), interleaved)
            for t in range(len_new):
                write_key(k_cache, b, start + t, kb[t], batch_idx, block_table)
                write_key(v_cache, b, start + t, v[b, t], batch_idx, block_table)
        keys = sequence_cache(k_cache, b, batch_idx, block_table)
        values = sequence_cache(v_cache, b, batch_idx, block_table)
        end = start + len_new
        group = heads // keys.shape[1]
        kx = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # (H, C, E)
        vx = values.repeat_interleave(group, dim=1).transpose(0, 1)
        s = (qb.transpose(0, 1) @ kx.transpose(1, 2)) * scale  # (H, Lq, C)
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        i = torch.arange(len_q, device=q.device)[:, None] + end - len_q  # the key each query row sits at
        j = torch.arange(keys.shape[0], device=q.device)[None, :]
        if alibi is not None:
            slopes = (alibi[b] if alibi.dim() == 2 else alibi).to(s.dtype)
            s = s - slopes[:, None, None] * (i - j).abs().to(s.dtype)
        seen = ((j >= first) & (j < end)).expand(len_q, -1)
        if causal:
            seen = seen & (j <= i)
        if window[0] >= 0:
            seen = seen & (j >= i - window[0])
        if window[1] >= 0:
            seen = seen & (j <= i + window[1])
        s = s.masked_fill(~seen, float("-inf"))
        wide = torch.float64 if q.dtype == torch.float64 else torch.float32
        dead = ~seen.any(1)  # (Lq,)
        lse = torch.logsumexp(s.to(wide), dim=-1).masked_fill(dead, float("-inf"))
        p = torch.softmax(s.masked_fill(dead[:, None], 0.0), dim=-1)
        outs.append((p @ vx).masked_fill(dead[:, None], 0.0).transpose(0, 1))
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses), k_cache, v_cache

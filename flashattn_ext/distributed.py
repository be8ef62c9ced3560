"""Ring attention over torch.distributed: exact attention on a sequence split across ranks.

Each rank of a process group holds a shard (batch, seq_len / P, heads, head_dim) of q, k and v.
The forward walks a ring of P steps: at step t rank r attends to the key/value shard of rank
r - t, while that shard is already being passed on to rank r + 1 and the next one received
(asynchronous point-to-point, on a separate stream on CUDA); the partial outputs are merged in
fp32 through their log-sum-exp. The backward walks the ring again with the global output and
log-sum-exp: every block's flashattn::bwd gives exact gradients, dq accumulates locally, and
the dk / dv accumulators travel with their key/value shard and come home after P steps.
Which op calls one step makes (layouts, masks, skipped blocks) is _ring_plan.py's job."""
import math

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from ._checks import check_features, check_fwd_args, check_scale
from ._ring_plan import LAYOUTS, alibi_terms, block_calls, ring_steps, shard_chunks, zigzag_chunk_ids
from .functional import _check_tensors, _real, _window
from .ops import FEATURES, autocast_inputs, rows_contiguous, run_bwd, run_fwd

__all__ = ["ring_attention", "zigzag_shard", "zigzag_unshard"]

_comm_streams = {}  # one communication stream per CUDA device, reused across calls


def _group_info(group):
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("flashattn_ext.distributed: the default process group is not initialised; call "
                           "torch.distributed.init_process_group(backend='nccl' for CUDA tensors or 'gloo' for CPU "
                           "tensors) on every rank first")
    rank = dist.get_rank(group)
    if rank < 0:
        raise RuntimeError("flashattn_ext.distributed: this process is not a member of the given group; every rank "
                           "that calls ring_attention must belong to it")
    return rank, dist.get_world_size(group)


class _Ring:
    """Passing tensors to the next rank of the group while receiving from the previous one."""

    def __init__(self, group, rank, world, device):
        self.group, self.rank, self.world = group, rank, world
        self.stream = None
        if device.type == "cuda":
            self.stream = _comm_streams.get(device)
            if self.stream is None:
                self.stream = _comm_streams[device] = torch.cuda.Stream(device)

    def start(self, tensors, first_tag=0, hops=1):
        """Sends `tensors` `hops` ranks on (the next one by default) and receives the tensors of
        the same shapes from as many ranks back; call wait() on the result to get them. The
        tensors sent must stay untouched until then. Transfers in flight together take distinct
        tags (gloo matches messages by tag)."""
        received = [torch.empty_like(t) for t in tensors]
        to, source = (self.rank + hops) % self.world, (self.rank - hops) % self.world
        ops = [dist.P2POp(dist.isend, t, group=self.group, group_peer=to, tag=first_tag + i)
               for i, t in enumerate(tensors)]
        ops += [dist.P2POp(dist.irecv, t, group=self.group, group_peer=source, tag=first_tag + i)
                for i, t in enumerate(received)]
        if self.stream is None:
            return _Transfer(dist.batch_isend_irecv(ops), tensors, received)
        # The communication stream starts after what the compute stream has queued so far (the
        # tensors to send are ready), then runs beside the attention of this step.
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            works = dist.batch_isend_irecv(ops)
        return _Transfer(works, tensors, received)


class _Transfer:
    def __init__(self, works, sent, received):
        self.works, self.sent, self.received = works, sent, received

    def wait(self):
        """The received tensors; on CUDA the current stream waits for them (the host does not)."""
        for w in self.works:
            w.wait()
        self.sent = None
        return self.received


class _Plan:
    """Everything a call needs besides the tensors: the ring, the layout, the op arguments."""

    def __init__(self, ring, rank, shard_len, layout, scale, causal, window, softcap, alibi_slopes, deterministic):
        self.ring, self.rank = ring, rank
        self.scale, self.causal, self.window, self.softcap = scale, causal, window, softcap
        self.alibi_slopes, self.deterministic = alibi_slopes, deterministic
        world = ring.world
        self.chunks = [shard_chunks(r, world, shard_len, layout) for r in range(world)]
        self.steps = ring_steps(world, shard_len, layout, causal, *window)
        self._calls = {}

    def calls(self, src):
        """The op calls of this rank's queries with the keys of rank `src`."""
        if src not in self._calls:
            self._calls[src] = block_calls(self.chunks[self.rank], self.chunks[src], self.causal, *self.window,
                                           self.alibi_slopes is not None)
        return self._calls[src]

    def op_args(self, call, device, bias_dtype):
        """The op's feature arguments for `call` (in schema order), and the amount (batch or 1,
        heads, rows) to add to the call's log-sum-exp (None when none): ALiBi between disjoint
        ranges is a per-key bias plus a per-query constant (see _ring_plan.alibi_terms), computed
        in `bias_dtype` (float64 for float64 inputs, where the op's own ALiBi is exact in float64
        too)."""
        features = dict(window_left=call.window_left, window_right=call.window_right, softcap=self.softcap)
        slopes, lse_shift = self.alibi_slopes, None
        if slopes is not None and call.diagonal:
            features["alibi_slopes"] = slopes
        elif slopes is not None:
            features["attn_bias"], lse_shift = self._alibi_split(call, device, bias_dtype)
        return tuple(features.get(name, default) for name, default in FEATURES), lse_shift

    def _alibi_split(self, call, device, bias_dtype):
        """ALiBi between disjoint ranges: the per-key bias (batch or 1, heads, 1, keys) and the
        per-query term (batch or 1, heads, rows) of _ring_plan.alibi_terms."""
        slopes = self.alibi_slopes
        (k_first, k_step), (q_first, q_step) = alibi_terms(call)
        slopes = (slopes if slopes.dim() == 2 else slopes[None]).to(bias_dtype)
        key_offsets = k_first + k_step * torch.arange(call.k_end - call.k_start, device=device, dtype=bias_dtype)
        query_offsets = q_first + q_step * torch.arange(call.q_end - call.q_start, device=device, dtype=bias_dtype)
        return (-slopes[:, :, None, None] * key_offsets).contiguous(), -slopes[:, :, None] * query_offsets


def _acc_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _heads_view(t, call=None, rows="q"):
    """(batch, len, heads, dim) -> the op's (batch, heads, len, dim) view, rows of `call` only."""
    t = t.transpose(1, 2)
    if call is None:
        return t
    return t[:, :, call.q_start:call.q_end] if rows == "q" else t[:, :, call.k_start:call.k_end]


def _merge_into(out_acc, lse_acc, out_part, lse_part):
    """out_acc, lse_acc (slices of the running result, updated in place) combined with one
    block's out_part (batch, len, heads, dim) and lse_part (batch, heads, len)."""
    lse = torch.logaddexp(lse_acc, lse_part)
    ref = lse.masked_fill(lse == float("-inf"), 0.0)  # rows no key has reached yet: both weights 0
    w_acc = torch.exp(lse_acc - ref).transpose(1, 2)[..., None]
    w_part = torch.exp(lse_part - ref).transpose(1, 2)[..., None]
    out_acc.mul_(w_acc).addcmul_(out_part, w_part)  # in place: no accumulator-sized temporary
    lse_acc.copy_(lse)


class _RingAttention(torch.autograd.Function):
    """q, k, v: this rank's shards (batch, len, heads, dim), k and v contiguous."""

    @staticmethod
    def forward(ctx, q, k, v, plan):
        ring = plan.ring
        acc = _acc_dtype(q.dtype)
        batch, length, heads = q.shape[:3]
        out_acc = q.new_zeros((batch, length, heads, v.shape[3]), dtype=acc)
        lse_acc = q.new_full((batch, heads, length), float("-inf"), dtype=acc)
        kv = (k, v)
        for step in range(plan.steps):
            src = (plan.rank - step) % ring.world
            transfer = ring.start(kv) if step < plan.steps - 1 else None
            for call in plan.calls(src):
                features, lse_shift = plan.op_args(call, q.device, _acc_dtype(q.dtype))
                out, lse = run_fwd(_heads_view(q, call), _heads_view(kv[0], call, "k"), _heads_view(kv[1], call, "k"),
                                   plan.scale, call.causal, plan.deterministic, *features)
                if lse_shift is not None:
                    lse = lse + lse_shift.to(lse.dtype)
                rows = slice(call.q_start, call.q_end)
                _merge_into(out_acc[:, rows], lse_acc[:, :, rows], out.transpose(1, 2), lse)
            if transfer is not None:
                kv = transfer.wait()
        out = out_acc.to(q.dtype)
        lse = lse_acc.to(_acc_dtype(q.dtype))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan = plan
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        plan = ctx.plan
        ring = plan.ring
        acc = _acc_dtype(q.dtype)
        dout = torch.zeros_like(out) if dout is None else dout.contiguous()
        dq_acc = torch.zeros_like(q, dtype=acc)
        kv, dkv_transfer = (k, v), None
        for step in range(plan.steps):
            src = (plan.rank - step) % ring.world
            kv_transfer = ring.start(kv) if step < plan.steps - 1 else None
            grads = [(call, _block_backward(plan, call, dout, q, kv, out, lse, dlse)) for call in plan.calls(src)]
            if dkv_transfer is None:
                dk_acc, dv_acc = torch.zeros_like(k, dtype=acc), torch.zeros_like(v, dtype=acc)
            else:
                dk_acc, dv_acc = dkv_transfer.wait()  # accumulated by the ranks before, for shard `src`
            for call, (dq, dk, dv) in grads:
                dq_acc[:, call.q_start:call.q_end] += dq.transpose(1, 2)
                dk_acc[:, call.k_start:call.k_end] += dk.transpose(1, 2)
                dv_acc[:, call.k_start:call.k_end] += dv.transpose(1, 2)
            # The accumulators follow their key/value shard; after the last step they go home: one
            # more hop after a whole ring, straight back `step` ranks after a ring stopped early.
            hops = 1 if step < plan.steps - 1 else (ring.world - step) % ring.world
            dkv_transfer = ring.start((dk_acc, dv_acc), first_tag=2, hops=hops) if hops else None
            if kv_transfer is not None:
                kv = kv_transfer.wait()
        if dkv_transfer is not None:
            dk_acc, dv_acc = dkv_transfer.wait()
        return dq_acc.to(q.dtype), dk_acc.to(k.dtype), dv_acc.to(v.dtype), None


def _block_backward(plan, call, dout, q, kv, out, lse, dlse):
    """dq, dk, dv of one block from the global out and lse: P = exp(S - lse) is then the
    block's part of the global softmax, so each block's gradients are exact parts of the sum."""
    rows = slice(call.q_start, call.q_end)
    features, lse_shift = plan.op_args(call, q.device, _acc_dtype(q.dtype))
    lse_rows = lse[:, :, rows]
    # The op forms P = exp(S' - lse) from its own scores S'; where ALiBi's per-query term was
    # left out of S', it comes off the global lse instead.
    lse_rows = (lse_rows - lse_shift.to(lse.dtype)) if lse_shift is not None else lse_rows.contiguous()
    dlse_rows = dlse[:, :, rows].contiguous() if dlse is not None else None
    dq, dk, dv, _ = run_bwd(
        _heads_view(dout, call), _heads_view(q, call), _heads_view(kv[0], call, "k"), _heads_view(kv[1], call, "k"),
        _heads_view(out, call), lse_rows, dlse_rows, plan.scale, call.causal,
        plan.deterministic or torch.are_deterministic_algorithms_enabled(), *features, False)
    return dq, dk, dv


_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
_DEVICE_TYPES = ("cpu", "cuda", "other")


def _describe(name, values):
    """A field of _check_shards_agree as the user gave it."""
    values = [int(x) if x == int(x) else x for x in values]
    if name == "dtype":
        return str(_DTYPES[values[0]]).replace("torch.", "")
    if name == "device type":
        return _DEVICE_TYPES[values[0]]
    return str(tuple(values)) if len(values) > 1 else str(values[0])


def _check_shards_agree(group, rank, world, q, k, v, args):
    """One all_gather of a small description of every rank's shards and arguments; every rank
    raises the same error when they differ (so none is left waiting in the ring)."""
    device_type = q.device.type if q.device.type in _DEVICE_TYPES else "other"
    fields = [("q shape", tuple(q.shape)), ("k shape", tuple(k.shape)), ("v shape", tuple(v.shape)),
              ("dtype", (_DTYPES.index(q.dtype),)), ("device type", (_DEVICE_TYPES.index(device_type),))]
    fields += [(name, (float(value),)) for name, value in args]
    mine = [float(x) for _, values in fields for x in values]
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    gathered = [torch.empty(len(mine), dtype=torch.float64, device=device) for _ in range(world)]
    dist.all_gather(gathered, torch.tensor(mine, dtype=torch.float64, device=device), group=group)
    for other, theirs in enumerate(torch.stack(gathered).cpu().tolist()):
        pos = 0
        for name, values in fields:
            end = pos + len(values)
            if theirs[pos:end] != mine[pos:end]:
                raise ValueError(f"flashattn_ext.ring_attention: every rank must pass shards of the same shape, "
                                 f"dtype and device type and the same arguments, but {name} is "
                                 f"{_describe(name, mine[pos:end])} on rank {rank} and "
                                 f"{_describe(name, theirs[pos:end])} on rank {other}")
            pos = end


def ring_attention(q, k, v, group=None, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                   alibi_slopes=None, deterministic=False, layout=None, return_lse=False):
    """Exact attention over a sequence sharded across the ranks of `group` (default: the world).

    q, k, v: this rank's shards (batch, shard_len, heads, head_dim), flash-attn layout; k and v
    may have fewer heads than q (GQA). Every rank passes shards of the same shape, dtype and
    device type and the same arguments. layout: which global positions a shard holds --
    "zigzag" (chunks r and 2P-1-r of 2P equal chunks; the default when causal, see
    zigzag_shard) or "contiguous" (positions [r n, (r + 1) n); the default otherwise). The
    options act on global positions as in flash_attn_func on the whole sequence (causal mask,
    window (left, right), softcap, ALiBi). Returns this rank's rows of the output (batch,
    shard_len, heads, head_dim_v), and with return_lse=True also their log-sum-exp (batch,
    heads, shard_len) in float32 (float64 for float64 inputs). Differentiable in q, k, v."""
    def four_d(name, t):
        if t.dim() != 4:
            raise ValueError(f"flashattn_ext.ring_attention: {name} must have 4 dimensions (batch, shard_len, heads, "
                             f"head_dim), got shape {tuple(t.shape)}")

    _check_tensors((("q", q), ("k", k), ("v", v)), four_d)
    rank, world = _group_info(group)
    q, k, v, _ = autocast_inputs(q.device.type, q, k, v, None)  # in an autocast region, its dtype (as the ops)
    q, k, v = rows_contiguous(q), rows_contiguous(k), rows_contiguous(v)
    causal = bool(causal)
    layout = layout if layout is not None else ("zigzag" if causal else "contiguous")
    if layout not in LAYOUTS:
        raise ValueError(f"flashattn_ext.ring_attention: layout must be one of {LAYOUTS} (or None), got {layout!r}")
    window = _window(window_size)
    softcap = _real(softcap, "softcap", " >= 0 (0 = off)")
    scale = _real(softmax_scale, "softmax_scale") if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    check_fwd_args(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0, layout="blhd")
    check_features(q.transpose(1, 2), k.transpose(1, 2), 0, window_left=window[0], window_right=window[1],
                   alibi_slopes=alibi_slopes, softcap=softcap)
    check_scale(scale, q.dtype, "softmax_scale", "flashattn_ext.ring_attention")
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"flashattn_ext.ring_attention: q and k must be shards of one sequence (the same shard_len), "
                         f"got {q.shape[1]} and {k.shape[1]}")
    if layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(f"flashattn_ext.ring_attention: a zigzag shard holds two equal chunks, so shard_len must be "
                         f"even, got {q.shape[1]}")
    if q.device.type == "cpu" and dist.get_backend(group) == "nccl":
        raise ValueError("flashattn_ext.ring_attention: q, k, v are on the CPU but the group's backend is nccl (CUDA "
                         "only); use a gloo group for CPU tensors")
    _check_shards_agree(group, rank, world, q, k, v,
                        (("causal", causal), ("layout", LAYOUTS.index(layout)), ("window_size left", window[0]),
                         ("window_size right", window[1]), ("softcap", softcap), ("softmax_scale", scale),
                         ("alibi_slopes given", alibi_slopes is not None), ("deterministic", bool(deterministic))))
    ring = _Ring(group, rank, world, q.device)
    plan = _Plan(ring, rank, q.shape[1], layout, scale, causal, window, softcap, alibi_slopes, bool(deterministic))
    out, lse = _RingAttention.apply(q, k.contiguous(), v.contiguous(), plan)
    return (out, lse) if return_lse else out


def _group_and_size(x, dim, group):
    rank, world = _group_info(group)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"flashattn_ext: x must be a torch.Tensor, got {type(x).__name__}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"flashattn_ext: dim must index one of x's {x.dim()} dimensions, got {dim}")
    return rank, world, dim % x.dim()


def zigzag_shard(x, dim, group=None):
    """This rank's zigzag shard of the whole sequence `x` along `dim`: of 2P equal chunks,
    chunk r followed by chunk 2P - 1 - r (a copy). x.shape[dim] must be a multiple of 2P."""
    rank, world, dim = _group_and_size(x, dim, group)
    if x.shape[dim] % (2 * world):
        raise ValueError(f"flashattn_ext.zigzag_shard: the length along dim {dim} ({x.shape[dim]}) must be a "
                         f"multiple of 2 * world_size = {2 * world}")
    chunks = x.chunk(2 * world, dim)
    return torch.cat([chunks[i] for i in zigzag_chunk_ids(rank, world)], dim)


def zigzag_unshard(x, dim, group=None):
    """The whole sequence from every rank's zigzag shard `x` along `dim` (an all_gather; every
    rank gets the result; not differentiable)."""
    rank, world, dim = _group_and_size(x, dim, group)
    if x.shape[dim] % 2:
        raise ValueError(f"flashattn_ext.zigzag_unshard: a zigzag shard holds two equal chunks, so its length along "
                         f"dim {dim} must be even, got {x.shape[dim]}")
    x = x.contiguous()
    shards = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(shards, x, group=group)
    chunks = [None] * (2 * world)
    for r, shard in enumerate(shards):
        early, late = shard.chunk(2, dim)
        chunks[zigzag_chunk_ids(r, world)[0]], chunks[zigzag_chunk_ids(r, world)[1]] = early, late
    return torch.cat(chunks, dim)

"""Causal attention over a context-parallel group, its keys and values exchanged by a ring
of point-to-point transfers (``p2p``) or gathered once (``all_gather``).

Each rank holds the queries, keys and values of its two chunks (``r`` and ``2c - 1 - r``;
megatron/mpu/context_parallel.py). In step ``t`` of ``c`` a rank attends to the keys and
values of rank ``src = r - t``; what its queries see of them is known from the chunk ids
(:func:`step_plan`), so every step costs every rank the same ``2m x m`` (or ``m x 2m``) block:

- ``src == r``: all local queries against all local keys, causal (local order is global order);
- ``src < r``: all local queries against src's first chunk (wholly in the past), no mask;
- ``src > r``: the local second chunk against all of src's keys (wholly in its past).

The blocks' outputs merge by their log-sum-exp (:mod:`.attention_blocks`). With a document
mask (the token layout's row 1) a query at global index ``i`` also needs ``j >= start(i)``.

``p2p``: the next step's keys and values travel (``batch_isend_irecv``: gloo and NCCL) while
this step computes. The backward runs the ring again: a rank adds its part of ``dK, dV`` for
``src`` to the accumulator that arrived with it and passes both on, so after ``c`` steps each
accumulator is back with its owner (as in Megatron-core / TransformerEngine's ring).
``all_gather``: keys and values all-gathered in the forward, their gradients reduce-scattered
in the backward (gloo: all-reduce and keep the slice).

Reference reading: Megatron-core's and TransformerEngine's ``AttnFuncWithCPAndKVP2P`` and
torchtitan's ring attention (load-balanced causal sharding); the code here is independent.
"""
from typing import Optional

import torch
import torch.distributed as dist

from .attention_blocks import BlockMask, block_backward, block_forward, merge_blocks
from .mappings import _all_gather_single
from .context_parallel import load_balanced_indices


def step_plan(rank: int, src: int, m: int):
    """``(query rows, key columns, causal)`` of the local queries that see ``src``'s keys."""
    if src == rank:
        return slice(0, 2 * m), slice(0, 2 * m), True
    if src < rank:
        return slice(0, 2 * m), slice(0, m), False
    return slice(m, 2 * m), slice(0, 2 * m), False


def _mask_fn(q_idx, k_idx, doc, causal):
    """The :class:`BlockMask` of a block, or None (every query sees every key)."""
    if not causal and doc is None:
        return None
    if doc is None:
        return BlockMask(True, None)  # a diagonal block: the kernels' own causal mask

    def allowed(lo, hi):  # -> bool [b, 1, 1, rows, sk], True = attend
        mask = k_idx[None, None, :] >= doc[:, lo:hi, None]  # [b, rows, sk]: in the document
        if causal:
            mask = mask & (k_idx[None, :] <= q_idx[lo:hi, None])
        return mask.view(doc.shape[0], 1, 1, hi - lo, k_idx.numel())

    return BlockMask(causal, allowed)


class _Ring:
    """Keys and values around the ring: each :meth:`get` returns this step's and already
    sends them on to the next rank (received by :meth:`get` of the next step)."""

    def __init__(self, kv, group, steps):
        self.group, self.steps, self.current, self.pending = group, steps, kv, None
        ranks = dist.get_process_group_ranks(group)
        me = dist.get_rank(group)
        self.next, self.prev = ranks[(me + 1) % len(ranks)], ranks[(me - 1) % len(ranks)]

    def exchange(self, send, recv, tag=0):
        """Send to the next rank, receive from the previous one (tags keep the keys and
        values apart from the gradients on gloo; NCCL matches by order, the same here)."""
        ops = [dist.P2POp(dist.isend, send, self.next, self.group, tag),
               dist.P2POp(dist.irecv, recv, self.prev, self.group, tag)]
        return dist.batch_isend_irecv(ops)

    def get(self, step):
        if self.pending is not None:
            for request in self.pending[0]:
                request.wait()
            self.current, self.pending = self.pending[1], None
        if step < self.steps - 1:
            incoming = torch.empty_like(self.current)
            self.pending = (self.exchange(self.current, incoming), incoming)
        return self.current


class _Gathered:
    """Every rank's keys and values, all-gathered once."""

    def __init__(self, kv, group):
        world = dist.get_world_size(group)
        self.all = torch.empty((world,) + tuple(kv.shape), dtype=kv.dtype, device=kv.device)
        _all_gather_single(self.all.view(-1), kv.reshape(-1), group=group)
        self.rank, self.world = dist.get_rank(group), world

    def get(self, step):
        return self.all[(self.rank - step) % self.world]


def _source(kv, group, comm_type):
    if comm_type == "all_gather":
        return _Gathered(kv, group)
    return _Ring(kv, group, dist.get_world_size(group))


class _RingGradients:
    """``dK, dV`` accumulators travelling with the ring (see the module docstring)."""

    def __init__(self, ring):
        self.ring, self.pending = ring, None

    def add(self, step, part):
        """Add this rank's part for this step's source; pass the sum on."""
        if self.pending is not None:
            for request in self.pending[0]:
                request.wait()
            part = part + self.pending[1]
        incoming = torch.empty_like(part)
        self.pending = (self.ring.exchange(part, incoming, tag=1), incoming)

    def finish(self):
        for request in self.pending[0]:
            request.wait()
        return self.pending[1]


class _GatheredGradients:
    """``dK, dV`` of every rank's keys, reduce-scattered to their owners at the end."""

    def __init__(self, gathered, like, group):
        self.gathered, self.group = gathered, group
        self.all = torch.zeros((gathered.world,) + tuple(like.shape), dtype=torch.float32,
                               device=like.device)

    def add(self, step, part):
        self.all[(self.gathered.rank - step) % self.gathered.world] += part

    def finish(self):
        group, world = self.group, self.gathered.world
        if dist.get_backend(group) == "gloo":  # no reduce-scatter on gloo
            dist.all_reduce(self.all, group=group)
            return self.all[self.gathered.rank].clone()
        out = torch.empty_like(self.all[0])
        dist.reduce_scatter_tensor(out, self.all.view(world * out.shape[0], *out.shape[1:]),
                                   group=group)
        return out


class ContextParallelAttention(torch.autograd.Function):
    """Causal attention of the local queries over the whole sequence of a context-parallel
    group (see the module docstring); an autograd function with its own backward.

    ``forward(q [b, n, g, 2m, d], k [b, n, 2m, d], v, doc [b, 2m] int64 or None, scale,
    group, comm_type) -> [b, n, g, 2m, d]``.
    """

    @staticmethod
    def forward(ctx, q, k, v, doc, scale, group, comm_type):
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        m = q.shape[3] // 2
        source = _source(torch.stack([k, v]), group, comm_type)  # [2, b, n, 2m, d]
        b, n, g, s, d = q.shape
        # sequence first in memory: the caller's [s, b, heads * d] is then a view of it, so
        # the output kept here and the next layer's input are one tensor
        out = torch.zeros((s, b, n, g, d), dtype=torch.float32,
                          device=q.device).permute(1, 2, 3, 0, 4)  # [b, n, g, 2m, d]
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        for step in range(cp):
            kv = source.get(step)
            rows, cols, mask = _plan(rank, step, cp, m, doc, q.device)
            block = block_forward(q[..., rows, :], kv[0][..., cols, :], kv[1][..., cols, :],
                                  scale, mask)
            out[..., rows, :], lse[..., rows] = merge_blocks(out[..., rows, :], lse[..., rows],
                                                             *block)
        result = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse, doc)
        ctx.scale, ctx.group, ctx.comm_type = scale, group, comm_type
        return result

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, doc = ctx.saved_tensors
        group = ctx.group
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        m = q.shape[3] // 2
        delta = (dout.float() * out.float()).sum(-1)  # [b, n, g, 2m]
        kv = torch.stack([k, v])
        source = _source(kv, group, ctx.comm_type)
        sink = _GatheredGradients(source, kv, group) if ctx.comm_type == "all_gather" \
            else _RingGradients(source)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        for step in range(cp):
            kv_src = source.get(step)
            rows, cols, mask = _plan(rank, step, cp, m, doc, q.device)
            dq_part, dk, dv = block_backward(
                q[..., rows, :], kv_src[0][..., cols, :], kv_src[1][..., cols, :],
                out[..., rows, :], dout[..., rows, :], lse[..., rows], delta[..., rows],
                ctx.scale, mask)
            dq[..., rows, :] += dq_part
            part = torch.zeros((2,) + tuple(k.shape), dtype=torch.float32, device=q.device)
            part[0][..., cols, :], part[1][..., cols, :] = dk, dv
            sink.add(step, part)
        dkv = sink.finish()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


def _plan(rank, step, cp, m, doc, device):
    """The step's query rows, key columns and mask function (see :func:`step_plan`)."""
    src = (rank - step) % cp
    rows, cols, causal = step_plan(rank, src, m)
    q_idx = load_balanced_indices(2 * m * cp, rank, cp, device)[rows]
    k_idx = load_balanced_indices(2 * m * cp, src, cp, device)[cols]
    return rows, cols, _mask_fn(q_idx, k_idx, None if doc is None else doc[:, rows], causal)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   doc: Optional[torch.Tensor], scale: float, group,
                   comm_type: str = "p2p") -> torch.Tensor:
    """:class:`ContextParallelAttention` on ``[s_local, b, heads, d]`` tensors.

    Args:
        q: ``[2m, b, np, d]`` local queries (load-balanced order).
        k, v: ``[2m, b, nkv, d]``, ``np`` a multiple of ``nkv`` (grouped-query attention
            travels the ring with its ``nkv`` heads, not repeated).
        doc: ``[b, 2m]`` document starts (global indices), or None.
        scale: multiplies ``q k^T``.
        group: the context-parallel group.
        comm_type: ``p2p`` or ``all_gather``.

    Returns:
        ``[2m, b, np * d]``.
    """
    s, b, heads, d = q.shape
    kv_heads = k.shape[2]
    q5 = q.permute(1, 2, 0, 3).reshape(b, kv_heads, heads // kv_heads, s, d)
    k4, v4 = k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)  # [b, nkv, 2m, d]
    out = ContextParallelAttention.apply(q5, k4, v4, doc, scale, group, comm_type)
    return out.reshape(b, heads, s, d).permute(2, 0, 1, 3).reshape(s, b, heads * d)

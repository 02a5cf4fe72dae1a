"""The attention a decoder built from mpu layers calls: causal, with a document mask when
the token layout carries one, over the context-parallel group when there is one.

:func:`context_parallel_attention` takes queries, keys and values ``[s_local, b, heads, d]``
(the local heads of this tensor-parallel rank; keys and values may have fewer heads,
grouped-query attention) and the token layout (megatron/mpu/context_parallel.py), and
returns ``[s_local, b, heads * d]``:

- cp 1: ``scaled_dot_product_attention`` (``is_causal``, or the layout's dense mask);
- ``p2p`` / ``all_gather``: ring attention (megatron/mpu/ring_attention.py);
- ``a2a`` (DeepSpeed-Ulysses, Jacobs et al. 2023): an all-to-all gives each rank the whole
  sequence of ``heads / cp`` heads, attention runs as at cp 1, and a second all-to-all
  returns the rank's tokens of every head. The heads must divide by cp.

Under ``torch.compile`` (after ``megatron.model.compile.prepare_for_compile``, which
``--compile`` runs) the context-parallel forms are one eager call (``torch.compiler.disable``):
one graph break per attention call (docs/scale_out.md). The wrapper is built then, not at
import: ``torch.compiler.disable`` imports dynamo, about a second on every rank.
"""
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import parallel_state as ps
from .context_parallel import layout_doc_starts, load_balanced_indices
from .ring_attention import ring_attention

CP_COMM_TYPES = ("p2p", "all_gather", "a2a")
#: SDPA kernels for an fp16 masked call on CUDA: all but cuDNN's, whose masked backward gave
#: non-finite gradients there (megatron/model/attention.py says where it was seen).
_MASKED_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               layout: Optional[torch.Tensor] = None, *,
                               scale: Optional[float] = None, comm_type: str = "p2p",
                               group=None) -> torch.Tensor:
    """Causal self-attention of a decoder, context-parallel when the group has > 1 rank.

    Args:
        q: ``[s_local, b, np, d]`` queries (load-balanced order under context parallelism).
        k, v: ``[s_local, b, nkv, d]``, ``np`` a multiple of ``nkv``.
        layout: the token layout ``[1 or 2, b, s_local]`` (row 1: document starts), or None
            for plain causal attention.
        scale: multiplies ``q k^T`` (default ``1 / sqrt(d)``).
        comm_type: ``p2p``, ``all_gather`` or ``a2a`` (:data:`CP_COMM_TYPES`).
        group: the context-parallel group (default: this rank's).

    Returns:
        ``[s_local, b, np * d]``.
    """
    if comm_type not in CP_COMM_TYPES:
        raise ValueError(f"unknown context-parallel comm type {comm_type!r}; choose one of "
                         f"{', '.join(CP_COMM_TYPES)}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"context_parallel_attention: {q.shape[2]} query heads are not a "
                         f"multiple of {k.shape[2]} key-value heads")
    group = ps.get_context_parallel_group() if group is None else group
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    doc = layout_doc_starts(layout)
    if dist.get_world_size(group) == 1:
        return local_attention(q, k, v, doc, scale)
    if _EAGER is not None and torch.compiler.is_compiling():
        return _EAGER(q, k, v, doc, scale, group, comm_type)
    return _distributed(q, k, v, doc, scale, group, comm_type)


_EAGER = None
"""``torch.compiler.disable(_distributed)`` once :func:`eager_under_compile` ran."""


def eager_under_compile():
    """Make the context-parallel attention one eager call inside compiled code (idempotent;
    :func:`megatron.mpu.random.fork_eagerly_under_compile` calls it)."""
    global _EAGER
    if _EAGER is None:
        _EAGER = torch.compiler.disable(_distributed)


def _distributed(q, k, v, doc, scale, group, comm_type):
    if comm_type == "a2a":
        return ulysses_attention(q, k, v, doc, scale, group)
    return ring_attention(q, k, v, doc, scale, group, comm_type)


def local_attention(q, k, v, doc, scale):
    """Causal attention over a whole sequence through SDPA, within documents when ``doc``
    (``[b, s]`` document starts) is given. ``[s, b, heads, d]`` in, ``[s, b, np * d]`` out."""
    s, b, heads, d = q.shape
    if k.shape[2] != heads:
        k, v = (t.repeat_interleave(heads // k.shape[2], dim=2) for t in (k, v))
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, n, s, d]
    if doc is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        idx = torch.arange(s, device=q.device)
        allowed = (idx[None, :] <= idx[:, None])[None] & (idx[None, None, :] >= doc[:, :, None])
        # additive, contiguous, in the queries' dtype: what the fused kernels take
        mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(
            ~allowed, torch.finfo(q.dtype).min)[:, None]  # [b, 1, s, s]
        if q.device.type == "cuda" and q.dtype == torch.float16:
            with sdpa_kernel(_MASKED_BACKENDS):
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.permute(2, 0, 1, 3).reshape(s, b, heads * d)


# ---------------------------------------------------------------- all-to-all (Ulysses)
class _SeqToHeads(torch.autograd.Function):
    """``[s_local, b, n, d] -> [cp * s_local, b, n / cp, d]``: every rank's tokens of this
    rank's ``n / cp`` heads (rank-major order); the backward is the inverse all-to-all."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad, ctx.group), None


class _HeadsToSeq(torch.autograd.Function):
    """The inverse of :class:`_SeqToHeads`."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad, ctx.group), None


def _seq_to_heads(x, group):
    cp = dist.get_world_size(group)
    s, b, n, d = x.shape
    send = x.reshape(s, b, cp, n // cp, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)  # [cp (source rank), s, b, n / cp, d]
    dist.all_to_all_single(recv, send, group=group)
    return recv.view(cp * s, b, n // cp, d)


def _heads_to_seq(x, group):
    cp = dist.get_world_size(group)
    full, b, part, d = x.shape
    send = x.reshape(cp, full // cp, b, part, d).contiguous()
    recv = torch.empty_like(send)  # [cp (head group), s_local, b, n / cp, d]
    dist.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 2, 0, 3, 4).reshape(full // cp, b, cp * part, d)


def ulysses_attention(q, k, v, doc, scale, group):
    """The ``a2a`` form (module docstring); ``[s_local, b, heads, d]`` in,
    ``[s_local, b, np * d]`` out."""
    cp, s_local = dist.get_world_size(group), q.shape[0]
    heads = q.shape[2]
    if heads % cp:
        raise ValueError(f"--cp-comm-type a2a gives each of {cp} context-parallel ranks whole "
                         f"heads, but this rank has {heads}; use p2p or all_gather")
    if k.shape[2] % cp:  # too few key-value heads to split: send them repeated
        k, v = (t.repeat_interleave(heads // k.shape[2], dim=2) for t in (k, v))
    order = torch.cat([load_balanced_indices(s_local * cp, r, cp, q.device)
                       for r in range(cp)])  # global index of each gathered position
    natural = torch.argsort(order)
    q, k, v = (_SeqToHeads.apply(t, group).index_select(0, natural) for t in (q, k, v))
    if doc is not None:
        every = [torch.empty_like(doc) for _ in range(cp)]
        dist.all_gather(every, doc.contiguous(), group=group)
        doc = torch.cat(every, dim=1).index_select(1, natural)  # [b, s]
    out = local_attention(q, k, v, doc, scale)  # [s, b, (np / cp) * d], natural order
    out = out.index_select(0, order).view(cp * s_local, q.shape[1], heads // cp, q.shape[3])
    return _HeadsToSeq.apply(out, group).reshape(s_local, q.shape[1], heads * q.shape[3])

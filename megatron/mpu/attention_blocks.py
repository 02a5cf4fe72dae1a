"""Attention of a block of queries against a block of keys, returning the log-sum-exp, and
its backward from the *final* output and log-sum-exp: the arithmetic of ring attention.

Blockwise softmax attention (Milakov & Gimelshein 2018; Rabe & Staats 2021; FlashAttention,
Dao et al. 2022): a block's output ``O_j = softmax(S_j) V_j`` with ``lse_j = logsumexp(S_j)``
merges with the others' as ``lse = log(sum_j exp(lse_j))``, ``O = sum_j exp(lse_j - lse) O_j``
(:func:`merge_blocks`). The backward needs no block's own statistics: with the final
``O`` and ``lse``, ``P_j = exp(S_j - lse)``, ``dV_j = P_j^T dO``, ``dS_j = P_j (dO V_j^T - D)``
with ``D = rowsum(dO * O)``, ``dQ += dS_j K_j``, ``dK_j = dS_j^T Q``.

Shapes are heads first and grouped for grouped-query attention: queries
``[b, kv_heads, group, sq, d]``, keys and values ``[b, kv_heads, sk, d]`` (``group`` query
heads share a key-value head: the heads ``repeat_interleave`` would give). The arithmetic is
fp32 whatever the inputs' dtype. Queries are taken ``tile_rows`` at a time so the fp32 score
tiles stay bounded (:func:`tile_rows`): this is plain PyTorch on any device (CPU and CUDA),
not a fused kernel.

``mask`` is a function ``mask(row_start, row_end) -> bool [b or 1, 1, 1, rows, sk]`` (True =
attend) or None for a block every query sees whole.
"""
import math
from typing import Callable, Optional, Tuple

import torch

#: Bytes of one fp32 score tile ``[b, heads, rows, sk]`` (the backward holds four at once).
TILE_BYTES = 32 * 2**20


def tile_rows(batch: int, heads: int, sq: int, sk: int, budget: Optional[int] = None) -> int:
    """Query rows per tile so that a ``[batch, heads, rows, sk]`` fp32 tile fits ``budget``
    (default :data:`TILE_BYTES`)."""
    budget = TILE_BYTES if budget is None else budget
    return max(1, min(sq, budget // max(1, 4 * batch * heads * sk)))


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  mask: Optional[Callable]) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(out [b, n, g, sq, d] fp32, lse [b, n, g, sq] fp32)`` of one block; a query row
    that sees no key has ``lse = -inf`` and a zero output.

    Args:
        q: ``[b, n, g, sq, d]``; k, v: ``[b, n, sk, d]``.
        scale: multiplies ``q k^T``.
        mask: see the module docstring.
    """
    b, n, g, sq, d = q.shape
    kf, vf = k.float()[:, :, None], v.float()[:, :, None]  # [b, n, 1, sk, d]
    step = tile_rows(b, n * g, sq, k.shape[2])
    outs, lses = [], []
    for lo in range(0, sq, step):
        hi = min(sq, lo + step)
        scores = torch.matmul(q[..., lo:hi, :].float(), kf.transpose(-1, -2)) * scale
        if mask is not None:  # [b, n, g, rows, sk]
            scores.masked_fill_(~mask(lo, hi), -math.inf)
        lse = torch.logsumexp(scores, dim=-1)  # [b, n, g, rows]
        probs = torch.exp(scores - _finite(lse)[..., None])  # a row with no key: all 0
        outs.append(torch.matmul(probs, vf))
        lses.append(lse)
    return torch.cat(outs, dim=3), torch.cat(lses, dim=3)


def _finite(lse):
    """``lse`` with -inf (a row that saw nothing) as 0, so ``exp(-inf - lse)`` is 0."""
    return torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))


def merge_blocks(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
                 block_lse: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Merge a block's ``(out, lse)`` into the running ``(out, lse)`` (all fp32)."""
    new_lse = torch.logaddexp(lse, block_lse)
    safe = _finite(new_lse)
    out = out * torch.exp(lse - safe)[..., None] + block_out * torch.exp(block_lse - safe)[..., None]
    return out, new_lse


def block_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   dout: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor, scale: float,
                   mask: Optional[Callable]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq [b, n, g, sq, d], dk [b, n, sk, d], dv [b, n, sk, d])``, fp32, of one block.

    Args:
        q, k, v, mask, scale: as in :func:`block_forward`.
        out: unused (kept for the call shape of a fused kernel's backward).
        dout: ``[b, n, g, sq, d]`` the gradient of the final output.
        lse: ``[b, n, g, sq]`` the final log-sum-exp (every row saw a key).
        delta: ``[b, n, g, sq]`` ``rowsum(dout * out)`` of the final output.
    """
    b, n, g, sq, d = q.shape
    sk = k.shape[2]
    kf, vf = k.float()[:, :, None], v.float()[:, :, None]  # [b, n, 1, sk, d]
    dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(b, n, sk, d, dtype=torch.float32, device=q.device)
    dv = torch.zeros_like(dk)
    step = tile_rows(b, n * g, sq, sk)
    for lo in range(0, sq, step):
        hi = min(sq, lo + step)
        qt, dot = q[..., lo:hi, :].float(), dout[..., lo:hi, :].float()
        scores = torch.matmul(qt, kf.transpose(-1, -2)) * scale  # [b, n, g, rows, sk]
        if mask is not None:
            scores.masked_fill_(~mask(lo, hi), -math.inf)
        probs = torch.exp(scores - lse[..., lo:hi, None])
        del scores
        dv += torch.matmul(probs.transpose(-1, -2), dot).sum(2)
        dprobs = torch.matmul(dot, vf.transpose(-1, -2))
        dscores = probs.mul_(dprobs.sub_(delta[..., lo:hi, None]))  # in place: P (dP - D)
        del dprobs
        dq[..., lo:hi, :] = torch.matmul(dscores, kf) * scale
        dk += torch.matmul(dscores.transpose(-1, -2), qt).sum(2) * scale
    return dq, dk, dv

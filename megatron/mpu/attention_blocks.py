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
heads share a key-value head: the heads ``repeat_interleave`` would give). Results are fp32.

Two implementations:

- on the CPU, PyTorch's fused flash-attention kernel for the CPU
  (``aten::_scaled_dot_product_flash_attention_for_cpu`` and its backward, which take the
  final output and log-sum-exp as the decomposition needs): no ``sq x sk`` tensor is kept
  or made, except the dense block mask of a document-masked block;
- elsewhere (CUDA) and where that operator is missing, plain PyTorch in fp32, queries taken
  ``tile_rows`` at a time so one fp32 score tile stays under :data:`TILE_BYTES`: correct on
  any device, but not a fused kernel (a flash kernel per block on the GPU is not wired up:
  no GPU was at hand to check one).

``mask`` is a :class:`BlockMask`, or None for a block every query sees whole.
"""
import math
from typing import Callable, NamedTuple, Optional, Tuple

import torch

#: Bytes of one fp32 score tile ``[b, heads, rows, sk]`` of the plain-PyTorch blocks (the
#: backward holds about three at once).
TILE_BYTES = 32 * 2**20
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_CPU_FLASH_BACKWARD = getattr(torch.ops.aten,
                              "_scaled_dot_product_flash_attention_for_cpu_backward", None)
#: Use the CPU's fused kernel where it applies (tests set it False to check the other path).
USE_CPU_FLASH = True


class BlockMask(NamedTuple):
    """What a block's queries may see of its keys.

    Attributes:
        causal: the block is a diagonal one (query i sees keys 0..i, both in the same order).
        allowed: ``allowed(row_start, row_end) -> bool [b or 1, 1, 1, rows, sk]`` (True =
            attend, causal included), or None when ``causal`` says it all.
    """

    causal: bool
    allowed: Optional[Callable]

    def rows(self, lo, hi, sk, device):
        """The bool mask of query rows ``lo:hi``, ``[b or 1, 1, 1, rows, sk]``."""
        if self.allowed is not None:
            return self.allowed(lo, hi)
        q = torch.arange(lo, hi, device=device)
        return (torch.arange(sk, device=device)[None, :] <= q[:, None])[None, None, None]


def tile_rows(batch: int, heads: int, sq: int, sk: int, budget: Optional[int] = None) -> int:
    """Query rows per tile so that a ``[batch, heads, rows, sk]`` fp32 tile fits ``budget``
    (default :data:`TILE_BYTES`)."""
    budget = TILE_BYTES if budget is None else budget
    return max(1, min(sq, budget // max(1, 4 * batch * heads * sk)))


def _fused(q):
    return USE_CPU_FLASH and q.device.type == "cpu" and _CPU_FLASH is not None and \
        _CPU_FLASH_BACKWARD is not None and q.dtype in (torch.float32, torch.bfloat16)


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  mask: Optional[BlockMask]) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(out [b, n, g, sq, d] fp32, lse [b, n, g, sq] fp32)`` of one block; a query row
    that sees no key has ``lse = -inf`` and a zero output.

    Args:
        q: ``[b, n, g, sq, d]``; k, v: ``[b, n, sk, d]``.
        scale: multiplies ``q k^T``.
        mask: see the module docstring.
    """
    if _fused(q):
        return _fused_forward(q, k, v, scale, mask)
    return _math_forward(q, k, v, scale, mask)


def _heads(q, k, v):
    """``[b, n * g, s, d]`` tensors for the fused kernel (keys and values repeated per group)."""
    b, n, g, sq, d = q.shape
    q4 = q.reshape(b, n * g, sq, d)
    if g > 1:
        k, v = (t.repeat_interleave(g, dim=1) for t in (k, v))
    return q4, k, v


def _dense_mask(mask, sq, sk, device, dtype):
    """The additive ``[b or 1, 1, sq, sk]`` mask of a document-masked block and which rows
    see any key, or ``(None, None)``."""
    if mask is None or mask.allowed is None:
        return None, None
    allowed = mask.allowed(0, sq)[:, :, 0]  # [b or 1, 1, sq, sk]
    additive = torch.zeros(allowed.shape, dtype=dtype, device=device)
    return additive.masked_fill_(~allowed, -math.inf), allowed.any(-1)  # [b or 1, 1, sq]


def _fused_forward(q, k, v, scale, mask):
    b, n, g, sq, d = q.shape
    q4, k4, v4 = _heads(q, k, v)
    additive, seen = _dense_mask(mask, sq, k.shape[2], q.device, q.dtype)
    causal = mask is not None and mask.causal and additive is None
    out, lse = _CPU_FLASH(q4, k4, v4, 0.0, causal, attn_mask=additive, scale=scale)
    if seen is not None:  # the kernel gives a row that sees nothing lse 0: make it -inf
        lse = torch.where(seen, lse, -math.inf)
    return out.float().view(b, n, g, sq, d), lse.float().view(b, n, g, sq)


def _math_forward(q, k, v, scale, mask):
    b, n, g, sq, d = q.shape
    kf, vf = k.float()[:, :, None], v.float()[:, :, None]  # [b, n, 1, sk, d]
    step = tile_rows(b, n * g, sq, k.shape[2])
    outs, lses = [], []
    for lo in range(0, sq, step):
        hi = min(sq, lo + step)
        scores = torch.matmul(q[..., lo:hi, :].float(), kf.transpose(-1, -2)) * scale
        if mask is not None:  # [b, n, g, rows, sk]
            scores.masked_fill_(~mask.rows(lo, hi, k.shape[2], q.device), -math.inf)
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
                   mask: Optional[BlockMask]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq [b, n, g, sq, d], dk [b, n, sk, d], dv [b, n, sk, d])``, fp32, of one block.

    Args:
        q, k, v, mask, scale: as in :func:`block_forward`.
        out: ``[b, n, g, sq, d]`` the final output (of these query rows).
        dout: ``[b, n, g, sq, d]`` the gradient of the final output.
        lse: ``[b, n, g, sq]`` the final log-sum-exp (every row saw a key).
        delta: ``[b, n, g, sq]`` ``rowsum(dout * out)`` of the final output.
    """
    if _fused(q):
        return _fused_backward(q, k, v, out, dout, lse, scale, mask)
    return _math_backward(q, k, v, dout, lse, delta, scale, mask)


def _fused_backward(q, k, v, out, dout, lse, scale, mask):
    b, n, g, sq, d = q.shape
    q4, k4, v4 = _heads(q, k, v)
    additive, _ = _dense_mask(mask, sq, k.shape[2], q.device, q.dtype)
    causal = mask is not None and mask.causal and additive is None
    dq, dk, dv = _CPU_FLASH_BACKWARD(
        dout.reshape(b, n * g, sq, d).to(q.dtype), q4, k4, v4,
        out.reshape(b, n * g, sq, d).to(q.dtype), lse.reshape(b, n * g, sq), 0.0, causal,
        attn_mask=additive, scale=scale)
    sk = k.shape[2]
    return (dq.float().view(b, n, g, sq, d), dk.float().view(b, n, g, sk, d).sum(2),
            dv.float().view(b, n, g, sk, d).sum(2))


def _math_backward(q, k, v, dout, lse, delta, scale, mask):
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
            scores.masked_fill_(~mask.rows(lo, hi, sk, q.device), -math.inf)
        probs = torch.exp(scores - lse[..., lo:hi, None])
        del scores
        dv += torch.matmul(probs.transpose(-1, -2), dot).sum(2)
        dprobs = torch.matmul(dot, vf.transpose(-1, -2))
        dscores = probs.mul_(dprobs.sub_(delta[..., lo:hi, None]))  # in place: P (dP - D)
        del dprobs
        dq[..., lo:hi, :] = torch.matmul(dscores, kf) * scale
        dk += torch.matmul(dscores.transpose(-1, -2), qt).sum(2) * scale
    return dq, dk, dv

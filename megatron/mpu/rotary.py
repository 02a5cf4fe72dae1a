"""Rotary position embeddings (RoFormer, Su et al. 2021), in the "rotate half" layout that
Hugging Face's Llama uses, so weights convert without a permutation.

Each attention head's channels ``[x1, x2]`` (two halves of ``d / 2``) at position ``p``
become ``[x1 cos - x2 sin, x2 cos + x1 sin]`` with angles ``p * theta^(-2i / d)``. Heads are
independent, so the rotation is the same on every tensor-parallel rank (it holds whole heads).
``mpu.RotaryEmbedding`` and ``mpu.apply_rotary``; ``megatron.model.rotary`` re-exports them.
"""
from typing import Tuple

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """``cos`` and ``sin`` tables for positions ``0 .. s - 1``.

    Args:
        head_dim: channels per attention head (even).
        theta: the base of the angles (Llama: 10000, Llama 3: 500000).
    """

    def __init__(self, head_dim: int, theta: float = 10000.0):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RotaryEmbedding: head_dim must be even, got {head_dim}")
        self.head_dim, self.theta = head_dim, float(theta)
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64)
                                         / head_dim))
        # not saved: a function of the settings, recomputed on load
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def forward(self, seq_length: int, device=None) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)``, each ``[s, 1, 1, d]`` (fp32) for ``[s, b, heads, d]`` inputs."""
        pos = torch.arange(seq_length, device=device or self.inv_freq.device,
                           dtype=torch.float32)
        freqs = torch.outer(pos, self.inv_freq.to(pos.device))  # [s, d/2]
        emb = torch.cat([freqs, freqs], dim=-1)[:, None, None, :]  # [s, 1, 1, d]
        return emb.cos(), emb.sin()

    def at_positions(self, position_ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)``, each ``[s, b, 1, d]`` (fp32), for the positions ``[b, s]`` of each
        token: a context-parallel rank's chunks, or positions restarting per document."""
        pos = position_ids.t().to(torch.float32)  # [s, b]
        freqs = pos[..., None] * self.inv_freq.to(pos.device)  # [s, b, d/2]
        emb = torch.cat([freqs, freqs], dim=-1)[:, :, None, :]  # [s, b, 1, d]
        return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` on the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[s, b, heads, d]`` by the tables of :class:`RotaryEmbedding` (math in
    fp32, result in ``x``'s dtype).

    Args:
        x: queries or keys, ``[s, b, heads, d]``.
        cos, sin: ``[s, 1, 1, d]`` (or ``[s, b, 1, d]``: :meth:`RotaryEmbedding.at_positions`).
    """
    xf = x.float()
    return (xf * cos + rotate_half(xf) * sin).to(x.dtype)

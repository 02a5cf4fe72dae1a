"""Expert capacity and token dropping (the Switch Transformer's, Fedus et al. 2021, Sec. 2.2).

Capacity is per rank, as in Megatron-core: each rank routes the ``T`` tokens of its micro-batch
(its part of the sequence under context parallelism) and lets each expert take at most

    C = ceil(T * k / E * capacity_factor)        (at most T)

of them; a token over the limit loses that expert (its probability for it becomes 0: the
residual carries it past the layer). Which tokens an over-full expert keeps: ``probs``, the C
with the highest routing probability (Megatron-core's default), or ``position``, the first C
in token order (the Switch Transformer's). The expert-parallel group never pools capacity: an
expert on another rank receives at most C tokens from each rank of the group.
"""
import math
from typing import NamedTuple

import torch


def expert_capacity(num_tokens: int, num_experts: int, topk: int,
                    capacity_factor: float) -> int:
    """``C = ceil(T k / E * factor)``, at most ``T`` (an expert never takes a token twice).

    Args:
        num_tokens: tokens this rank routes (T).
        num_experts: E.
        topk: experts per token (k).
        capacity_factor: the ``--moe-expert-capacity-factor``.
    """
    return min(num_tokens, math.ceil(num_tokens * topk / num_experts * capacity_factor))


class Kept(NamedTuple):
    """What capacity leaves of a top-k choice ``[T, k]``."""

    probs: torch.Tensor
    """``[T, k]`` the combine weights, 0 where the choice was dropped."""
    kept: torch.Tensor
    """``[T, k]`` bool: the choice survived."""
    slots: torch.Tensor
    """``[T, k]`` int64: the choice's place in its expert's buffer, ``0..C-1``; -1 where
    the choice was dropped."""


def drop_over_capacity(probs: torch.Tensor, indices: torch.Tensor, num_experts: int,
                       capacity: int, policy: str) -> Kept:
    """Apply the capacity limit to a top-k routing (no host read: shapes are static).

    Args:
        probs: ``[T, k]`` combine weights of the chosen experts.
        indices: ``[T, k]`` int64 chosen experts.
        num_experts: E.
        capacity: C (:func:`expert_capacity`).
        policy: ``probs`` or ``position`` (module docstring).
    """
    t = probs.shape[0]
    routed = torch.zeros(t, num_experts, dtype=torch.bool, device=probs.device)
    routed.scatter_(1, indices, True)  # [T, E]
    if policy == "position":
        keep = routed & (routed.cumsum(0) <= capacity)
    else:  # the C highest probabilities of each expert's tokens
        dense = torch.zeros(t, num_experts, dtype=probs.dtype, device=probs.device)
        dense.scatter_(1, indices, probs.detach())  # [T, E]
        top = torch.topk(dense, capacity, dim=0, sorted=False).indices  # [C, E]
        chosen = torch.zeros_like(routed).scatter_(0, top, True)
        keep = routed & chosen
    slot_of = keep.cumsum(0) - 1  # [T, E] place in the expert's buffer, token order
    kept = keep.gather(1, indices)  # [T, k]
    slots = torch.where(kept, slot_of.gather(1, indices), torch.full_like(indices, -1))
    return Kept(probs * kept, kept, slots)

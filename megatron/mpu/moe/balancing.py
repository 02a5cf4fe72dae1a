"""The routing losses: load balancing (Switch / GShard, per sequence) and the router z-loss.

Every loss here is the loss of the whole micro-batch of sequences. Under context parallelism
a rank holds part of each sequence, so the per-expert sums are added over the context-parallel
group first (one all-reduce per loss); every rank then holds the same loss, and its gradient
is scaled by the group size in the backward (:class:`_SumOverSequence`), because the step
averages gradients over the data x context ranks, the same rule as the language-model loss
(:func:`megatron.mpu.reduce_loss_over_context_parallel`).
"""
from typing import Optional

import torch
import torch.distributed as dist

from ..context_parallel import sum_over_context_parallel


def sum_over_sequence(partial: torch.Tensor, group=None) -> torch.Tensor:
    """``partial`` summed over the ranks sharing each sequence (identity without them).

    Args:
        partial: this rank's sums (any shape).
        group: the context-parallel group, or None (one rank holds whole sequences).
    """
    if group is None or dist.get_world_size(group) == 1:
        return partial
    return sum_over_context_parallel(partial, group)


def switch_load_balancing_loss(scores: torch.Tensor, routed: torch.Tensor, topk: int,
                               coeff: float, group=None) -> torch.Tensor:
    """``coeff * E * sum_i f_i P_i`` (Switch Transformer eq. 4, GShard): ``f_i`` the fraction
    of the ``T k`` choices that went to expert i, ``P_i`` the mean score of expert i.

    Args:
        scores: ``[T, E]`` fp32 scores over all experts (softmax; sigmoid normalized).
        routed: ``[T, E]`` bool, the top-k choices (before capacity, as Megatron-core).
        topk: k.
        coeff: ``--moe-aux-loss-coeff``.
        group: the context-parallel group (None: whole sequences here).
    """
    e = scores.shape[1]
    count = torch.full((1,), scores.shape[0], dtype=scores.dtype, device=scores.device)
    sums = sum_over_sequence(torch.cat([scores.sum(0), routed.sum(0).to(scores.dtype), count]),
                             group)  # [2E + 1]
    score_sum, chosen, tokens = sums[:e], sums[e:2 * e].detach(), sums[-1].detach()
    return coeff * e * (score_sum * chosen).sum() / (tokens * tokens * topk)


def sequence_load_balancing_loss(scores: torch.Tensor, routed: torch.Tensor, batch: int,
                                 topk: int, coeff: float, group=None) -> torch.Tensor:
    """The same loss per sequence, averaged over the batch (DeepSeek-V2's sequence-wise
    balance loss, Megatron-core's ``seq_aux_loss``).

    Args:
        scores: ``[s * b, E]`` in ``[s, b]`` order (the layer's tokens).
        routed: ``[s * b, E]`` bool.
        batch: b.
        topk, coeff, group: as :func:`switch_load_balancing_loss`.
    """
    e = scores.shape[1]
    s = scores.shape[0] // batch
    per_seq = torch.cat([scores.view(s, batch, e).sum(0),
                         routed.view(s, batch, e).sum(0).to(scores.dtype)], dim=1)  # [b, 2E]
    per_seq = sum_over_sequence(per_seq, group)
    length = s * (1 if group is None else dist.get_world_size(group))
    score_sum, chosen = per_seq[:, :e], per_seq[:, e:].detach()
    return coeff * e * (score_sum * chosen).sum(1).mean() / (length * length * topk)


def z_loss(logits: torch.Tensor, coeff: float, group=None) -> torch.Tensor:
    """Router z-loss (ST-MoE, Zoph et al. 2022, eq. 5): ``coeff * mean_t logsumexp(x_t)^2``.

    Args:
        logits: ``[T, E]`` fp32 router logits.
        coeff: ``--moe-z-loss-coeff``.
        group: the context-parallel group.
    """
    lse = torch.logsumexp(logits, dim=-1)
    count = torch.full((1,), logits.shape[0], dtype=logits.dtype, device=logits.device)
    sums = sum_over_sequence(torch.cat([lse.square().sum().view(1), count]), group)
    return coeff * sums[0] / sums[1].detach()


def aux_scores(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    """The scores the balancing losses read: softmax over all experts, or the sigmoid
    scores normalized per token (Megatron-core's)."""
    if score_function == "softmax":
        return torch.softmax(logits, dim=-1)
    scores = torch.sigmoid(logits)
    return scores / (scores.sum(-1, keepdim=True) + 1e-20)


def routing_losses(logits, routed, config, batch: int, group=None) -> dict:
    """The configured routing losses of one layer's micro-batch: ``{kind: loss}`` with
    kinds ``load_balancing_loss`` (aux_loss / seq_aux_loss) and ``z_loss``, each present
    when its coefficient is positive.

    Args:
        logits: ``[T, E]`` fp32.
        routed: ``[T, E]`` bool top-k choices.
        config: the :class:`~megatron.mpu.moe.MoEConfig`.
        batch: sequences in the micro-batch (for the per-sequence loss).
        group: the context-parallel group, or None.
    """
    out = {}
    kind, coeff = config.load_balancing_type, config.aux_loss_coeff
    if kind != "none" and coeff > 0:
        scores = aux_scores(logits, config.score_function)
        if kind == "aux_loss":
            out["load_balancing_loss"] = switch_load_balancing_loss(
                scores, routed, config.topk, coeff, group)
        else:
            out["load_balancing_loss"] = sequence_load_balancing_loss(
                scores, routed, batch, config.topk, coeff, group)
    if config.z_loss_coeff > 0:
        out["z_loss"] = z_loss(logits, config.z_loss_coeff, group)
    return out


def sequence_group(group: Optional[object]):
    """The group a layer's tokens of one sequence are spread over (None for one rank)."""
    if group is None or dist.get_world_size(group) == 1:
        return None
    return group

"""The top-k router (Megatron-core's ``TopKRouter``): scores, top-k, capacity, routing losses.

Scores (``--moe-router-score-function``):

- ``softmax``, ``pre_softmax`` False (the default, Mixtral): top-k of the logits, then a
  softmax over those k: the combine weights sum to 1;
- ``softmax``, ``pre_softmax`` True (Switch, DeepSeek-V2): softmax over all experts, then the
  top-k of it: the weights are those probabilities (top-1: the Switch Transformer's gate);
- ``sigmoid`` (DeepSeek-V3): sigmoid scores, top-k, normalized over the k when k > 1.

With ``enable_expert_bias`` (aux-loss-free balancing, DeepSeek-V3) a per-expert bias is
added to the scores for choosing the experts only; the weights come from the unbiased
scores. The bias is a buffer, changed outside autograd (:mod:`.expert_bias`).

The router is computed in fp32 (its weight is the model's, cast), whatever the autocast
dtype: the top-k choice is sensitive to rounding, as Megatron-core's ``--moe-router-dtype
fp32`` and DeepSeek-V3 keep it.
"""
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..utils import get_device
from .balancing import routing_losses
from .capacity import drop_over_capacity, expert_capacity


class Routing(NamedTuple):
    """One micro-batch's routing of ``T`` tokens."""

    probs: torch.Tensor
    """``[T, k]`` fp32 combine weights (0 for a choice dropped by capacity)."""
    indices: torch.Tensor
    """``[T, k]`` int64 chosen experts."""
    slots: Optional[torch.Tensor]
    """``[T, k]`` place in the expert's capacity buffer, -1 for a dropped choice (capacity
    mode), or None (dropless)."""
    capacity: Optional[int]
    """Tokens each expert takes from this rank (capacity mode), or None."""
    counts: torch.Tensor
    """``[E]`` fp32 tokens each expert takes from this rank (after capacity)."""
    dropped: torch.Tensor
    """Scalar fp32: choices dropped by capacity (0 dropless)."""
    losses: dict
    """``{kind: scalar}`` routing losses with their gradient (:func:`.balancing.routing_losses`)."""


class TopKRouter(nn.Module):
    """``hidden [T, h] -> Routing``; a replicated ``[E, h]`` gate (no bias).

    Args:
        config: the :class:`~megatron.mpu.moe.MoEConfig`.
        device: parameter device (default: mpu's).

    The weight is drawn from the CPU generator (the caller's per-layer seed), the same at
    every layout; it is a dense parameter (its gradient is reduced over data x context).
    """

    def __init__(self, config, device=None):
        super().__init__()
        self.config = config
        weight = torch.empty(config.num_experts, config.hidden_size)
        nn.init.normal_(weight, mean=0.0, std=config.init_method_std)
        self.weight = nn.Parameter(weight.to(get_device() if device is None else device))
        bias = torch.zeros(config.num_experts, dtype=torch.float32, device=self.weight.device)
        if config.enable_expert_bias:
            self.register_buffer("expert_bias", bias)
            self.register_buffer("local_tokens_per_expert", torch.zeros_like(bias),
                                 persistent=False)
        else:
            self.expert_bias = None

    def logits(self, hidden):  # [T, h] -> [T, E] fp32
        with torch.autocast(hidden.device.type, enabled=False):
            return F.linear(hidden.float(), self.weight.float())

    def _top_k(self, logits):
        """``(probs [T, k], indices [T, k])`` from the score function."""
        c, bias = self.config, self.expert_bias
        if c.score_function == "sigmoid":
            scores = torch.sigmoid(logits)
        elif c.pre_softmax:
            scores = torch.softmax(logits, dim=-1)
        else:
            scores = logits
        choose = scores if bias is None else scores + bias
        indices = torch.topk(choose, c.topk, dim=-1).indices
        picked = scores.gather(1, indices)  # [T, k] unbiased
        if c.score_function == "softmax" and not c.pre_softmax:
            return torch.softmax(picked, dim=-1), indices
        if c.score_function == "sigmoid" and c.topk > 1:
            return picked / (picked.sum(-1, keepdim=True) + 1e-20), indices
        return picked, indices

    def forward(self, hidden, batch: int, sequence_group=None, record: bool = False) -> Routing:
        """Route ``T`` tokens.

        Args:
            hidden: ``[T, h]`` (``[s, b]`` order).
            batch: b, for the per-sequence balancing loss.
            sequence_group: the context-parallel group (None: whole sequences here).
            record: count the loads for the expert-bias update (a training forward).
        """
        c = self.config
        logits = self.logits(hidden)
        probs, indices = self._top_k(logits)
        routed = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, indices, True)
        losses = routing_losses(logits, routed, c, batch, sequence_group)
        slots = capacity = None
        if c.capacity_factor is not None:
            capacity = expert_capacity(hidden.shape[0], c.num_experts, c.topk,
                                       c.capacity_factor)
            probs, kept, slots = drop_over_capacity(probs, indices, c.num_experts, capacity,
                                                    c.token_drop_policy)
            counts = torch.zeros_like(logits).scatter_add_(1, indices, kept.float()).sum(0)
        else:
            counts = routed.sum(0, dtype=torch.float32)
        dropped = (hidden.shape[0] * c.topk - counts.sum()).detach()
        if record and self.expert_bias is not None:
            self.local_tokens_per_expert.add_(counts.detach())
        return Routing(probs, indices, slots, capacity, counts.detach(), dropped, losses)

"""The mixture-of-experts block: ``hidden [s, b, h] -> [s, b, h]``, a drop-in for a dense
feed-forward (Megatron-core's ``MoELayer``).

    routing  = router(hidden)                  replicated gate, fp32, top-k, capacity, losses
    routed   = dispatch(hidden, routing)       to the experts' ranks and back, combined
    output   = reduce_tp(routed) + shared(hidden)
    output   = attach(output, routing losses)  their gradient joins the backward here

Expert parallelism splits the experts over the expert-parallel group (carved out of the
data x context ranks); each expert's FFN is split over tp like a dense one, so the routed
output is a partial sum over tp, reduced once (``copy`` in / ``reduce`` out: the Megatron-LM
"f" and "g" operators around the experts). The router sees the same tokens on every tp rank;
its combine weights enter the experts' region through ``copy`` too, so their gradient (a
partial sum over tp, like the experts' outputs) is all-reduced: ``[T, k]`` numbers, not the
``[T k, h]`` rows Megatron-core reduces before combining.
"""
import torch
from torch import nn

from .. import parallel_state as ps
from ..mappings import (copy_to_tensor_model_parallel_region,
                        reduce_from_tensor_model_parallel_region)
from ..utils import get_device
from .aux_loss import attach_aux_loss
from .dispatch import DISPATCH
from .experts import GroupedExperts
from .router import TopKRouter
from .shared import SharedExpertMLP
from .statistics import RoutingStats


def _groups():
    """``(tp_group, tp_rank, tp, ep_group, ep_rank, ep, cp_group)`` (all 1 without mpu)."""
    if not ps.model_parallel_is_initialized():
        return None, 0, 1, None, 0, 1, None
    s = ps.get_parallel_state()
    return (s.tp_group, ps.get_tensor_model_parallel_rank(),
            ps.get_tensor_model_parallel_world_size(), s.ep_group, s.ep_rank, s.ep_size,
            s.cp_group if s.cp_size > 1 else None)


def _recomputing() -> bool:
    """Whether this forward runs inside a backward (an activation recompute)."""
    if torch.compiler.is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1


class MoELayer(nn.Module):
    """Router, experts (this rank's), dispatcher and optional shared experts.

    Build it inside the caller's per-layer seed (``init_rng``): the router, the shared
    experts and the experts' seed are drawn from the CPU generator, the same at every
    layout.

    Args:
        config: the :class:`~megatron.mpu.moe.MoEConfig`.
        layer_number: the layer's 1-based number in the whole model (all stacks): names its
            row in :func:`~megatron.mpu.moe.routing_statistics`.
        sequence_parallel: the caller's activations are sequence-parallel (not supported:
            refused with a message).
    """

    def __init__(self, config, layer_number: int, sequence_parallel: bool = False):
        super().__init__()
        if sequence_parallel:
            raise NotImplementedError(
                "--sequence-parallel with MoE layers is not supported yet: drop "
                "--sequence-parallel (the MoE block routes whole sequences per tp rank)")
        self.config, self.layer_number = config, layer_number
        (self.tp_group, tp_rank, self.tp, self.ep_group, ep_rank, ep,
         self.sequence_group) = _groups()
        self.router = TopKRouter(config)
        seed = int(torch.randint(0, 2**62, (1,)).item())  # init only: the experts' seed
        self.experts = GroupedExperts(config, seed, ep_rank, ep, tp_rank, self.tp)
        self.shared_experts = (SharedExpertMLP(config)
                               if config.shared_expert_intermediate_size else None)
        self.routing_stats = RoutingStats(config.num_experts, get_device())
        self._dispatch = DISPATCH[(config.dispatcher, config.capacity_factor is not None)]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [s, b, h] -> [s, b, h]
        s, b, h = hidden.shape
        x = hidden.reshape(s * b, h)  # [T, h], [s, b] order
        record = self.training and not _recomputing()
        routing = self.router(x, b, self.sequence_group, record)
        if record:
            self.routing_stats.record(routing)
        tp = self.tp_group is not None and self.tp > 1
        rows, weights = x, routing
        if tp:  # the experts' outputs are partial over tp: so are the gradients they send back
            rows = copy_to_tensor_model_parallel_region(x, self.tp_group)
            weights = routing._replace(
                probs=copy_to_tensor_model_parallel_region(routing.probs, self.tp_group))
        out = self._dispatch(rows, weights, self.experts, self.config.num_experts,
                             self.ep_group)  # [T, h] fp32, partial over tp
        if tp:
            out = reduce_from_tensor_model_parallel_region(out, self.tp_group)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        out = out.to(hidden.dtype) if not torch.is_autocast_enabled(x.device.type) else out
        out = out.view(s, b, h)
        if routing.losses:
            out = attach_aux_loss(out, sum(routing.losses.values()))
        return out

"""Routing statistics for the log: what each MoE layer saw since the last read.

Each :class:`~megatron.mpu.moe.MoELayer` adds, in every training forward that is not a
recompute, its detached routing losses, the tokens each expert took and the dropped choices
to small device buffers (no host read). :func:`routing_statistics` reads and resets them for
the whole model on this rank, summed over the data x context ranks (one all-reduce);
:func:`reduce_routing_statistics` then adds the pipeline stages' (each holds other layers),
which the step does at log time.
"""
from typing import Dict, Optional

import torch
import torch.distributed as dist
from torch import nn

#: The routing-loss kinds, in the order of the buffers.
LOSS_KINDS = ("load_balancing_loss", "z_loss")


class RoutingStats(nn.Module):
    """Per-layer accumulators (non-persistent buffers: never in a checkpoint)."""

    def __init__(self, num_experts: int, device):
        super().__init__()
        zeros = lambda *shape: torch.zeros(*shape, dtype=torch.float32, device=device)  # noqa
        self.register_buffer("losses", zeros(len(LOSS_KINDS)), persistent=False)
        self.register_buffer("micro_batches", zeros(1), persistent=False)
        self.register_buffer("tokens_per_expert", zeros(num_experts), persistent=False)
        self.register_buffer("dropped", zeros(1), persistent=False)

    @torch.no_grad()
    def record(self, routing) -> None:
        """Add one micro-batch's :class:`~megatron.mpu.moe.router.Routing`."""
        for i, kind in enumerate(LOSS_KINDS):
            if kind in routing.losses:
                self.losses[i] += routing.losses[kind].detach().float()
        self.micro_batches += 1
        self.tokens_per_expert += routing.counts
        self.dropped += routing.dropped

    @torch.no_grad()
    def reset(self) -> None:
        for buffer in self.buffers():
            buffer.zero_()


def _layers(model):
    return [m for m in model.modules() if isinstance(getattr(m, "routing_stats", None),
                                                     RoutingStats)]


def routing_statistics(model: nn.Module, num_layers: int, group=None,
                       reset: bool = True) -> Dict[str, torch.Tensor]:
    """This stage's routing statistics since the last call, as detached device tensors.

    Every rank of ``group`` calls it at the same point (it all-reduces once); nothing is
    read to the host.

    Args:
        model: the model (or this rank's pipeline stage, or a list of chunks).
        num_layers: the model's layer count (all stacks): the per-layer tensors have this
            length (index = layer number - 1; a layer elsewhere or without MoE holds 0).
        group: the ranks to sum over (default: mpu's data x context group).
        reset: zero the accumulators after reading.

    Returns:
        ``load_balancing_loss``, ``z_loss``: scalars, each the sum over the MoE layers of the
        layer's loss (mean over micro-batches and over the data x context ranks, the
        coefficient included); ``tokens_per_expert_max`` / ``tokens_per_expert_mean``:
        ``[num_layers]`` over the experts of each layer, tokens summed over micro-batches
        and ranks; ``dropped_tokens``: scalar, dropped choices summed over layers,
        micro-batches and ranks.
    """
    from .. import parallel_state as ps

    chunks = model if isinstance(model, (list, tuple)) else [model]
    layers = [layer for chunk in chunks for layer in _layers(chunk)]
    device = layers[0].routing_stats.losses.device if layers else torch.device("cpu")
    width = max([layer.routing_stats.tokens_per_expert.numel() for layer in layers] or [1])
    table = torch.zeros(num_layers, width, dtype=torch.float32, device=device)  # [L, E]
    experts = torch.ones(num_layers, dtype=torch.float32, device=device)
    loss_sums = torch.zeros(len(LOSS_KINDS), dtype=torch.float32, device=device)
    dropped = torch.zeros(1, dtype=torch.float32, device=device)
    for layer in layers:
        stats, index = layer.routing_stats, layer.layer_number - 1
        if not 0 <= index < num_layers:
            raise ValueError(f"routing_statistics: an MoE layer has layer_number "
                             f"{layer.layer_number}, outside 1..num_layers ({num_layers})")
        loss_sums += stats.losses / stats.micro_batches.clamp(min=1)
        e = stats.tokens_per_expert.numel()
        table[index, :e] = stats.tokens_per_expert
        experts[index] = e
        dropped += stats.dropped
        if reset:
            stats.reset()
    if group is None and ps.model_parallel_is_initialized():
        group = ps.get_data_parallel_group(with_context_parallel=True)
    ranks = 1 if group is None else dist.get_world_size(group)
    sums = torch.cat([loss_sums / ranks, dropped, table.flatten()])
    if ranks > 1:
        dist.all_reduce(sums, group=group)
    k = len(LOSS_KINDS)
    out = {kind: sums[i] for i, kind in enumerate(LOSS_KINDS)}
    out["dropped_tokens"] = sums[k]
    table = sums[k + 1:].view(num_layers, width)
    out["tokens_per_expert_max"] = table.max(dim=1).values
    out["tokens_per_expert_mean"] = table.sum(dim=1) / experts
    return out


def reduce_routing_statistics(stats: Dict[str, torch.Tensor],
                              group: Optional[object] = None) -> Dict[str, torch.Tensor]:
    """Add the pipeline stages' :func:`routing_statistics` (each stage holds other layers;
    every entry is a sum over layers or a per-layer row that other stages hold as 0).

    Args:
        stats: this stage's statistics.
        group: the pipeline group (default: mpu's); every stage calls this together.
    """
    from .. import parallel_state as ps

    if group is None:
        group = ps.get_pipeline_model_parallel_group()
    if group is None or dist.get_world_size(group) == 1:
        return stats
    names = list(stats)
    flat = torch.cat([stats[n].reshape(-1) for n in names])
    dist.all_reduce(flat, group=group)
    out, at = {}, 0
    for n in names:
        size = stats[n].numel()
        out[n] = flat[at:at + size].view_as(stats[n])
        at += size
    return out

"""Autograd collectives over the expert-parallel group (Megatron-core's ``all_to_all``).

The all-to-all sends rows of a ``[N, h]`` tensor: ``input_splits[j]`` rows to rank j, and
receives ``output_splits[j]`` rows from rank j; its backward is the all-to-all with the
splits swapped. The all-gather / reduce-scatter pair of the all-gather dispatcher is mpu's
sequence-parallel pair over the expert group (dim 0).
"""
from typing import List, Optional

import torch
import torch.distributed as dist


def _all_to_all(input_, output_splits, input_splits, group):
    output = input_.new_empty((sum(output_splits),) + tuple(input_.shape[1:]))
    dist.all_to_all_single(output, input_.contiguous(), output_splits, input_splits,
                           group=group)
    return output


class _AllToAll(torch.autograd.Function):
    """Rows to the ranks that need them; the gradients back the same way (swapped splits)."""

    @staticmethod
    def forward(ctx, input_, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return _all_to_all(input_, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _all_to_all(grad, input_splits, output_splits, ctx.group), None, None, None


def all_to_all(input_: torch.Tensor, output_splits: Optional[List[int]],
               input_splits: Optional[List[int]], group) -> torch.Tensor:
    """``input_ [N, ...]`` rows exchanged over ``group`` (differentiable).

    Args:
        input_: rows, grouped by destination rank.
        output_splits: rows received from each rank (None: equal parts).
        input_splits: rows sent to each rank (None: equal parts).
        group: the expert-parallel group.
    """
    if group is None or dist.get_world_size(group) == 1:
        return input_
    if input_splits is None:
        world = dist.get_world_size(group)
        input_splits = output_splits = [input_.shape[0] // world] * world
    return _AllToAll.apply(input_, list(output_splits), list(input_splits), group)


def exchange_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """``counts [ep, E_local]`` (tokens this rank sends to each rank's local experts) ->
    ``[ep, E_local]`` tokens each rank sends to this rank's local experts (no gradient)."""
    if group is None or dist.get_world_size(group) == 1:
        return counts
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts.contiguous(), group=group)
    return received

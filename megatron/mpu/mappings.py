"""Moving activations into and out of the tensor-parallel region, as autograd functions.

These are the conjugate operators of the Megatron-LM paper (Shoeybi et al. 2019, Sec. 3):

- ``f`` = :func:`copy_to_tensor_model_parallel_region`: identity forward, all-reduce backward;
- ``g`` = :func:`reduce_from_tensor_model_parallel_region`: all-reduce forward, identity backward;
- :func:`scatter_to_tensor_model_parallel_region`: keep this rank's slice of the last
  dimension forward, all-gather backward;
- :func:`gather_from_tensor_model_parallel_region`: all-gather the last dimension forward,
  keep this rank's slice backward.

Every function takes the group explicitly (``group=None`` means this rank's tensor-parallel
group) and is the identity when the group has one rank.
"""
from typing import Optional

import torch
import torch.distributed as dist

from . import parallel_state as ps
from .utils import divide

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _resolve(group):
    return ps.get_tensor_model_parallel_group() if group is None else group


def _reduce(input_, group):
    """All-reduce (sum) ``input_`` in place over ``group``."""
    if dist.get_world_size(group) == 1:
        return input_
    dist.all_reduce(input_, group=group)
    return input_


def _split_last_dim(input_, group):
    """This rank's contiguous slice of the last dimension."""
    world = dist.get_world_size(group)
    if world == 1:
        return input_
    last = divide(input_.size(-1), world, "last dimension", "tensor-model-parallel size")
    return input_.narrow(-1, dist.get_rank(group) * last, last).contiguous()


def _gather_last_dim(input_, group):
    """Concatenate every rank's ``input_`` along the last dimension."""
    world = dist.get_world_size(group)
    if world == 1:
        return input_
    input_ = input_.contiguous()
    # Gather into dim 0 (one collective, no list of buffers), then move that dim last.
    gathered = torch.empty(world * input_.numel(), dtype=input_.dtype, device=input_.device)
    _all_gather_single(gathered, input_.view(-1), group=group)
    return torch.cat(gathered.view((world,) + tuple(input_.shape)).unbind(0), dim=-1)


class _CopyToModelParallelRegion(torch.autograd.Function):
    """``f``: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return input_

    @staticmethod
    def backward(ctx, grad_output):
        # The incoming gradient is a fresh buffer from the layer's backward, so it is
        # reduced in place (as Megatron does) unless it is a broadcast view.
        return _reduce(grad_output.contiguous(), ctx.group), None


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    """``g``: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, input_, group):
        # The partial sums are a matmul output nobody else keeps: reduce in place,
        # marked dirty so autograd checks any other use. A leaf is copied first.
        if input_.is_leaf or not input_.is_contiguous():
            return _reduce(input_.clone(memory_format=torch.contiguous_format), group)
        ctx.mark_dirty(input_)
        return _reduce(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None


class _ScatterToModelParallelRegion(torch.autograd.Function):
    """Keep this rank's slice of the last dimension; all-gather backward."""

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _split_last_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_last_dim(grad_output, ctx.group), None


class _GatherFromModelParallelRegion(torch.autograd.Function):
    """All-gather the last dimension; keep this rank's slice backward."""

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _gather_last_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _split_last_dim(grad_output, ctx.group), None


def _apply(function, input_, group):
    """Run the autograd ``function`` over ``group`` (default: tensor-parallel); a no-op
    when the group has one rank."""
    group = _resolve(group)
    if dist.get_world_size(group) == 1:
        return input_
    return function.apply(input_, group)


def copy_to_tensor_model_parallel_region(input_: torch.Tensor,
                                         group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """``f``: identity forward, all-reduce backward.

    Args:
        input_: activation entering a column-parallel layer.
        group: process group (default: this rank's tensor-parallel group).
    """
    return _apply(_CopyToModelParallelRegion, input_, group)


def reduce_from_tensor_model_parallel_region(input_: torch.Tensor,
                                             group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """``g``: all-reduce forward, identity backward.

    Args:
        input_: partial sums leaving a row-parallel layer.
        group: process group (default: this rank's tensor-parallel group).
    """
    return _apply(_ReduceFromModelParallelRegion, input_, group)


def scatter_to_tensor_model_parallel_region(input_: torch.Tensor,
                                            group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Split the last dimension, keep this rank's part; all-gather backward.

    Args:
        input_: full activation; its last dimension must divide by the group size.
        group: process group (default: this rank's tensor-parallel group).
    """
    return _apply(_ScatterToModelParallelRegion, input_, group)


def gather_from_tensor_model_parallel_region(input_: torch.Tensor,
                                             group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """All-gather along the last dimension; split backward.

    Args:
        input_: this rank's part of the activation.
        group: process group (default: this rank's tensor-parallel group).
    """
    return _apply(_GatherFromModelParallelRegion, input_, group)


# Megatron v1 / CPM names.
copy_to_model_parallel_region = copy_to_tensor_model_parallel_region
reduce_from_model_parallel_region = reduce_from_tensor_model_parallel_region
scatter_to_model_parallel_region = scatter_to_tensor_model_parallel_region
gather_from_model_parallel_region = gather_from_tensor_model_parallel_region

"""A linear layer on a sequence-parallel input that saves the *shard* for its backward.

Korthikanti et al. 2022, Sec. 4.2.2 and Megatron-LM's
``LinearWithGradAccumulationAndAsyncCommunication``: entering a column-parallel layer the
input ``[s/t, b, h]`` is all-gathered to ``[s, b, h]`` for the matmul, but only the shard is
kept for the backward, where it is all-gathered again. That is what makes a layer keep
``34 s b h / t`` bytes (16-bit) instead of ``4 s b h + 30 s b h / t``: the QKV and fc1 inputs
are the two ``2 s b h`` terms.

Backward, in Megatron's order: launch the all-gather of the saved shard (async), compute the
input gradient ``dY W`` (it does not need the input), wait, launch the reduce-scatter of the
input gradient (async), compute the weight gradient ``dY^T X``, wait. With NCCL each
collective runs under a GEMM; gloo has no reduce-scatter, so there it is an all-reduce and
a slice (CPU only, synchronous).
"""
from typing import Optional

import torch
import torch.distributed as dist

from .mappings import _all_gather_single, _resolve
from .sequence_parallel import _reduce_scatter_first_dim


def _gather_buffer(shard: torch.Tensor, world: int) -> torch.Tensor:
    return torch.empty((world * shard.size(0),) + tuple(shard.shape[1:]), dtype=shard.dtype,
                       device=shard.device)  # [s, b, h]


class _LinearWithSequenceParallelGather(torch.autograd.Function):
    """All-gather the sequence, ``Y = X W^T + b``; keep only the shard of ``X``."""

    @staticmethod
    def forward(ctx, shard, weight, bias, group):
        # shard: [s/t, b, in]; weight: [out/t, in]
        shard = shard.contiguous()
        world = dist.get_world_size(group)
        total = _gather_buffer(shard, world)  # [s, b, in], freed after the matmul
        _all_gather_single(total, shard, group=group)
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(shard, weight)
        return torch.nn.functional.linear(total, weight, bias)  # [s, b, out/t]

    @staticmethod
    def backward(ctx, grad_output):
        shard, weight = ctx.saved_tensors
        world = dist.get_world_size(ctx.group)
        total = _gather_buffer(shard, world)  # [s, b, in]
        handle = _all_gather_single(total, shard, group=ctx.group, async_op=True)
        grad_output = grad_output.contiguous()
        grad_total = grad_output.matmul(weight)  # [s, b, in]: overlaps the all-gather
        handle.wait()
        grad_shard, pending = _reduce_scatter_async(grad_total, ctx.group)  # [s/t, b, in]
        out = grad_output.size(-1)
        grad_weight = grad_output.reshape(-1, out).t().matmul(total.reshape(-1, total.size(-1)))
        grad_bias = grad_output.reshape(-1, out).sum(0) if ctx.has_bias else None
        if pending is not None:  # the reduce-scatter ran under the weight-gradient GEMM
            pending.wait()
        return grad_shard, grad_weight, grad_bias, None


def _reduce_scatter_async(grad_total, group):
    """``[s, ...] -> [s/t, ...]`` summed over ``group``: launched asynchronously where the
    backend has a reduce-scatter (NCCL), so it overlaps the weight-gradient GEMM; gloo has
    none (an all-reduce and a slice, synchronous). Returns (output, handle or None)."""
    if dist.get_backend(group) == "gloo":
        return _reduce_scatter_first_dim(grad_total, group), None
    world = dist.get_world_size(group)
    output = torch.empty((grad_total.size(0) // world,) + tuple(grad_total.shape[1:]),
                         dtype=grad_total.dtype, device=grad_total.device)
    handle = dist.reduce_scatter_tensor(output, grad_total, group=group, async_op=True)
    return output, handle


def _autocast_inputs(shard, weight, bias):
    """Cast to the autocast dtype as autocast's ``linear`` would (outside the Function, so
    autograd casts the gradients back); returns the tensors and whether autocast was on."""
    device_type = shard.device.type
    if not torch.is_autocast_enabled(device_type):
        return shard, weight, bias, False
    dtype = torch.get_autocast_dtype(device_type)
    cast = [None if x is None else x.to(dtype) for x in (shard, weight, bias)]
    return cast[0], cast[1], cast[2], True


def linear_with_sequence_parallel_gather(shard: torch.Tensor, weight: torch.Tensor,
                                         bias: Optional[torch.Tensor] = None,
                                         group=None) -> torch.Tensor:
    """``all_gather(shard) @ weight^T + bias``, saving the shard (not the gathered input).

    Args:
        shard: this rank's ``[s/t, b, in]`` part of the sequence.
        weight: this rank's ``[out/t, in]`` slice of a column-parallel weight.
        bias: optional ``[out/t]`` bias.
        group: tensor-parallel group (default: this rank's).

    Returns:
        ``[s, b, out/t]``; the input gradient is reduce-scattered back to ``[s/t, b, in]``.
    """
    group = _resolve(group)
    if dist.get_world_size(group) == 1:
        return torch.nn.functional.linear(shard, weight, bias)
    shard, weight, bias, autocast = _autocast_inputs(shard, weight, bias)
    if not autocast:
        return _LinearWithSequenceParallelGather.apply(shard, weight, bias, group)
    with torch.autocast(shard.device.type, enabled=False):
        return _LinearWithSequenceParallelGather.apply(shard, weight, bias, group)

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
from .weight_grad import accumulate_grad
from .weight_grad import autocast_linear_inputs as _autocast_inputs
from .weight_grad import SLOT_ATTRIBUTE, _SLOTS, deferrable_linear, deferral_target


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


class _SequenceParallelLinearDeferredWeightGrad(_LinearWithSequenceParallelGather):
    """:class:`_LinearWithSequenceParallelGather` whose weight GEMM a WeightGradStore can
    defer (Qi et al. 2024's B / W split; :mod:`.weight_grad`).

    While the store records, B is ``dX = dY W`` and its reduce-scatter only: it neither
    all-gathers the input nor computes ``dW``. The deferred W all-gathers the saved shard
    again (a tensor-parallel collective inside W: the tp ranks of a stage run the same W at
    the same point of a schedule) and runs the unsplit backward's GEMM, so ``dW`` has its
    bits. Between B and W it keeps the shard ``[s/t, b, in]`` and ``dY`` ``[s, b, out/t]``,
    not the gathered input. Outside a record the backward is the parent's.
    """

    @staticmethod
    def forward(ctx, shard, weight, bias, group, target):
        ctx.target = target  # (store, param): param is the leaf behind a cast weight
        return _LinearWithSequenceParallelGather.forward(ctx, shard, weight, bias, group)

    @staticmethod
    def backward(ctx, grad_output):
        store, param = ctx.target
        if store.recording_key is None or not ctx.needs_input_grad[1]:
            return _LinearWithSequenceParallelGather.backward(ctx, grad_output) + (None,)
        shard, weight = ctx.saved_tensors
        grad_output = grad_output.contiguous()
        grad_total = grad_output.matmul(weight)  # [s, b, in]
        grad_shard, pending = _reduce_scatter_async(grad_total, ctx.group)  # [s/t, b, in]
        out = grad_output.size(-1)
        grad_bias = grad_output.reshape(-1, out).sum(0) if ctx.has_bias else None
        group = ctx.group
        store.defer(param, lambda: _gathered_weight_grad(shard, grad_output, group),
                    saved=(shard, grad_output))
        if pending is not None:
            pending.wait()
        return grad_shard, None, grad_bias, None, None


def _gathered_weight_grad(shard, grad_output, group):
    """W of a sequence-parallel column linear: all-gather the shard, ``dY^T X``."""
    total = _gather_buffer(shard, dist.get_world_size(group))  # [s, b, in]
    _all_gather_single(total, shard, group=group)
    out = grad_output.size(-1)
    return grad_output.reshape(-1, out).t().matmul(total.reshape(-1, total.size(-1)))


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
        A weight marked by ``mpu.set_weight_grad_deferral`` defers its gradient while its
        store records (:class:`_SequenceParallelLinearDeferredWeightGrad`).
    """
    group = _resolve(group)
    target = deferral_target(weight)  # None unless mpu.set_weight_grad_deferral marked it
    if dist.get_world_size(group) == 1:
        if target is not None:
            return deferrable_linear(shard, weight, bias)
        return torch.nn.functional.linear(shard, weight, bias)
    if target is not None:
        if torch.compiler.is_compiling():
            return _traced_deferred_gather_linear(shard, weight, bias, group,
                                                  getattr(weight, SLOT_ATTRIBUTE))
        return _deferred_gather_linear(shard, weight, bias, group, target)
    shard, weight, bias, autocast = _autocast_inputs(shard, weight, bias)
    # compiled code: the collectives as functional collectives (no asynchronous handles,
    # which dynamo cannot trace); inductor orders them against the GEMMs itself
    function = _TracedGatherLinear if torch.compiler.is_compiling() else \
        _LinearWithSequenceParallelGather
    if not autocast:
        return function.apply(shard, weight, bias, group)
    with torch.autocast(shard.device.type, enabled=False):
        return function.apply(shard, weight, bias, group)


def _deferred_gather_linear(shard, weight, bias, group, target):
    shard, weight, bias, autocast = _autocast_inputs(shard, weight, bias)
    function = _SequenceParallelLinearDeferredWeightGrad
    if not autocast:
        return function.apply(shard, weight, bias, group, target)
    with torch.autocast(shard.device.type, enabled=False):
        return function.apply(shard, weight, bias, group, target)


# ------------------------------------------------------------------ the compiled form
@torch.library.custom_op("megatron_tds::deferred_gather_linear_backward", mutates_args=())
def deferred_gather_linear_backward(grad_output: torch.Tensor, shard: torch.Tensor,
                                    weight: torch.Tensor, slot: int) -> torch.Tensor:
    """``dY W`` (``[s, b, in]``, before its reduce-scatter); ``dW`` (all-gather of the shard,
    ``dY^T X``) deferred to the slot's store while it records, else now (the backward of
    :class:`_TracedGatherLinearDeferred`, opaque to the compiler)."""
    store, param, group = _SLOTS[slot]
    grad_total = grad_output.matmul(weight)
    if store.recording_key is None:
        with torch.no_grad():
            accumulate_grad(param, _gathered_weight_grad(shard, grad_output, group))
    else:
        store.defer(param, lambda: _gathered_weight_grad(shard, grad_output, group),
                    saved=(shard, grad_output))
    return grad_total


@deferred_gather_linear_backward.register_fake
def _(grad_output, shard, weight, slot):
    return grad_output.new_empty(tuple(grad_output.shape[:-1]) + (weight.size(1),))


class _TracedGatherLinear(torch.autograd.Function):
    """:class:`_LinearWithSequenceParallelGather` for compiled code: the same collectives
    and GEMMs, as functional collectives."""

    @staticmethod
    def forward(ctx, shard, weight, bias, group):
        total = _all_gather_first_dim(shard.contiguous(), group)  # [s, b, in]
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(shard, weight)
        return torch.nn.functional.linear(total, weight, bias)  # [s, b, out/t]

    @staticmethod
    def backward(ctx, grad_output):
        shard, weight = ctx.saved_tensors
        total = _all_gather_first_dim(shard, ctx.group)  # [s, b, in]
        grad_output = grad_output.contiguous()
        grad_shard = _reduce_scatter_first_dim(grad_output.matmul(weight), ctx.group)
        out = grad_output.size(-1)
        grad_weight = grad_output.reshape(-1, out).t().matmul(total.reshape(-1, total.size(-1)))
        grad_bias = grad_output.reshape(-1, out).sum(0) if ctx.has_bias else None
        return grad_shard, grad_weight, grad_bias, None


class _TracedGatherLinearDeferred(torch.autograd.Function):
    """The sequence-parallel column linear for compiled code, its weight GEMM deferrable:
    all-gather and matmul traced forward; backward ``dY W`` through the opaque operator
    (which defers ``dW``) and the reduce-scatter traced."""

    @staticmethod
    def forward(ctx, shard, weight, bias, group, slot):
        ctx.slot = slot
        return _TracedGatherLinear.forward(ctx, shard, weight, bias, group)

    @staticmethod
    def backward(ctx, grad_output):
        shard, weight = ctx.saved_tensors
        grad_output = grad_output.contiguous()
        grad_total = torch.ops.megatron_tds.deferred_gather_linear_backward(
            grad_output, shard, weight, ctx.slot)  # [s, b, in]
        grad_shard = _reduce_scatter_first_dim(grad_total, ctx.group)  # [s/t, b, in]
        out = grad_output.size(-1)
        grad_bias = grad_output.reshape(-1, out).sum(0) if ctx.has_bias else None
        return grad_shard, None, grad_bias, None, None


def _all_gather_first_dim(shard, group):
    """``[s/t, ...] -> [s, ...]`` (a functional collective in compiled code)."""
    import torch.distributed._functional_collectives as funcol

    return funcol.all_gather_tensor(shard, 0, group)


def _traced_deferred_gather_linear(shard, weight, bias, group, slot):
    shard, weight, bias, _ = _autocast_inputs(shard, weight, bias)
    with torch.autocast(shard.device.type, enabled=False):
        return _TracedGatherLinearDeferred.apply(shard, weight, bias, group, slot)

"""Sequence parallelism: moving activations between the tensor- and sequence-parallel regions.

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
Sec. 4.2.2: outside the tensor-parallel matmuls (LayerNorm, dropout, residual adds) the
activations ``[s, b, h]`` are split along the sequence (dim 0) across the tensor-parallel
ranks instead of replicated. The paper's conjugate operators replace Megatron's ``f``/``g``:

- ``g`` = :func:`gather_from_sequence_parallel_region` (entering a column-parallel layer):
  all-gather along the sequence forward, reduce-scatter backward;
- ``g-bar`` = :func:`reduce_scatter_to_sequence_parallel_region` (leaving a row-parallel
  layer): reduce-scatter forward, all-gather backward;
- :func:`scatter_to_sequence_parallel_region` (after the embedding): keep this rank's slice
  forward, all-gather backward.

An all-reduce is a reduce-scatter followed by an all-gather, so the forward moves as much as
without sequence parallelism; a column-parallel layer's backward all-gathers its saved input
shard once more (megatron/mpu/sequence_parallel_linear.py). Every function is the identity
when the group has one rank. Names and semantics follow Megatron-LM's ``tensor_parallel.mappings``.
"""
import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .mappings import _all_gather_single, _resolve
from .utils import divide


def _split_first_dim(input_, group):
    """This rank's contiguous slice of dim 0 (the sequence)."""
    world = dist.get_world_size(group)
    if world == 1:
        return input_
    part = divide(input_.size(0), world, "sequence length",
                  "tensor-model-parallel size (sequence parallelism)")
    # A slice of dim 0 is already contiguous: clone, or it would keep the full tensor alive.
    return input_.narrow(0, dist.get_rank(group) * part, part).clone()


def _gather_first_dim(input_, group):
    """Concatenate every rank's ``input_`` along dim 0: ``[s/tp, ...] -> [s, ...]``."""
    world = dist.get_world_size(group)
    if world == 1:
        return input_
    input_ = input_.contiguous()
    output = torch.empty((world * input_.size(0),) + tuple(input_.shape[1:]),
                         dtype=input_.dtype, device=input_.device)
    _all_gather_single(output, input_, group=group)
    return output


def _reduce_scatter_first_dim(input_, group):
    """Sum over the group, keep this rank's slice of dim 0: ``[s, ...] -> [s/tp, ...]``."""
    world = dist.get_world_size(group)
    if world == 1:
        return input_
    part = divide(input_.size(0), world, "sequence length",
                  "tensor-model-parallel size (sequence parallelism)")
    input_ = input_.contiguous()
    if dist.get_backend(group) == "gloo":
        # gloo has no reduce-scatter: all-reduce and keep the slice (same result, CPU only).
        summed = input_.clone()
        dist.all_reduce(summed, group=group)
        return summed.narrow(0, dist.get_rank(group) * part, part).clone()
    output = torch.empty((part,) + tuple(input_.shape[1:]), dtype=input_.dtype,
                         device=input_.device)
    dist.reduce_scatter_tensor(output, input_, group=group)
    return output


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    """Keep this rank's slice of the sequence; all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _split_first_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_first_dim(grad_output, ctx.group), None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """All-gather the sequence; backward reduce-scatter (partial grads) or split."""

    @staticmethod
    def forward(ctx, input_, group, tensor_parallel_output_grad):
        ctx.group, ctx.reduce = group, tensor_parallel_output_grad
        return _gather_first_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.reduce:
            return _reduce_scatter_first_dim(grad_output, ctx.group), None, None
        return _split_first_dim(grad_output, ctx.group), None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Reduce-scatter the partial sums along the sequence; all-gather backward."""

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _reduce_scatter_first_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_first_dim(grad_output, ctx.group), None


class _AllReduceGrad(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient backward (a fresh, out-of-place sum)."""

    @staticmethod
    def forward(ctx, param, group):
        ctx.group = group
        return param.view_as(param)

    @staticmethod
    def backward(ctx, grad_output):
        grad = grad_output.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def scatter_to_sequence_parallel_region(input_, group=None):
    """``[s, b, h] -> [s/tp, b, h]``: this rank's part of the sequence; all-gather backward.

    Args:
        input_: activation replicated on the tensor-parallel ranks (e.g. the embedding output);
            its dim 0 must divide by the group size.
        group: process group (default: this rank's tensor-parallel group).
    """
    group = _resolve(group)
    if dist.get_world_size(group) == 1:
        return input_
    return _ScatterToSequenceParallelRegion.apply(input_, group)


def gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True, group=None):
    """``[s/tp, b, h] -> [s, b, h]``: all-gather along the sequence.

    Args:
        input_: this rank's part of the sequence.
        tensor_parallel_output_grad: the consumer is tensor-parallel (a column-parallel
            matmul, the vocab-parallel logits), so each rank's gradient is a partial sum:
            backward reduce-scatters. False: the consumer is replicated, backward splits.
        group: process group (default: this rank's tensor-parallel group).
    """
    group = _resolve(group)
    if dist.get_world_size(group) == 1:
        return input_
    return _GatherFromSequenceParallelRegion.apply(input_, group, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(input_, group=None):
    """``[s, b, h]`` partial sums -> ``[s/tp, b, h]`` summed; all-gather backward.

    Args:
        input_: output of a row-parallel matmul (a partial sum on each rank).
        group: process group (default: this rank's tensor-parallel group).
    """
    group = _resolve(group)
    if dist.get_world_size(group) == 1:
        return input_
    return _ReduceScatterToSequenceParallelRegion.apply(input_, group)


def mark_sequence_parallel(param):
    """Tag a parameter replicated across tp but used on sequence shards (norms, row biases)."""
    param.sequence_parallel = True
    return param


def sequence_parallel_param(param, group=None):
    """Use ``param`` inside a sequence-sharded region: its gradient is summed across tp.

    Each rank sees only its slice of the sequence, so the gradient it computes for a
    replicated parameter (LayerNorm weight, row-parallel bias) is a partial sum. By default
    the sum runs in the backward, at each use and micro-batch, which keeps ``param.grad``
    complete whatever consumes it: DeepSpeed ZeRO and bf16 optimizers take ``.grad`` during
    the backward. A training backend that owns the step instead marks the parameters with
    :func:`defer_sequence_parallel_grads` and sums them all in one call per step
    (:func:`allreduce_sequence_parallel_grads`, as Megatron does); then this is the identity.

    Args:
        param: the replicated parameter (marked with :func:`mark_sequence_parallel`).
        group: process group (default: this rank's tensor-parallel group).
    """
    group = _resolve(group)
    if dist.get_world_size(group) == 1 or getattr(param, "sequence_parallel_deferred", False):
        return param
    return _AllReduceGrad.apply(param, group)


def defer_sequence_parallel_grads(module, group=None):
    """Take the tensor-parallel sum of ``module``'s sequence-parallel gradients out of the
    backward: the caller sums them once per step with
    :func:`allreduce_sequence_parallel_grads` (after the last micro-batch's backward).

    Args:
        module: the model (its parameters marked by :func:`mark_sequence_parallel`).
        group: the tensor-parallel group (default: this rank's).

    Returns:
        The deferred parameters (empty when the group has one rank: nothing to sum).
    """
    if dist.get_world_size(_resolve(group)) == 1:
        return []
    params = [p for p in module.parameters() if getattr(p, "sequence_parallel", False)]
    for param in params:
        param.sequence_parallel_deferred = True
    return params


def allreduce_sequence_parallel_grads(params, group=None):
    """Sum the gradients of ``params`` over the tensor-parallel group: one all-reduce per
    gradient dtype, the gradients flattened into one bucket (Megatron's
    ``allreduce_sequence_parallel_gradients``).

    Args:
        params: the parameters :func:`defer_sequence_parallel_grads` returned.
        group: the tensor-parallel group (default: this rank's).
    """
    group = _resolve(group)
    buckets = {}
    for param in params:
        if param.grad is not None:
            buckets.setdefault(param.grad.dtype, []).append(param.grad)
    for grads in buckets.values():
        flat = _flatten_dense_tensors(grads)  # [sum of numels]
        dist.all_reduce(flat, group=group)
        torch._foreach_copy_(grads, _unflatten_dense_tensors(flat, grads))


def sequence_parallel_dropout(dropout, input_, sequence_parallel):
    """``dropout(input_)``, on the per-rank RNG stream when the input is a sequence shard.

    Args:
        dropout: the ``nn.Dropout`` module.
        input_: activation.
        sequence_parallel: the input is this rank's part of the sequence, so its mask must
            differ from the other ranks' (as for split heads).
    """
    if not sequence_parallel or dropout.p == 0:
        return dropout(input_)
    from .random import get_cuda_rng_tracker

    with get_cuda_rng_tracker().fork():
        return dropout(input_)

"""The autograd functions of the mpu linears built with ``fp8`` (their GEMMs: :mod:`.fp8`).

The same functions as the bf16 path, with the three GEMMs through :class:`.fp8.Fp8Gemms`:

- :func:`fp8_linear`: ``F.linear`` (column-parallel after ``f``, row-parallel before ``g``);
  with ``mpu.set_weight_grad_deferral`` its weight GEMM is deferrable as
  :class:`~.weight_grad.LinearWithDeferredWeightGrad`'s (zero-bubble B / W split);
- :func:`fp8_gather_linear`: the sequence-parallel column linear
  (:mod:`.sequence_parallel_linear`): the bf16 shard ``[s/t, b, in]`` is all-gathered for the
  forward GEMM and again in the backward (or in the deferred W pass), only the shard kept.

The activations travel between ranks in the compute dtype (bf16), as without FP8: each rank
casts what it multiplies. The deferred W pass runs the weight GEMM in FP8 from the saved
``dY`` and ``X`` with the amaxes agreed in the forward and the B pass, so it starts no
collective beyond the sequence-parallel re-gather. Compiled (``--compile``), the forward's
casts and GEMM and the whole backward are traced into the region's graphs; a deferring
layer's backward (B's casts and GEMM, W's work) runs in one opaque operator per layer
kind, as the bf16 path's does (:mod:`.weight_grad`).
"""
from contextlib import nullcontext
from typing import Optional

import torch
import torch.distributed as dist

from .fp8 import Fp8Gemms
from .mappings import _all_gather_single, _resolve
from .sequence_parallel import _reduce_scatter_first_dim
from .sequence_parallel_linear import (_all_gather_first_dim, _gather_buffer,
                                       _reduce_scatter_async)
from .utils import autocast_linear_inputs
from .weight_grad import _SLOTS, SLOT_ATTRIBUTE, accumulate_grad, deferral_target


def _weight_grad_or_defer(ctx, compute, saved):
    """``compute()`` now, or handed to the store while it records (returns None then)."""
    target = ctx.target
    if target is None or target[0].recording_key is None:
        return compute()
    target[0].defer(target[1], compute, saved=saved)
    return None


class Fp8LinearFunction(torch.autograd.Function):
    """``mat1 @ W^T (+ b)`` on 2-D ``mat1`` with its GEMMs in FP8; with a ``target``
    ``(store, param)`` the weight GEMM is deferred while the store records (Qi et al. 2024's
    B / W split, as :class:`~.weight_grad.LinearWithDeferredWeightGrad`)."""

    @staticmethod
    def forward(ctx, mat1, weight, bias, gemms, target):
        # mat1: [n, in]; weight: [out, in]; target: None or (store, param)
        out, (x_amax, w_amax) = gemms.linear(mat1, weight, bias)
        ctx.gemms, ctx.target, ctx.has_bias = gemms, target, bias is not None
        ctx.save_for_backward(mat1, weight, x_amax, w_amax)
        return out  # [n, out]

    @staticmethod
    def backward(ctx, grad):  # grad: [n, out]
        mat1, weight, x_amax, w_amax = ctx.saved_tensors
        gemms = ctx.gemms
        grad_mat1 = dy_amax = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_mat1, dy_amax = gemms.input_grad(grad, weight, w_amax)
        if ctx.needs_input_grad[1]:
            grad_weight = _weight_grad_or_defer(
                ctx, lambda: gemms.weight_grad(grad, mat1, dy_amax, x_amax), (grad, mat1))
        grad_bias = grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_mat1, grad_weight, grad_bias, None, None


def _no_autocast(autocast, device_type):
    return torch.autocast(device_type, enabled=False) if autocast else nullcontext()


def fp8_linear(input_: torch.Tensor, weight: torch.Tensor,
               bias: Optional[torch.Tensor] = None, *, gemms: Fp8Gemms) -> torch.Tensor:
    """``F.linear(input_, weight, bias)`` with its GEMMs in FP8; the weight GEMM deferrable
    when ``weight`` carries a store (``mpu.set_weight_grad_deferral``).

    Args:
        input_: ``[*, in]``; weight: ``[out, in]``; bias: ``[out]`` or None.
        gemms: the layer's :class:`~.fp8.Fp8Gemms`.

    Returns:
        ``[*, out]`` in the compute dtype. Under autocast the three are cast to its dtype
        first, outside the function (as autocast's ``linear``), so autograd casts the
        gradients back to the fp32 parameters.
    """
    target = deferral_target(weight)
    input_, weight, bias, autocast = autocast_linear_inputs(input_, weight, bias)
    mat1 = input_.reshape(-1, input_.size(-1))  # [n, in]
    with _no_autocast(autocast, input_.device.type):
        if target is not None and torch.compiler.is_compiling():
            out = _TracedFp8DeferredLinear.apply(mat1, weight, bias, gemms,
                                                 getattr(target[1], SLOT_ATTRIBUTE))
        else:
            out = Fp8LinearFunction.apply(mat1, weight, bias, gemms, target)
    return out.view(*input_.shape[:-1], out.size(-1))  # [*, out]


# ------------------------------------------------------------------ deferral, compiled
@torch.library.custom_op("megatron_tds::deferred_fp8_linear_backward", mutates_args=())
def deferred_fp8_linear_backward(grad: torch.Tensor, mat1: torch.Tensor, weight: torch.Tensor,
                                 slot: int, spec: str, x_amax: Optional[torch.Tensor],
                                 w_amax: Optional[torch.Tensor]) -> torch.Tensor:
    """``dX`` of ``mat1 @ weight.t()`` in FP8; ``dW`` in FP8 deferred to the slot's store
    while it records, else accumulated now (the backward of :class:`_TracedFp8DeferredLinear`,
    opaque to the compiler)."""
    store, param, group = _SLOTS[slot]
    gemms = Fp8Gemms.from_spec(spec, group)
    grad_mat1, dy_amax = gemms.input_grad(grad, weight, w_amax)

    def compute():
        return gemms.weight_grad(grad, mat1, dy_amax, x_amax)

    if store.recording_key is None:
        with torch.no_grad():
            accumulate_grad(param, compute())
    else:
        store.defer(param, compute, saved=(grad, mat1))
    return grad_mat1


@deferred_fp8_linear_backward.register_fake
def _(grad, mat1, weight, slot, spec, x_amax, w_amax):
    return mat1.new_empty(mat1.shape)


class _TracedFp8DeferredLinear(torch.autograd.Function):
    """:class:`Fp8LinearFunction` with a deferrable weight GEMM, for compiled code: the
    forward's casts and GEMM traced; the backward through the opaque operator, which
    accumulates ``W``'s gradient itself (now or in the W pass)."""

    @staticmethod
    def forward(ctx, mat1, weight, bias, gemms, slot):
        out, (x_amax, w_amax) = gemms.linear(mat1, weight, bias)
        ctx.spec, ctx.slot, ctx.has_bias = gemms.spec, slot, bias is not None
        ctx.save_for_backward(mat1, weight, x_amax, w_amax)
        return out

    @staticmethod
    def backward(ctx, grad):
        mat1, weight, x_amax, w_amax = ctx.saved_tensors
        grad_mat1 = torch.ops.megatron_tds.deferred_fp8_linear_backward(
            grad, mat1, weight, ctx.slot, ctx.spec, x_amax, w_amax)
        grad_bias = grad.sum(0) if ctx.has_bias else None
        return grad_mat1, None, grad_bias, None, None


# ------------------------------------------------------------------ sequence parallel
def _gather(shard, group):
    """``[s/t, ...] -> [s, ...]`` (eager: into a fresh buffer)."""
    total = _gather_buffer(shard, dist.get_world_size(group))
    _all_gather_single(total, shard, group=group)
    return total


def _gathered_weight_grad(gemms, shard, grad2d, group, dy_amax, x_amax):
    """W of an FP8 sequence-parallel column linear: all-gather the shard, ``dY^T X``."""
    total = _gather(shard, group)  # [s, b, in]
    return gemms.weight_grad(grad2d, total.view(-1, total.size(-1)), dy_amax, x_amax)


class Fp8GatherLinear(torch.autograd.Function):
    """The sequence-parallel column linear (``[s/t, b, in] -> [s, b, out/t]``) in FP8, in
    Megatron's order: backward launches the re-gather of the shard, computes ``dX`` under
    it, launches the reduce-scatter of ``dX`` and computes ``dW`` under that; with a
    ``target`` recording, ``dW`` (and its re-gather) is deferred to the W pass."""

    @staticmethod
    def forward(ctx, shard, weight, bias, group, gemms, target):
        shard = shard.contiguous()
        total = _gather(shard, group)  # [s, b, in], freed after the GEMM
        out, (x_amax, w_amax) = gemms.linear(total.view(-1, total.size(-1)), weight, bias)
        ctx.group, ctx.gemms, ctx.target = group, gemms, target
        ctx.has_bias, ctx.tokens = bias is not None, tuple(total.shape[:-1])
        ctx.save_for_backward(shard, weight, x_amax, w_amax)
        # [s*b, out/t]: viewed to [s, b, out/t] outside, so that an in-place change of the
        # result (a padded-vocabulary mask) is autograd's to handle
        return out

    @staticmethod
    def backward(ctx, grad_output):  # [s*b, out/t]
        shard, weight, x_amax, w_amax = ctx.saved_tensors
        group, gemms, target = ctx.group, ctx.gemms, ctx.target
        defer = target is not None and target[0].recording_key is not None and \
            ctx.needs_input_grad[1]
        if not defer:  # the shard's re-gather runs under the input-gradient GEMM
            total = _gather_buffer(shard, dist.get_world_size(group))
            handle = _all_gather_single(total, shard, group=group, async_op=True)
        grad2d = grad_output.contiguous()
        grad_total, dy_amax = gemms.input_grad(grad2d, weight, w_amax)  # [s*b, in]
        grad_shard, pending = _reduce_scatter_async(
            grad_total.view(*ctx.tokens, -1), group)  # [s/t, b, in]
        grad_bias = grad2d.sum(0) if ctx.has_bias else None
        grad_weight = None
        if defer:
            target[0].defer(target[1], lambda: _gathered_weight_grad(
                gemms, shard, grad2d, group, dy_amax, x_amax), saved=(shard, grad2d))
        elif ctx.needs_input_grad[1]:
            handle.wait()
            grad_weight = gemms.weight_grad(grad2d, total.view(-1, total.size(-1)), dy_amax,
                                            x_amax)
        if pending is not None:  # the reduce-scatter ran under the weight-gradient GEMM
            pending.wait()
        return grad_shard, grad_weight, grad_bias, None, None, None


class _TracedFp8GatherLinear(torch.autograd.Function):
    """:class:`Fp8GatherLinear` for compiled code: functional collectives, all traced."""

    @staticmethod
    def forward(ctx, shard, weight, bias, group, gemms):
        total = _all_gather_first_dim(shard.contiguous(), group)  # [s, b, in]
        out, (x_amax, w_amax) = gemms.linear(total.view(-1, total.size(-1)), weight, bias)
        ctx.group, ctx.gemms, ctx.has_bias = group, gemms, bias is not None
        ctx.tokens = tuple(total.shape[:-1])
        ctx.save_for_backward(shard, weight, x_amax, w_amax)
        return out  # [s*b, out/t], viewed outside

    @staticmethod
    def backward(ctx, grad_output):  # [s*b, out/t]
        shard, weight, x_amax, w_amax = ctx.saved_tensors
        gemms = ctx.gemms
        total = _all_gather_first_dim(shard, ctx.group)  # [s, b, in]
        grad2d = grad_output.contiguous()
        grad_total, dy_amax = gemms.input_grad(grad2d, weight, w_amax)
        grad_shard = _reduce_scatter_first_dim(
            grad_total.view(*ctx.tokens, -1), ctx.group)  # [s/t, b, in]
        grad_weight = gemms.weight_grad(grad2d, total.view(-1, total.size(-1)), dy_amax,
                                        x_amax)
        grad_bias = grad2d.sum(0) if ctx.has_bias else None
        return grad_shard, grad_weight, grad_bias, None, None


@torch.library.custom_op("megatron_tds::deferred_fp8_gather_linear_backward", mutates_args=())
def deferred_fp8_gather_linear_backward(grad2d: torch.Tensor, shard: torch.Tensor,
                                        weight: torch.Tensor, slot: int, spec: str,
                                        x_amax: Optional[torch.Tensor],
                                        w_amax: Optional[torch.Tensor]) -> torch.Tensor:
    """``dX`` (``[s*b, in]``, before its reduce-scatter) in FP8; ``dW`` (re-gather of the
    shard, ``dY^T X`` in FP8) deferred while the slot's store records, else now."""
    store, param, group = _SLOTS[slot]
    gemms = Fp8Gemms.from_spec(spec, group)
    grad_total, dy_amax = gemms.input_grad(grad2d, weight, w_amax)

    def compute():
        return _gathered_weight_grad(gemms, shard, grad2d, group, dy_amax, x_amax)

    if store.recording_key is None:
        with torch.no_grad():
            accumulate_grad(param, compute())
    else:
        store.defer(param, compute, saved=(shard, grad2d))
    return grad_total


@deferred_fp8_gather_linear_backward.register_fake
def _(grad2d, shard, weight, slot, spec, x_amax, w_amax):
    return grad2d.new_empty((grad2d.size(0), weight.size(1)))


class _TracedFp8GatherLinearDeferred(torch.autograd.Function):
    """The FP8 sequence-parallel column linear for compiled code with a deferrable weight
    GEMM: forward traced, backward through the opaque operator and a traced
    reduce-scatter."""

    @staticmethod
    def forward(ctx, shard, weight, bias, group, gemms, slot):
        ctx.slot, ctx.spec = slot, gemms.spec
        return _TracedFp8GatherLinear.forward(ctx, shard, weight, bias, group, gemms)

    @staticmethod
    def backward(ctx, grad_output):  # [s*b, out/t]
        shard, weight, x_amax, w_amax = ctx.saved_tensors
        grad2d = grad_output.contiguous()
        grad_total = torch.ops.megatron_tds.deferred_fp8_gather_linear_backward(
            grad2d, shard, weight, ctx.slot, ctx.spec, x_amax, w_amax)  # [s*b, in]
        grad_shard = _reduce_scatter_first_dim(
            grad_total.view(*ctx.tokens, -1), ctx.group)  # [s/t, b, in]
        grad_bias = grad2d.sum(0) if ctx.has_bias else None
        return grad_shard, None, grad_bias, None, None, None


def fp8_gather_linear(shard: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                      group, gemms: Fp8Gemms) -> torch.Tensor:
    """``all_gather(shard) @ weight^T + bias`` with its GEMMs in FP8, saving the shard.

    Args:
        shard: this rank's ``[s/t, b, in]``; weight: ``[out/t, in]``; bias: ``[out/t]``.
        group: the tensor-parallel group (None: this rank's).
        gemms: the layer's :class:`~.fp8.Fp8Gemms`.

    Returns:
        ``[s, b, out/t]``; the input gradient is reduce-scattered to ``[s/t, b, in]``.
    """
    group = _resolve(group)
    if dist.get_world_size(group) == 1:
        return fp8_linear(shard, weight, bias, gemms=gemms)
    target = deferral_target(weight)
    shard, weight, bias, autocast = autocast_linear_inputs(shard, weight, bias)
    with _no_autocast(autocast, shard.device.type):
        if not torch.compiler.is_compiling():
            out = Fp8GatherLinear.apply(shard, weight, bias, group, gemms, target)
        elif target is None:
            out = _TracedFp8GatherLinear.apply(shard, weight, bias, group, gemms)
        else:
            out = _TracedFp8GatherLinearDeferred.apply(shard, weight, bias, group, gemms,
                                                       getattr(target[1], SLOT_ATTRIBUTE))
    world = dist.get_world_size(group)
    return out.view(world * shard.size(0), *shard.shape[1:-1], out.size(-1))  # [s, b, out/t]

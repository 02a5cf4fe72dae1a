"""The fused kernels as PyTorch operators (``torch.ops.megatron_tds.*``), so the compiler sees them.

``torch.compile`` cannot trace into a pybind call or an autograd function that calls one: it
breaks the graph there. Registered with :func:`torch.library.custom_op`, each kernel is one
node of the graph instead: its fake implementation gives dynamo and AOTAutograd the output
shapes without running it, and :func:`torch.library.register_autograd` gives the backward.

Ops (all functional, no input is written):

- ``masked_softmax_fwd(scores, mask, scale, causal) -> (probs, dead)``
- ``masked_softmax_bwd(grad, probs, dead, scale, causal) -> dscores``
- ``norm_fwd(x, weight, bias, eps, rms) -> (y, mean, rstd)``
- ``norm_bwd(grad, x, weight, mean, rstd, has_bias, rms) -> (dx, dweight, dbias)``

An operator returns tensors only, so what the kernels leave out is an empty tensor here:
``dead`` when there is no mask, ``mean`` for RMSNorm, ``dbias`` without a bias.

Callers use :func:`masked_softmax` and :func:`norm`: the operators while dynamo traces, and
outside it plain autograd functions on the same kernels and backward. An operator call goes
through the dispatcher and the Python wrappers of ``custom_op`` / ``register_autograd``
(about 100 us of host time per forward and backward on a CPU, several kernel launches'
worth on a GPU); eager code gains nothing from it.
Registering the ops builds nothing: the implementations ask :func:`megatron.fused_kernels.
get_module` for the compiled module when they first run, and callers run them only when
that module exists (megatron/model/fused_softmax.py, fused_layer_norm.py).
"""
from typing import Optional, Tuple

import torch

from .. import fused_kernels  # relative: mpu (norms) imports this, also under another package name

from . import ops

NAMESPACE = "megatron_tds"


def _empty(like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(0, dtype=dtype, device=like.device)


def _module(t):
    module = fused_kernels.get_module(t.device.type)
    if module is None:  # callers check availability first; this is a misuse
        raise RuntimeError(f"no fused kernels for {t.device.type}: check availability first")
    return module


# ---------------------------------------------------------------- masked softmax
@torch.library.custom_op(f"{NAMESPACE}::masked_softmax_fwd", mutates_args=())
def masked_softmax_fwd(scores: torch.Tensor, mask: Optional[torch.Tensor], scale: float,
                       causal: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """softmax(mask ? -10000 : scale * scores), causal triangle at 0 (see fused_softmax.py).

    Args:
        scores: ``[b, np, sq, sk]``.
        mask: None or bool/uint8 ``[1 or b, 1, sq, sk]``, True = masked.
        scale: multiplies the scores before masking.
        causal: exclude keys ``j > i + sk - sq``.

    Returns:
        ``(probs, dead)``: probabilities (contiguous, ``scores.dtype``), and bool
        ``[b * np * sq]`` rows the mask hides entirely (empty when ``mask`` is None).
    """
    probs, dead = ops.softmax_forward(_module(scores), scores, mask, scale, causal)
    return probs, (_empty(scores, torch.bool) if dead is None else dead)


@masked_softmax_fwd.register_fake
def _(scores, mask, scale, causal):
    b, np_, sq, _ = scores.shape
    dead = _empty(scores, torch.bool) if mask is None else \
        scores.new_empty(b * np_ * sq, dtype=torch.bool)
    return scores.new_empty(scores.shape), dead  # contiguous, as the kernel writes it


@torch.library.custom_op(f"{NAMESPACE}::masked_softmax_bwd", mutates_args=())
def masked_softmax_bwd(grad: torch.Tensor, probs: torch.Tensor, dead: torch.Tensor,
                       scale: float, causal: bool) -> torch.Tensor:
    """dL/dscores of :func:`masked_softmax_fwd` given ``grad`` = dL/dprobs.

    Args:
        grad: ``[b, np, sq, sk]``.
        probs, dead: the forward's outputs.
        scale, causal: as in the forward.
    """
    dead = dead if dead.numel() else None
    return ops.softmax_backward(_module(probs), grad, probs, dead, scale, causal)


@masked_softmax_bwd.register_fake
def _(grad, probs, dead, scale, causal):
    return probs.new_empty(probs.shape)


def _softmax_setup(ctx, inputs, output):
    _, _, scale, causal = inputs
    ctx.save_for_backward(*output)
    ctx.scale, ctx.causal = scale, causal


def _softmax_backward(ctx, grad_probs, _grad_dead):
    probs, dead = ctx.saved_tensors
    return masked_softmax_bwd(grad_probs, probs, dead, ctx.scale, ctx.causal), None, None, None


masked_softmax_fwd.register_autograd(_softmax_backward, setup_context=_softmax_setup)


# ---------------------------------------------------------------- LayerNorm / RMSNorm
@torch.library.custom_op(f"{NAMESPACE}::norm_fwd", mutates_args=())
def norm_fwd(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float,
             rms: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LayerNorm (``rms=False``) or RMSNorm over the last ``weight.numel()`` elements.

    Args:
        x: ``[..., hidden]``; the output has its dtype.
        weight, bias: ``[hidden]``; bias None for RMSNorm (or a LayerNorm without bias).
        eps: added to the variance (mean square for RMSNorm).
        rms: RMSNorm instead of LayerNorm.

    Returns:
        ``(y, mean, rstd)``: statistics fp32 ``[rows]``; mean empty for RMSNorm.
    """
    y, mean, rstd = ops.norm_forward(_module(x), x, weight, bias, eps, rms)
    return y, (_empty(x, torch.float32) if mean is None else mean), rstd


@norm_fwd.register_fake
def _(x, weight, bias, eps, rms):
    rows = x.numel() // weight.numel()
    stats = x.new_empty(rows, dtype=torch.float32)
    return x.new_empty(x.shape), (_empty(x, torch.float32) if rms else stats), \
        x.new_empty(rows, dtype=torch.float32)


@torch.library.custom_op(f"{NAMESPACE}::norm_bwd", mutates_args=())
def norm_bwd(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor,
             rstd: torch.Tensor, has_bias: bool, rms: bool
             ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`norm_fwd`: ``(dx, dweight, dbias)``, dbias empty without a bias.

    Args:
        grad: dL/dy, shape of ``x``.
        x, weight: the forward's inputs.
        mean, rstd: the forward's statistics.
        has_bias: whether to compute dbias.
        rms: RMSNorm instead of LayerNorm.
    """
    dx, dw, db = ops.norm_backward(_module(x), grad, x, weight, mean if mean.numel() else None,
                                   rstd, has_bias, rms)
    return dx, dw, (_empty(x, weight.dtype) if db is None else db)


@norm_bwd.register_fake
def _(grad, x, weight, mean, rstd, has_bias, rms):
    db = weight.new_empty(weight.shape) if has_bias else _empty(x, weight.dtype)
    return x.new_empty(x.shape), weight.new_empty(weight.shape), db


def _norm_setup(ctx, inputs, output):
    x, weight, bias, _, rms = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.has_bias, ctx.rms = bias is not None, rms


def _norm_backward(ctx, grad_y, _grad_mean, _grad_rstd):
    x, weight, mean, rstd = ctx.saved_tensors
    dx, dw, db = norm_bwd(grad_y, x, weight, mean, rstd, ctx.has_bias, ctx.rms)
    return dx, dw, (db if ctx.has_bias else None), None, None


norm_fwd.register_autograd(_norm_backward, setup_context=_norm_setup)


# ---------------------------------------------------------------- eager paths
class _EagerMaskedSoftmax(torch.autograd.Function):
    """:func:`masked_softmax_fwd` and its backward without the operator's dispatch."""

    @staticmethod
    def forward(ctx, scores, mask, scale, causal):
        probs, dead = ops.softmax_forward(_module(scores), scores, mask, scale, causal)
        ctx.save_for_backward(probs, dead)  # None is allowed: no mask, no dead rows
        ctx.scale, ctx.causal = scale, causal
        return probs

    @staticmethod
    def backward(ctx, grad_probs):
        probs, dead = ctx.saved_tensors
        dscores = ops.softmax_backward(_module(probs), grad_probs, probs, dead, ctx.scale,
                                       ctx.causal)
        return dscores, None, None, None


class _EagerNorm(torch.autograd.Function):
    """:func:`norm_fwd` and its backward without the operator's dispatch."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, rms):
        y, mean, rstd = ops.norm_forward(_module(x), x, weight, bias, eps, rms)
        ctx.save_for_backward(x, weight, mean, rstd)  # mean None for RMSNorm
        ctx.has_bias, ctx.rms = bias is not None, rms
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = ops.norm_backward(_module(x), grad_y, x, weight, mean, rstd,
                                       ctx.has_bias, ctx.rms)
        return dx, dw, db, None, None


def masked_softmax(scores: torch.Tensor, mask: Optional[torch.Tensor], scale: float,
                   causal: bool) -> torch.Tensor:
    """The probabilities of :func:`masked_softmax_fwd` (the operator under ``torch.compile``)."""
    if torch.compiler.is_compiling():
        return masked_softmax_fwd(scores, mask, scale, causal)[0]
    return _EagerMaskedSoftmax.apply(scores, mask, scale, causal)


def norm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float,
         rms: bool) -> torch.Tensor:
    """The output of :func:`norm_fwd` (the operator under ``torch.compile``)."""
    if torch.compiler.is_compiling():
        return norm_fwd(x, weight, bias, eps, rms)[0]
    return _EagerNorm.apply(x, weight, bias, eps, rms)

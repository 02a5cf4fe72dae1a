"""How the routing losses reach the backward: Megatron-core's ``MoEAuxLossAutoScaler``.

A routing loss is not part of the value the step calls ``backward`` on: it is attached to the
MoE layer's output by an autograd function that is the identity forward and, backward, adds
``d(aux)/d(.)`` times a scale. So no pipeline stage threads the losses through the tensors it
sends, and every schedule (1F1B, interleaved, zero bubble) backpropagates them with the
layer. The training step sets the scale once per step with :func:`set_aux_loss_scale`: the
same factor it applies to the language-model loss before ``backward`` (``1 / gas``, times the
fp16 loss scale where it multiplies that in).
"""
from typing import Dict, Union

import torch

_SCALES: Dict[torch.device, torch.Tensor] = {}
_VALUE = [1.0]


def _scale_on(device: torch.device) -> torch.Tensor:
    """The scale as a 1-element fp32 tensor on ``device`` (updated in place, so compiled code
    that read it sees the next value without a recompile)."""
    scale = _SCALES.get(device)
    if scale is None:
        value = _VALUE[0]
        scale = torch.ones(1, dtype=torch.float32, device=device)
        if torch.is_tensor(value):
            scale.copy_(value.detach().reshape(1))
        else:
            scale.fill_(float(value))
        _SCALES[device] = scale
    return scale


def set_aux_loss_scale(scale: Union[float, torch.Tensor]) -> None:
    """Set the factor the routing losses' gradients are multiplied by (default 1).

    The training step calls it once per step, before the step's first forward, with what
    it multiplies the language-model loss by (``1 / gas``; with fp16, ``loss_scale / gas``).
    A tensor is copied on the device (no host read). Each layer's forward saves the scale
    for its backward: changing it between a forward and its backward is refused by
    autograd ("modified by an inplace operation"), never silently mixed.

    Args:
        scale: a number, or a scalar tensor (e.g. the fp16 loss scale over gas).
    """
    _VALUE[0] = scale.detach() if torch.is_tensor(scale) else float(scale)
    for device, tensor in _SCALES.items():
        if torch.is_tensor(scale):
            tensor.copy_(scale.detach().reshape(1).to(device=device, dtype=torch.float32))
        else:
            tensor.fill_(float(scale))


def get_aux_loss_scale() -> Union[float, torch.Tensor]:
    """The value last given to :func:`set_aux_loss_scale` (1.0 by default)."""
    return _VALUE[0]


class MoEAuxLossAutoScaler(torch.autograd.Function):
    """``forward(output, aux_loss, scale) = output``; backward: the output's gradient
    unchanged, and ``scale`` as the gradient of ``aux_loss`` (Megatron-core's class)."""

    @staticmethod
    def forward(ctx, output, aux_loss, scale):
        ctx.save_for_backward(scale)
        ctx.aux_shape = aux_loss.shape
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output):
        (scale,) = ctx.saved_tensors
        return grad_output, scale.reshape(()).expand(ctx.aux_shape).clone(), None

    @staticmethod
    def set_loss_scale(scale) -> None:
        """Megatron-core's name for :func:`set_aux_loss_scale`."""
        set_aux_loss_scale(scale)


def attach_aux_loss(output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
    """``output``, with ``aux_loss``'s gradient (times the step's scale) joining the backward
    wherever ``output``'s does.

    Args:
        output: the MoE layer's output.
        aux_loss: a scalar with its graph (the sum of the layer's routing losses).
    """
    if not (torch.is_grad_enabled() and aux_loss.requires_grad):
        return output
    scale = _scale_on(output.device)
    return MoEAuxLossAutoScaler.apply(output, aux_loss, scale)

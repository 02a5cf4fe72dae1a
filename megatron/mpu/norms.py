"""LayerNorm and RMSNorm with fp32 statistics: fused kernels when eligible, PyTorch otherwise.

Both compute in fp32 whatever the input dtype (fp32 / fp16 / bf16) and parameter dtype, and
return the input's dtype:

- ``MixedFusedLayerNorm``: ``y = ((x - mean) / sqrt(var + eps) * weight + bias)``, biased
  variance over the last ``normalized_shape`` dims -- ``torch.nn.LayerNorm`` in fp32.
- ``MixedFusedRMSNorm``: ``y = x * rsqrt(mean(x^2) + eps) * weight`` (T5's ``T5LayerNorm``
  computed entirely in fp32, then cast back).

Parameters are named ``weight`` / ``bias`` as in ``torch.nn.LayerNorm``, so checkpoints and
HF conversions map one to one. The kernels run when ``--layernorm-fusion`` is given, or
neither flag is and the kernel is the faster path on the device
(``fused_kernels.NORM_FUSION_BY_DEFAULT``: CUDA LayerNorm takes ``F.layer_norm``), the
compiled module is available for the device, and the shape/dtype fit (CPU: fp32/bf16
input; CUDA: fp32/fp16/bf16 with hidden % 8 == 0 and hidden <= 8192). Inside
``torch.compile`` (``--compile``) both take the PyTorch composition instead: inductor fuses it
with the neighbouring elementwise work, where the kernel would be an opaque operator.

They are mpu pieces (``mpu.RMSNorm`` is :class:`MixedFusedRMSNorm`): with
``sequence_parallel=True`` each tensor-parallel rank normalizes its own sequence shard and the
weight's gradient is summed across the tensor-parallel group (:mod:`.sequence_parallel`), so
the result equals the serial norm's. ``megatron.model.fused_layer_norm`` re-exports them
(their path before issue 35).
"""
import numbers

import torch
import torch.nn.functional as F
from torch import nn

from .. import fused_kernels
from ..fused_kernels import custom_ops
from .sequence_parallel import mark_sequence_parallel, sequence_parallel_param
from .utils import get_device

CUDA_MAX_HIDDEN = 8192


def fused_norm(x, weight, bias, eps, rms):
    """LayerNorm (bias may be None) or RMSNorm (``rms``), one kernel each way (the
    ``megatron_tds::norm_fwd`` operator under ``torch.compile``, which traces it)."""
    return custom_ops.norm(x, weight, bias, eps, rms)


def norm_kernel_unavailable_reason(x, weight, rms=False):
    """Why the fused norm does not apply to ``x`` with ``weight``, or None when it does.

    Args:
        x: the input activations.
        weight: the norm's weight (its numel is the normalized size).
        rms: RMSNorm (else LayerNorm): the default path differs per device.
    """
    if not fused_kernels.norm_fusion_enabled("rms_norm" if rms else "layer_norm",
                                             x.device.type):
        return "fusion disabled"
    hidden, device = weight.numel(), x.device
    if weight.dtype not in (torch.float32, x.dtype) or weight.device != device:
        return f"weight {weight.dtype} on {weight.device} for input {x.dtype} on {device}"
    if device.type == "cuda":
        if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            return f"the CUDA kernel takes fp32/fp16/bf16, not {x.dtype}"
        if hidden % 8 or hidden > CUDA_MAX_HIDDEN:
            return f"the CUDA kernel needs hidden % 8 == 0 and hidden <= {CUDA_MAX_HIDDEN}"
    elif device.type == "cpu":
        if x.dtype not in (torch.float32, torch.bfloat16):
            return f"the CPU kernel takes fp32/bf16, not {x.dtype}"
    else:
        return f"no kernel for {device.type}"
    if x.numel() == 0 or tuple(x.shape[x.dim() - weight.dim():]) != tuple(weight.shape):
        return "empty input, or trailing dims other than the weight's shape"
    if not fused_kernels.kernels_available(device.type):
        return "kernels unavailable"
    return None


def layer_norm_reference(x, weight, bias, eps, normalized_shape):
    """The PyTorch path of MixedFusedLayerNorm: ``F.layer_norm`` in fp32, cast back."""
    y = F.layer_norm(x.float(), normalized_shape, weight.float(),
                     None if bias is None else bias.float(), eps)
    return y.to(x.dtype)


def rms_norm_reference(x, weight, eps, normalized_shape):
    """The PyTorch path of MixedFusedRMSNorm: fp32 throughout, cast back."""
    dims = tuple(range(-len(normalized_shape), 0))
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(dims, keepdim=True) + eps) * weight.float()
    return y.to(x.dtype)


def _shape(normalized_shape):
    if isinstance(normalized_shape, numbers.Integral):
        return (int(normalized_shape),)
    return tuple(int(d) for d in normalized_shape)


class MixedFusedLayerNorm(nn.Module):
    """Drop-in ``torch.nn.LayerNorm`` (affine) with fp32 statistics and a fused kernel.

    Args:
        normalized_shape: size of the last dim (or trailing dims) to normalize.
        eps: added to the variance.
        params_dtype: dtype of ``weight`` / ``bias`` (default fp32; the math is fp32 anyway).
        device: where the parameters live (default: ``mpu.get_device()``, as the mpu linears).
        sequence_parallel: the input is a sequence shard (``--sequence-parallel``): the
            gradients of weight and bias are summed across the tensor-parallel ranks.
    """

    def __init__(self, normalized_shape, eps=1e-5, *, params_dtype=None, device=None,
                 sequence_parallel=False):
        super().__init__()
        self.normalized_shape = _shape(normalized_shape)
        self.eps = eps
        self.elementwise_affine = True
        self.sequence_parallel = sequence_parallel
        kwargs = dict(dtype=params_dtype or torch.float32,
                      device=get_device() if device is None else device)
        self.weight = nn.Parameter(torch.empty(self.normalized_shape, **kwargs))
        self.bias = nn.Parameter(torch.empty(self.normalized_shape, **kwargs))
        if sequence_parallel:
            mark_sequence_parallel(self.weight)
            mark_sequence_parallel(self.bias)
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.ones_(self.weight)
        nn.init.zeros_(self.bias)

    def forward(self, input):
        weight, bias = self.weight, self.bias
        if self.sequence_parallel:
            weight, bias = sequence_parallel_param(weight), sequence_parallel_param(bias)
        if not torch.compiler.is_compiling() and \
                norm_kernel_unavailable_reason(input, weight) is None:
            return fused_norm(input, weight, bias, self.eps, False)
        # compiled code: the composition, which inductor fuses with its neighbours (the
        # kernel is an opaque operator there, and its call costs host time per use)
        return layer_norm_reference(input, weight, bias, self.eps, self.normalized_shape)

    def extra_repr(self):
        return f"{self.normalized_shape}, eps={self.eps}"


class MixedFusedRMSNorm(nn.Module):
    """RMSNorm (T5's ``T5LayerNorm``: no mean, no bias) with fp32 math and a fused kernel.

    Args:
        normalized_shape: size of the last dim (or trailing dims) to normalize.
        eps: added to the mean square.
        params_dtype: dtype of ``weight`` (default fp32).
        device: where the parameter lives (default: ``mpu.get_device()``).
        sequence_parallel: as in MixedFusedLayerNorm.
    """

    def __init__(self, normalized_shape, eps=1e-6, *, params_dtype=None, device=None,
                 sequence_parallel=False):
        super().__init__()
        self.normalized_shape = _shape(normalized_shape)
        self.eps = eps
        self.sequence_parallel = sequence_parallel
        self.weight = nn.Parameter(torch.ones(
            self.normalized_shape, dtype=params_dtype or torch.float32,
            device=get_device() if device is None else device))
        if sequence_parallel:
            mark_sequence_parallel(self.weight)

    def reset_parameters(self):
        nn.init.ones_(self.weight)

    def forward(self, input):
        weight = sequence_parallel_param(self.weight) if self.sequence_parallel else self.weight
        if not torch.compiler.is_compiling() and \
                norm_kernel_unavailable_reason(input, weight, rms=True) is None:
            return fused_norm(input, weight, None, self.eps, True)
        return rms_norm_reference(input, weight, self.eps, self.normalized_shape)  # compiled

    def extra_repr(self):
        return f"{self.normalized_shape}, eps={self.eps}"


#: The mpu name (``mpu.RMSNorm``): the fused RMSNorm above.
RMSNorm = MixedFusedRMSNorm

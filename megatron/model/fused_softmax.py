"""Scale + mask + softmax over attention scores, fused when a kernel applies (Megatron API).

Semantics, identical on every path (docs/kernels.md): with ``s = scale * scores`` in fp32,

- entries where ``mask`` is True become exactly -10000 (Megatron's ``attention_mask_func``);
- with ``AttnMaskType.causal``, keys ``j > i + sk - sq`` (the upper triangle, aligned to the
  bottom right so a query block at the end of a KV cache sees every earlier key) get
  probability exactly 0, and ``mask``, when given, applies on top;
- a row whose every causally allowed entry is masked comes out uniform over those entries
  (all -10000) and passes no gradient back (its output does not depend on its input);
- the probabilities come back in the input's dtype.

The fused path takes the compiled kernel (CUDA: fp16/bf16; CPU: fp32/bf16) when
:meth:`FusedScaleMaskSoftmax.is_kernel_available` says so; otherwise the PyTorch path
computes the same function. The kernels hard-code the -10000 fill: give a ``mask_func``
with other semantics and the two paths differ (use ``--no-masked-softmax-fusion``).
"""

import torch
from torch import nn

from megatron import fused_kernels
from megatron.fused_kernels import custom_ops
from megatron.model.enums import AttnMaskType  # noqa: F401 (one class, re-exported here)

#: Megatron's sequence-length bound for the CUDA kernel (a row lives in a warp's registers).
CUDA_MAX_KEYS = 4096


def fused_masked_softmax(scores, mask, scale, causal):
    """softmax(mask ? -10000 : scale * scores) with the causal triangle at 0, one kernel each
    way (the ``megatron_tds::masked_softmax_fwd`` operator under ``torch.compile``)."""
    return custom_ops.masked_softmax(scores, mask, scale, causal)


def causal_exclusion(sq, sk, device):
    """Bool ``[sq, sk]``, True where key ``j > i + sk - sq`` (probability 0)."""
    return torch.ones(sq, sk, dtype=torch.bool, device=device).triu_(1 + sk - sq)


class FusedScaleMaskSoftmax(nn.Module):
    """Megatron's ``FusedScaleMaskSoftmax``: fused kernel when eligible, PyTorch otherwise.

    Args:
        input_in_fp16: scores arrive in fp16 (the PyTorch path then upcasts if asked).
        input_in_bf16: scores arrive in bf16.
        attn_mask_type: :class:`AttnMaskType`.
        scaled_masked_softmax_fusion: allow the fused kernel (``--masked-softmax-fusion``).
        mask_func: ``mask_func(scores, mask)`` for the PyTorch path, e.g.
            ``scores.masked_fill_(mask, -10000.0)``.
        softmax_in_fp32: compute the PyTorch path in fp32 for fp16/bf16 scores.
        scale: multiplies the scores first (None: 1); requires ``softmax_in_fp32``.
    """

    def __init__(self, input_in_fp16, input_in_bf16, attn_mask_type, scaled_masked_softmax_fusion,
                 mask_func, softmax_in_fp32, scale):
        super().__init__()
        if input_in_fp16 and input_in_bf16:
            raise ValueError("input_in_fp16 and input_in_bf16 cannot both be set")
        if scale is not None and not softmax_in_fp32:
            raise ValueError("softmax should be in fp32 when scaled")
        self.input_in_fp16 = input_in_fp16
        self.input_in_bf16 = input_in_bf16
        self.input_in_float16 = input_in_fp16 or input_in_bf16
        self.attn_mask_type = attn_mask_type
        self.scaled_masked_softmax_fusion = scaled_masked_softmax_fusion
        self.mask_func = mask_func
        self.softmax_in_fp32 = softmax_in_fp32
        self.scale = scale
        self.last_path = None  # "fused CPU kernel" / "fused CUDA kernel" / "PyTorch" after a call

    @classmethod
    def for_dtype(cls, compute_dtype, attn_mask_type, fusion, mask_func, scale):
        """The softmax our models build: from the config's compute dtype, fp32 math.

        Megatron's constructor takes the dtype as two bools; the paths themselves follow the
        scores' own dtype at each call, so the dtype is all a model needs to give.
        """
        return cls(input_in_fp16=compute_dtype == torch.float16,
                   input_in_bf16=compute_dtype == torch.bfloat16,
                   attn_mask_type=attn_mask_type, scaled_masked_softmax_fusion=fusion,
                   mask_func=mask_func, softmax_in_fp32=True, scale=scale)

    def forward(self, input, mask):
        """Probabilities ``[b, np, sq, sk]`` in ``input.dtype``.

        Args:
            input: attention scores ``[b, np, sq, sk]``.
            mask: bool ``[b or 1, 1, sq, sk]``, True = masked out; may be None.
        """
        if input.dim() != 4:
            raise ValueError(f"scores must be [b, np, sq, sk], got {tuple(input.shape)}")
        if self.is_kernel_available(mask, *input.size(), dtype=input.dtype, device=input.device):
            self.last_path = f"fused {input.device.type.upper()} kernel"
            return self.forward_fused_softmax(input, mask)
        self.last_path = "PyTorch"
        return self.forward_torch_softmax(input, mask)

    def kernel_unavailable_reason(self, mask, b, np, sq, sk, dtype=None, device=None):
        """Why the fused kernel does not apply to this call, or None when it does.

        Args:
            mask: the mask that will be passed (None or a tensor).
            b, np, sq, sk: the scores' shape.
            dtype, device: the scores' dtype and device (default: from the constructor
                flags and ``megatron.mpu.utils.get_device()``).
        """
        if dtype is None:
            dtype = (torch.float16 if self.input_in_fp16 else
                     torch.bfloat16 if self.input_in_bf16 else torch.float32)
        if device is None:
            from megatron.mpu.utils import get_device

            device = get_device()
        device = torch.device(device)
        if not self.scaled_masked_softmax_fusion:  # the model config's switch, only
            return "fusion disabled"
        if fused_kernels.disabled_reason() is not None:
            return fused_kernels.disabled_reason()
        if device.type == "cuda":
            if dtype not in (torch.float16, torch.bfloat16):
                return f"the CUDA kernel takes fp16/bf16, not {dtype}"
            if not (16 < sk <= CUDA_MAX_KEYS and sk % 8 == 0):
                return f"the CUDA kernel needs 16 < sk <= {CUDA_MAX_KEYS} and sk % 8 == 0"
        elif device.type == "cpu":
            if dtype not in (torch.float32, torch.bfloat16):
                return f"the CPU kernel takes fp32/bf16, not {dtype}"
        else:
            return f"no kernel for {device.type}"
        if b * np * sq * sk == 0:
            return "empty input"
        if self.attn_mask_type == AttnMaskType.causal and sq > sk:
            return "causal with sq > sk"
        if mask is not None and not _mask_supported(mask, b, sq, sk, device):
            return f"mask of shape {tuple(mask.shape)} / {mask.dtype} on {mask.device}"
        if not fused_kernels.kernels_available(device.type):
            return "kernels unavailable"
        return None

    def is_kernel_available(self, mask, b, np, sq, sk, dtype=None, device=None):
        """Megatron's eligibility check (plus dtype/device); see kernel_unavailable_reason."""
        return self.kernel_unavailable_reason(mask, b, np, sq, sk, dtype, device) is None

    def forward_fused_softmax(self, input, mask):
        scale = 1.0 if self.scale is None else float(self.scale)
        causal = self.attn_mask_type == AttnMaskType.causal
        return fused_masked_softmax(input, mask, scale, causal)

    def forward_torch_softmax(self, input, mask):
        """The PyTorch path; the same function as the kernels (see the module docstring)."""
        scores = input
        if input.dtype in (torch.float16, torch.bfloat16) and self.softmax_in_fp32:
            scores = scores.float()
        if self.scale is not None:
            scores = scores * self.scale
        if mask is not None:
            if scores is input:  # mask_func works in place: never on the caller's tensor
                scores = scores.clone()
            scores = self.mask_func(scores, mask)
        if self.attn_mask_type == AttnMaskType.causal:
            sq, sk = scores.shape[-2:]
            scores = scores.masked_fill(causal_exclusion(sq, sk, scores.device), float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        return probs.to(input.dtype)


def _mask_supported(mask, b, sq, sk, device):
    return (mask.dtype in (torch.bool, torch.uint8) and mask.dim() == 4 and mask.shape[1] == 1
            and tuple(mask.shape[2:]) == (sq, sk) and mask.shape[0] in (1, b)
            and mask.device.type == device.type
            and (device.index is None or mask.device.index == device.index))

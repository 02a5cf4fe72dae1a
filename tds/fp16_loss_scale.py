"""The fp16 loss scale DeepSpeed's engine forgets without ZeRO.

DeepSpeed's plain fp16 optimizers (``FP16_Optimizer``, ``FP16_UnfusedOptimizer``: fp16 with
ZeRO stage 0, the default of pipeline runs) divide the gradients by the loss scale in their
step, but DeepSpeed 0.19's ``engine.backward`` multiplies the loss by it only for a ZeRO
optimizer (deepspeedai/DeepSpeed#8393). The update then comes out ``loss_scale`` (65536 at
the start) times too small: with Adam, mostly hidden by its normalisation until the
gradients reach its epsilon, and small fp16 gradients underflow, which is what the scale is
for. Training stalls without an error.

:func:`install` gives such an engine a :class:`LossScale`; the engine's backward (DeepSpeed's
``engine.backward`` for a plain engine, tds's pipeline engines for the last stage) attaches
it to the loss. It is a gradient hook on the loss: the gradient DeepSpeed's backward sends into
the loss is ``1/gas`` where DeepSpeed did not scale and ``loss_scale/gas`` where it did (a
DeepSpeed with the fix). The first backward with a scale other than 1 tells which (one host
read in the run); from then on the hook multiplies by the optimizer's current scale (a Python
float: no read) only where DeepSpeed does not, so a fixed DeepSpeed is never scaled twice.
"""
import math
import types
from typing import Any, Optional

import torch
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer


class LossScale:
    """Scales the loss's gradient by the fp16 optimizer's loss scale where DeepSpeed did not.

    Attributes:
        deepspeed_scales: None until a backward with a scale other than 1 told; then whether
            DeepSpeed's own backward applied the scale (then this does nothing).
    """

    def __init__(self, engine: Any):
        self.engine = engine
        self.deepspeed_scales: Optional[bool] = None
        #: The scale of the step's gradients (the optimizer's norm is of the scaled ones).
        self.step_scale = 1.0

    def attach(self, loss: torch.Tensor, scale_wrt_gas: bool = True) -> None:
        """Register the hook on ``loss`` before it goes to DeepSpeed's backward."""
        if loss.requires_grad:
            gas = self.engine.gradient_accumulation_steps() if scale_wrt_gas else 1
            loss.register_hook(lambda grad: self._scaled(grad, gas))

    def _scaled(self, grad: torch.Tensor, gas: int) -> torch.Tensor:
        scale = self.step_scale = float(self.engine.optimizer.loss_scale)
        if self.deepspeed_scales is None and scale != 1.0:
            self.deepspeed_scales = self._deepspeed_applied(float(grad) * gas, scale)
        if self.deepspeed_scales or scale == 1.0:
            return grad
        return grad * scale

    @staticmethod
    def _deepspeed_applied(received: float, scale: float) -> bool:
        if math.isclose(received, 1.0, rel_tol=1e-3):
            return False
        if math.isclose(received, scale, rel_tol=1e-3):
            return True
        raise RuntimeError(f"tds: DeepSpeed's backward scaled the loss by {received:g}, neither "
                           f"1 nor the fp16 optimizer's loss scale {scale:g}; this DeepSpeed "
                           f"version is not supported with fp16 without ZeRO (use ZeRO stage 1 "
                           f"or bf16)")


def needs_fix(engine: Any) -> bool:
    """Whether ``engine`` steps with one of DeepSpeed's plain fp16 optimizers."""
    return isinstance(getattr(engine, "optimizer", None), (FP16_Optimizer, FP16_UnfusedOptimizer))


def install(engine: Any) -> None:
    """Give ``engine`` its :class:`LossScale` (``engine.fp16_loss_scale``, else None); a plain
    engine's ``backward`` attaches it (tds's pipeline engines call :func:`backward`), and
    ``get_global_grad_norm()`` reports the norm of the unscaled gradients (DeepSpeed's plain
    fp16 optimizers keep the norm of the scaled ones)."""
    fix = engine.fp16_loss_scale = LossScale(engine) if needs_fix(engine) else None
    if fix is None:
        return
    if type(engine).backward is DeepSpeedEngine.backward:
        engine.backward = types.MethodType(backward, engine)
    scaled_norm = engine.get_global_grad_norm

    def get_global_grad_norm():
        norm = scaled_norm()
        if norm is None or (isinstance(norm, float) and norm < 0):  # none yet, or invalid
            return norm
        return norm / fix.step_scale

    engine.get_global_grad_norm = get_global_grad_norm


def backward(engine: Any, loss: torch.Tensor, retain_graph: bool = False,
             scale_wrt_gas: bool = True) -> Any:
    """DeepSpeed's ``engine.backward``, with the fp16 loss scale where DeepSpeed leaves it out."""
    fix = getattr(engine, "fp16_loss_scale", None)
    if fix is not None:
        fix.attach(loss, scale_wrt_gas)
    return DeepSpeedEngine.backward(engine, loss, retain_graph=retain_graph,
                                    scale_wrt_gas=scale_wrt_gas)

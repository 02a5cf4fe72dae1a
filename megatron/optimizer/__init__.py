"""AdamW with Megatron's parameter groups, loss scaling, overflow skipping and clipping."""
import math

import torch
import torch.distributed as dist

from .. import mpu
from .grad_scaler import ConstantGradScaler, DynamicGradScaler, build_grad_scaler


def get_param_groups(modules, weight_decay):
    """Two groups: matrices and embeddings decay; biases and norm weights (1-D) do not."""
    decay, no_decay = [], []
    for module in modules:
        for param in module.parameters():
            if param.requires_grad:
                (decay if param.dim() > 1 else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


class MegatronOptimizer:
    """Wraps a torch optimizer: unscale + overflow check (fp16), clip, step.

    Parameters stay fp32 (the master weights); fp16/bf16 compute comes from autocast, so
    the gradients arrive in fp32 and nothing is copied between model and master weights.

    Args:
        optimizer: the torch optimizer over the model's parameters.
        grad_scaler: a loss scaler (fp16) or None.
        clip_grad: max global gradient norm (0 disables clipping; the norm is still measured).
        skip_nonfinite: skip the update when the gradient norm is inf/nan (fp32/bf16).
    """

    def __init__(self, optimizer, grad_scaler, clip_grad, skip_nonfinite=False):
        self.optimizer = optimizer
        self.grad_scaler = grad_scaler
        self.clip_grad = clip_grad
        self.skip_nonfinite = skip_nonfinite

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def params(self):
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    @property
    def loss_scale(self):
        """The loss scale as a float (a host read: for logs)."""
        return self.grad_scaler.scale if self.grad_scaler is not None else 1.0

    def scale_loss(self, loss):
        if self.grad_scaler is None:
            return loss
        return loss * self._scaler_on(loss.device).scale_tensor

    def zero_grad(self):
        self.optimizer.zero_grad(set_to_none=True)

    def _scaler_on(self, device):
        if self.grad_scaler.scale_tensor.device != device:
            self.grad_scaler.to(device)
        return self.grad_scaler

    @property
    def skips_on_device(self):
        """The optimizer takes a ``found_inf`` tensor and skips its update on the device
        (torch's fused Adam/AdamW); others need the overflow flag read on the host."""
        return bool(self.optimizer.defaults.get("fused"))

    def _unscale_and_check(self, grads):
        """Unscale in place; a 1-element device tensor, non-zero (on every rank) if any
        gradient anywhere is inf/nan."""
        device = grads[0].device if grads else mpu.get_device()
        found_inf = torch.zeros(1, device=device)
        if grads:
            inv_scale = self._scaler_on(device).scale_tensor.double().reciprocal().float()
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf,
                                                             inv_scale.reshape(1))
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
        return found_inf

    def step(self):
        """Returns ``(updated, grad_norm)``: ``updated`` is False (or a device bool tensor)
        for a step an fp16 overflow skipped; the norm is a device tensor (None for a step
        skipped on the host).

        fp16 with an optimizer that skips on the device (:attr:`skips_on_device`): the
        overflow flag, the loss-scale update and the skip all stay on the device, no host
        read. Otherwise the flag is read (one sync) to decide.
        """
        params = [p for p in self.params() if p.grad is not None]
        if self.skips_on_device:
            return self._fused_step(params)
        found_inf = None
        if self.grad_scaler is not None:
            found_inf = self._unscale_and_check([p.grad for p in params])
            self.grad_scaler.update(found_inf)
            if not self.skips_on_device and bool(found_inf.item()):
                self.zero_grad()
                return False, None
        max_norm = self.clip_grad if self.clip_grad > 0 else float("inf")
        grad_norm = mpu.clip_grad_norm_tensor(params, max_norm)
        # --skip-nonfinite-steps reads the norm on the host (one sync, only when asked for)
        if self.skip_nonfinite and not bool(torch.isfinite(grad_norm)):
            self.zero_grad()  # keep the weights, count a skipped step
            return False, grad_norm
        if found_inf is None or not self.skips_on_device:
            self.optimizer.step()
            return True, grad_norm
        self.optimizer.found_inf = found_inf.reshape(())  # the fused kernel skips on it
        try:
            self.optimizer.step()
        finally:
            del self.optimizer.found_inf
        return found_inf.reshape(()) == 0, grad_norm

    def _fused_step(self, params):
        """:meth:`step` for an optimizer that takes ``grad_scale`` and ``found_inf`` (torch's
        fused AdamW): the gradients are read once for their norms and once by the update.
        fp16's unscale and the clip are the update's ``grad_scale`` (``loss scale / clip
        coefficient``), an overflow is a non-finite gradient norm: no pass over the
        gradients to unscale or to multiply them, no host read."""
        grads = [p.grad for p in params]
        device = grads[0].device if grads else mpu.get_device()
        total, norms = mpu.grad_norms(params)
        found_inf = scale = None
        if self.grad_scaler is not None:
            scale = self._scaler_on(device).scale_tensor.clone()  # the backward's scale
            found_inf = torch.zeros(1, device=device)
            if norms:
                found_inf = torch.stack(norms).isfinite().all().logical_not().float().reshape(1)
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
            self.grad_scaler.update(found_inf)
            total = total / scale
        max_norm = self.clip_grad if self.clip_grad > 0 else float("inf")
        if self.skip_nonfinite and not bool(torch.isfinite(total)):
            self.zero_grad()  # --skip-nonfinite-steps: one host read, only when asked for
            return False, total
        coef = mpu.clip_coefficient(total, max_norm)
        self.optimizer.grad_scale = (scale if scale is not None else 1.0) / coef
        if found_inf is not None:
            self.optimizer.found_inf = found_inf.reshape(())  # the fused kernel skips on it
        try:
            self.optimizer.step()
        finally:
            del self.optimizer.grad_scale
            if found_inf is not None:
                del self.optimizer.found_inf
        return (True if found_inf is None else found_inf.reshape(()) == 0), total

    def state_dict(self):
        state = {"optimizer": self.optimizer.state_dict()}
        if self.grad_scaler is not None:
            state["grad_scaler"] = self.grad_scaler.state_dict()
        return state

    def load_state_dict(self, state):
        self.optimizer.load_state_dict(state["optimizer"])
        if self.grad_scaler is not None and "grad_scaler" in state:
            self.grad_scaler.load_state_dict(state["grad_scaler"])


__all__ = ["ConstantGradScaler", "DynamicGradScaler", "MegatronOptimizer",
           "build_grad_scaler", "get_param_groups"]

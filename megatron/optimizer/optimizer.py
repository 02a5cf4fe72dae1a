"""The optimizer step of every layout: loss scaling, overflow skip, clipping, update.

:class:`MegatronOptimizer` wraps a torch optimizer over fp32 master weights (fp16 / bf16
compute comes from autocast, so gradients arrive in fp32 and nothing is copied between
model and master weights). One :meth:`~MegatronOptimizer.step` per training step, at pp 1
and pp > 1 alike: unscale and check for inf/nan (fp16), measure the gradient norm (each
element of the model once: :func:`megatron.mpu.norm_of_grads`), clip, update. The
distributed optimizer (:mod:`.distributed`) is the same step over the slices of the
gradient buffers a data-parallel rank owns, followed by the all-gather of the parameters.
"""
from typing import Any, List, Tuple

import torch
import torch.distributed as dist

from .. import mpu


class MegatronOptimizer:
    """Wraps a torch optimizer: unscale + overflow check (fp16), clip, step.

    Args:
        optimizer: the torch optimizer over the model's parameters.
        grad_scaler: a loss scaler (fp16) or None.
        clip_grad: max global gradient norm (0 disables clipping; the norm is still measured).
        skip_nonfinite: skip the update when the gradient norm is inf/nan (fp32/bf16).
        grads: the :class:`~megatron.distributed.DataParallel` whose buffers hold the
            gradients (:meth:`zero_grad` zeroes them); None: gradients are set to None.
        model_parallel: ``(tp_rank, tensor x pipeline group)`` the norm counts parameters
            over (default: megatron.mpu's; tds's engine passes its module's topology's).
    """

    def __init__(self, optimizer, grad_scaler, clip_grad, skip_nonfinite=False, grads=None,
                 model_parallel=None):
        self.optimizer = optimizer
        self.grad_scaler = grad_scaler
        self.clip_grad = clip_grad
        self.skip_nonfinite = skip_nonfinite
        self.grads = grads
        self.model_parallel = model_parallel

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def params(self) -> List[torch.Tensor]:
        """The tensors the torch optimizer updates."""
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _norm_terms(self, params) -> Tuple[List[bool], Any]:
        """Per parameter whether its gradient counts toward the norm here, and the group the
        norm is summed over: each parameter once across the model-parallel group."""
        tp_rank, group = self.model_parallel or (mpu.get_tensor_model_parallel_rank(),
                                                 mpu.get_model_parallel_group())
        return [mpu.counts_toward_norm(p, tp_rank) for p in params], group

    def _norm(self, params, grads, device):
        """The gradient norm (each element of the model once) and each gradient's norm."""
        counted, group = self._norm_terms(params)
        experts = self._experts(params)
        expert_group = mpu.get_expert_model_parallel_group() if any(experts) else None
        return mpu.norm_of_grads(grads, counted, group, device=device, expert=experts,
                                 expert_group=expert_group)

    def _experts(self, params) -> List[bool]:
        """Per parameter whether it is an expert's (held by one expert-parallel rank only,
        its norm summed over them too)."""
        return [getattr(p, "allreduce", True) is False for p in params]

    def loss_multiplier(self):
        """What :meth:`scale_loss` multiplies a loss by (the fp16 loss scale, a device
        tensor; 1 without): the MoE routing losses' gradients get the same factor."""
        if self.grad_scaler is None:
            return 1.0
        return self._scaler_on(mpu.get_device()).scale_tensor

    @property
    def loss_scale(self):
        """The loss scale as a float (a host read: for logs)."""
        return self.grad_scaler.scale if self.grad_scaler is not None else 1.0

    def scale_loss(self, loss):
        if self.grad_scaler is None:
            return loss
        return loss * self._scaler_on(loss.device).scale_tensor

    def zero_grad(self):
        if self.grads is not None:
            self.grads.zero_grad()
        else:
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
        _max_over_world(found_inf)
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
        grads = [p.grad for p in params]
        if self.grad_scaler is not None:
            found_inf = self._unscale_and_check(grads)
            self.grad_scaler.update(found_inf)
            if bool(found_inf.item()):  # the one host read of fp16 without a fused update
                self.zero_grad()
                return False, None
        total, _ = self._norm(params, grads, mpu.get_device())
        max_norm = self.clip_grad if self.clip_grad > 0 else float("inf")
        if grads:  # scaled unconditionally by min(1, coef): no host read to decide
            torch._foreach_mul_(grads, mpu.clip_coefficient(total, max_norm))
        # --skip-nonfinite-steps reads the norm on the host (one sync, only when asked for)
        if self.skip_nonfinite and not bool(torch.isfinite(total)):
            self.zero_grad()  # keep the weights, count a skipped step
            return False, total
        self.optimizer.step()
        self._after_update()
        return True, total

    def _fused_step(self, params):
        """:meth:`step` for an optimizer that takes ``grad_scale`` and ``found_inf`` (torch's
        fused AdamW): the gradients are read once for their norms and once by the update.
        fp16's unscale and the clip are the update's ``grad_scale`` (``loss scale / clip
        coefficient``), an overflow is a non-finite gradient norm: no pass over the
        gradients to unscale or to multiply them, no host read."""
        grads = [p.grad for p in params]
        device = grads[0].device if grads else mpu.get_device()
        total, norms = self._norm(params, grads, device)
        found_inf = scale = None
        if self.grad_scaler is not None:
            scale = self._scaler_on(device).scale_tensor.clone()  # the backward's scale
            found_inf = torch.zeros(1, device=device)
            if norms:
                found_inf = torch.stack(norms).isfinite().all().logical_not().float().reshape(1)
            _max_over_world(found_inf)
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
        self._after_update()
        return (True if found_inf is None else found_inf.reshape(()) == 0), total

    def _after_update(self) -> None:
        """What follows the update (the distributed optimizer all-gathers parameters)."""

    def state_dict(self):
        state = {"optimizer": self.optimizer.state_dict()}
        if self.grad_scaler is not None:
            state["grad_scaler"] = self.grad_scaler.state_dict()
        return state

    def load_state_dict(self, state):
        self.optimizer.load_state_dict(state["optimizer"])
        if self.grad_scaler is not None and "grad_scaler" in state:
            self.grad_scaler.load_state_dict(state["grad_scaler"])


def _max_over_world(flag: torch.Tensor) -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)




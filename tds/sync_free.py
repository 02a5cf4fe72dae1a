"""Optimizer steps without a host read: DeepSpeed's ZeRO and bf16 optimizers, fp32/bf16.

DeepSpeed decides on the host, every step, whether the gradient norm is finite and whether
to clip: each decision reads a device value (``bool(tensor)``), which on a GPU makes the host
wait for the device. ZeRO stages 1-2 read 3 values a step in fp32 (the norm's validity, then
once per parameter group in ``unscale_and_clip_grads``) and 4 in bf16 (plus the overflow
flag); its bf16 optimizer without ZeRO (pipeline runs) reads 2.

``tds.initialize(..., sync_free_step=True)`` keeps the norm and the clipping on the device:

- the global gradient norm is DeepSpeed's own (same parameters counted, same groups), kept
  as a 0-dim fp32 tensor; inf/nan stays inf/nan (DeepSpeed masks it to -1, which is made
  inf here so that the reported norm says what happened);
- the gradients are scaled by ``min(1, max_norm / (norm + 1e-6))`` unconditionally, as
  Megatron-LM and ``torch.nn.utils.clip_grad_norm_`` do;
- a step whose norm is inf/nan is applied, not skipped: deciding to skip is the read this
  avoids. The engine reports the norm (``get_global_grad_norm()``), inf/nan included, for the
  caller to act on when it reads it (megatron stops the run at its next log line);
- fp16 keeps DeepSpeed's path: its loss scaler must know on the host whether to skip.

The ZeRO optimizer is configured with ``zero_optimization.compute_grad_norm: false`` and
``gradient_clipping: 0`` (DeepSpeed then neither computes nor checks the norm) and, in bf16,
``bf16.check_grad_overflow: false``; tds computes the norm and clips with the configured
``gradient_clipping``. Checkpoints record that value as DeepSpeed does, so a checkpoint moves
between runs with and without the sync-free step in either direction.

DeepSpeed's norm helpers mask a non-finite norm to -1 with a tensor made from host data
(``deepspeed.runtime.utils.mask_nan_or_inf_with_val_inplace``: ``torch.tensor(-1.0,
device=...)``, on a GPU a copy from pageable memory, which waits: found on an H100 by
``torch.cuda.set_sync_debug_mode``). :func:`install` puts :func:`mask_nan_or_inf_inplace`
(the same values, filled from a Python number) in its place in DeepSpeed's modules that call it.

Where a configuration is one DeepSpeed's sync-free options do not allow (optimizer offload,
ZeRO-1 bf16 with fp32 gradient accumulation: DeepSpeed's bf16 optimizer is used then, and is
made sync-free instead), nothing changes but what this module can change; ``engine.
sync_free_step`` says whether the step is sync-free.
"""
import copy
import math
from typing import Any, Dict, Optional, Tuple

import torch
import deepspeed.runtime.utils as ds_utils
import deepspeed.runtime.zero.stage_1_and_2 as ds_zero
from deepspeed.checkpoint.constants import CLIP_GRAD
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.utils import get_global_norm_of_tensors
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

EPS = 1e-6
"""Added to the norm before dividing (DeepSpeed's and Megatron-LM's value)."""


def _enabled(config: Dict[str, Any], key: str) -> bool:
    return bool(config.get(key, {}).get("enabled", False))


def _fp32_accumulation(config: Dict[str, Any]) -> bool:
    dtype = config.get("data_types", {}).get("grad_accum_dtype")
    return str(dtype).replace("torch.", "") in ("fp32", "float32", "float")


def prepare_config(config: Dict[str, Any]) -> Tuple[Dict[str, Any], Optional[float]]:
    """A copy of DeepSpeed's ``config`` for a sync-free step, and the norm tds clips to.

    Returns ``(config, max_norm)``; ``max_norm`` is None where tds leaves the step to
    DeepSpeed (fp16, optimizer offload) and 0 where clipping is off.
    """
    if not isinstance(config, dict):
        raise TypeError("sync_free_step=True needs the DeepSpeed config as a dict (config=...), "
                        f"got {type(config).__name__}")
    config = copy.deepcopy(config)
    if _enabled(config, "fp16"):
        return config, None
    zero = config.get("zero_optimization", {})
    stage = int(zero.get("stage", 0))
    offload = zero.get("offload_optimizer") or zero.get("cpu_offload")
    if isinstance(offload, dict):
        offload = offload.get("device", "none") not in (None, "none")
    if stage > 2 or offload:
        return config, None
    max_norm = float(config.get("gradient_clipping", 0.0))
    bf16 = _enabled(config, "bf16")
    bf16_optimizer = bf16 and stage == 1 and _fp32_accumulation(config)
    if stage in (1, 2) and not bf16_optimizer:
        config["zero_optimization"] = {**zero, "compute_grad_norm": False}
        config["gradient_clipping"] = 0.0
        if bf16:
            config["bf16"] = {**config["bf16"], "check_grad_overflow": False}
    return config, max_norm


def mask_nan_or_inf_inplace(input: torch.Tensor, device: Any = None,
                            val: float = -1.0) -> None:
    """DeepSpeed's ``mask_nan_or_inf_with_val_inplace`` without its host-made tensor: inf and
    nan entries of ``input`` become ``val`` (DeepSpeed's callers: -1), on the device."""
    input.masked_fill_(~input.isfinite(), val)


#: DeepSpeed's modules whose norm helpers call the masking by this name.
_MASKING_MODULES = (ds_utils, ds_zero)
#: DeepSpeed's own masking (kept for the tests that compare the two).
DEEPSPEED_MASKING = ds_utils.mask_nan_or_inf_with_val_inplace


def _install_masking() -> None:
    for module in _MASKING_MODULES:
        module.mask_nan_or_inf_with_val_inplace = mask_nan_or_inf_inplace


def install(engine: Any, max_norm: Optional[float]) -> bool:
    """Make ``engine``'s optimizer step sync-free (see the module docstring); returns whether
    it now is (also kept as ``engine.sync_free_step``)."""
    optimizer = engine.optimizer
    done = False
    if max_norm is not None:
        if type(optimizer) is DeepSpeedZeroOptimizer and not optimizer.compute_grad_norm \
                and not optimizer.cpu_offload:
            optimizer.__class__ = SyncFreeZeroOptimizer
            optimizer.max_norm = max_norm
            done = True
        elif type(optimizer) is BF16_Optimizer and not optimizer.has_moe_layers and \
                not getattr(optimizer, "_uses_muon", False):
            optimizer.__class__ = SyncFreeBF16Optimizer
            done = True
    if done:
        _install_masking()
    engine.sync_free_step = done
    return done


def _clip_coefficient(max_norm: float, norm: torch.Tensor) -> torch.Tensor:
    return (max_norm / (norm + EPS)).clamp(max=1.0)


def _invalid_to_inf(norm: torch.Tensor) -> torch.Tensor:
    """DeepSpeed's norm helpers write -1 for a non-finite norm; report it as inf."""
    return torch.where(norm < 0, torch.full_like(norm, math.inf), norm)


class SyncFreeZeroOptimizer(DeepSpeedZeroOptimizer):
    """DeepSpeed's ZeRO stage 1-2 optimizer (fp32/bf16) with the norm and clipping on the
    device. Built by :func:`install` from an optimizer DeepSpeed made with
    ``compute_grad_norm: false`` and ``gradient_clipping: 0``."""

    max_norm: float = 0.0
    """The clipping norm (0: no clipping; the norm is still measured)."""
    _clip = None

    def step(self, closure=None):
        # the same norm DeepSpeed computes (its partitions, each parameter once), inf if any
        # group's is inf/nan; measured before any group steps
        norm = self.scaled_global_norm() / self.loss_scale
        self._clip = _clip_coefficient(self.max_norm, norm) if self.max_norm > 0 else None
        try:
            super().step(closure)
        finally:
            self._clip = None
        self._global_grad_norm = norm

    def unscale_and_clip_grads(self, grad_groups_flat, total_norm):
        if self._clip is not None:  # [flat partition] from step(); lists of sub-partitions too
            torch._foreach_mul_([t for g in grad_groups_flat
                                 for t in (g if isinstance(g, (list, tuple)) else [g])],
                                self._clip)
        super().unscale_and_clip_grads(grad_groups_flat, total_norm)  # the loss scale only

    def state_dict(self):
        state = super().state_dict()
        state[CLIP_GRAD] = self.max_norm  # as DeepSpeed's own step would record it
        return state

    def load_state_dict(self, state_dict_list, load_optimizer_states=True,
                        load_from_fp32_weights=False, checkpoint_folder=None, load_serial=None,
                        param_shapes=None):
        # DeepSpeed refuses a saved clip value > 0 with compute_grad_norm false; the clipping
        # is this run's (max_norm, applied here), so a checkpoint of either kind loads.
        # (DeepSpeed's signature, spelled out: callers inspect it for load_from_fp32_weights.)
        states = state_dict_list if isinstance(state_dict_list, list) else [state_dict_list]
        for state in states:
            if isinstance(state, dict) and CLIP_GRAD in state:
                state[CLIP_GRAD] = 0.0
        return super().load_state_dict(
            state_dict_list, load_optimizer_states=load_optimizer_states,
            load_from_fp32_weights=load_from_fp32_weights, checkpoint_folder=checkpoint_folder,
            load_serial=load_serial, param_shapes=param_shapes)


class SyncFreeBF16Optimizer(BF16_Optimizer):
    """DeepSpeed's bf16 optimizer (bf16 weights, fp32 master weights and gradients; pipeline
    runs and ZeRO-1 with fp32 accumulation) with the norm and clipping on the device."""

    def step(self, closure=None):
        if closure is not None:
            raise NotImplementedError(f"{type(self).__name__} does not support closure")
        self.overflow = False
        grads, _ = self.get_grads_for_norm()
        norm = _invalid_to_inf(get_global_norm_of_tensors(grads, mpu=self.mpu,
                                                          norm_type=self.norm_type))
        self._global_grad_norm = norm
        if self.clip_grad > 0:
            torch._foreach_mul_(self.get_grads_for_norm(for_clipping=True),
                                _clip_coefficient(self.clip_grad, norm))
        # DeepSpeed's step from here on: fp32 gradients to the master partitions, step,
        # bf16 weights from the master weights
        for master, grad in zip(self.fp32_groups_flat_partition,
                                self.fp32_groups_gradient_flat_partition):
            master.grad = grad if grad.dtype == master.dtype else grad.to(master.dtype)
        self.optimizer.step()
        if self.grad_acc_dtype is not torch.float32:
            for master in self.fp32_groups_flat_partition:
                master.grad = None
        self._lazy_init_hp_params_optimizer_state()
        self.update_lp_params()
        self.clear_hp_grads()

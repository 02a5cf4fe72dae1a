"""The plain backend: torch DDP, autocast over fp32 master weights, our AdamW wrapper.

Each step runs ``gas`` micro-batches; the data-parallel all-reduce runs once per step (on
the last micro-batch, the others under ``no_sync``), and so does the tensor-parallel sum of
the sequence-parallel gradients (one coalesced all-reduce before clipping). fp16/bf16
compute uses torch.amp autocast over fp32 parameters; fp16 adds a dynamic loss scaler with
DeepSpeed's semantics, its overflow handled on the device (megatron/optimizer).
"""
import contextlib
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional, Tuple

import torch
from torch.nn.parallel import DistributedDataParallel

from .. import mpu
from .backend import TrainingBackend, build_optimizer_and_scheduler


def autocast(precision: Any) -> ContextManager:
    """autocast to the compute dtype of a PrecisionConfig (a no-op in fp32)."""
    if precision.dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=mpu.get_device().type, dtype=precision.dtype)


def wrap_data_parallel(model: torch.nn.Module) -> torch.nn.Module:
    """torch DDP over the data x context group (nothing to do with one replica): the ranks
    holding the same shard, whether they read other samples or other parts of the same
    ones (context parallelism: the loss's backward scales for this average,
    :func:`megatron.mpu.reduce_loss_over_context_parallel`)."""
    group = mpu.get_data_parallel_group(with_context_parallel=True)
    if mpu.get_data_parallel_world_size(with_context_parallel=True) == 1:
        return model
    device = mpu.get_device()
    return DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None,
                                   process_group=group, broadcast_buffers=False)


class DDPBackend(TrainingBackend):
    """torch DDP + :class:`~megatron.optimizer.MegatronOptimizer` (see the module docstring)."""

    name = "ddp"
    sp_params = ()
    """Sequence-parallel parameters whose tp sum the step does (once, after the backward)."""

    @classmethod
    def build(cls, module: torch.nn.Module, cfg: Any) -> "DDPBackend":
        # sequence-parallel gradients: summed over tp once per step (train_step), not per use
        sp_params = mpu.defer_sequence_parallel_grads(module)
        model = wrap_data_parallel(module)
        optimizer, lr_scheduler = build_optimizer_and_scheduler(module, cfg, for_engine=False)
        backend = cls(model, optimizer, lr_scheduler, cfg)
        backend.sp_params = sp_params
        return backend

    @property
    def loss_scale(self) -> Any:
        return self.optimizer.loss_scale

    def train_step(self, forward_step_func: Callable, data_iterator: Optional[Iterator]
                   ) -> Tuple[List[Dict[str, Any]], Any, Any]:
        gas = self.cfg.batch.gas
        self.optimizer.zero_grad()
        per_micro_batch = []
        for i in range(gas):
            last = i == gas - 1
            sync = self.model.no_sync() if hasattr(self.model, "no_sync") and not last \
                else contextlib.nullcontext()
            with sync, self.micro_batch(i):
                with autocast(self.cfg.precision):
                    loss, stats = forward_step_func(data_iterator, self.model)
                self.optimizer.scale_loss(loss / gas).backward()
            per_micro_batch.append(stats)
        if self.sp_params:  # one coalesced all-reduce, before clipping
            mpu.allreduce_sequence_parallel_grads(self.sp_params)
        updated, grad_norm = self.optimizer.step()
        # a device flag (fp16 skipped on the device) is not read here: the schedule moves on
        # and take_back_skipped_steps corrects it when the loop reads the flags (log time)
        if torch.is_tensor(updated) or updated:
            self.lr_scheduler.step()
        return per_micro_batch, updated, grad_norm

    def take_back_skipped_steps(self, count: int) -> None:
        if count:
            self.lr_scheduler.step(-count)

    def eval_step(self, forward_step_func: Callable,
                  data_iterator: Optional[Iterator]) -> List[Dict[str, Any]]:
        per_micro_batch = []
        for i in range(self.cfg.batch.gas):
            with self.micro_batch(i), autocast(self.cfg.precision):
                _, stats = forward_step_func(data_iterator, self.model)
            per_micro_batch.append(stats)
        return per_micro_batch

"""tds's pipeline engine: DeepSpeed's engine API over tds's schedule and megatron's step.

``tds.initialize(model=PipelineModule, optimizer=..., config=...)`` returns a
:class:`PipelineEngine`, what CPM-Pretrain's scripts call (``train_batch``, ``eval_batch``,
``save_checkpoint``, ``load_checkpoint``, ``module``, the contract setters). It is a thin
adapter: a step is

    optimizer.zero_grad()                          the gradient buffers
    schedule.train(...)                            tds.pipe.schedule_step: every micro-batch
    model.finish_grad_sync()                       data-parallel, tied weights
    optimizer.step(); lr_scheduler.step()          loss scale, overflow skip, clipping

with megatron's :class:`~megatron.distributed.DataParallel` and
:class:`~megatron.optimizer.MegatronOptimizer` (the distributed optimizer for ZeRO stage 1),
the same code a megatron run steps through at every layout. DeepSpeed's config dict gives
the batch sizes, ``gradient_clipping``, ``fp16`` (a dynamic or static loss scale over fp32
master weights, compute in autocast), ``bf16`` and ``zero_optimization.stage`` (0 or 1).
Only DeepSpeed's public API is used: its ``PipelineModule`` (topology, tied weights), its
communication start-up and its config key names.
"""
import os
from typing import Any, Callable, Dict, Iterator, Optional

import torch
import torch.distributed as dist

from megatron import mpu
from megatron.distributed import DataParallel, DDPConfig, autocast_region, tied_weights_of
from megatron.optimizer import build_grad_scaler, build_optimizer

from .pipe import StageLink, contract_of
from .pipe.contract import StageContract
from .pipe.schedule_step import ScheduleStep, Stage, default_schedule


class DeepSpeedConfigError(ValueError):
    """A DeepSpeed config the pipeline engine cannot follow (the message says what to fix)."""


def _batch_sizes(config: Dict[str, Any], dp: int):
    """``(micro batch, gradient accumulation steps)`` from DeepSpeed's three batch keys, any
    two of which determine the third (``train_batch_size = micro x gas x dp``)."""
    train = config.get("train_batch_size")
    micro = config.get("train_micro_batch_size_per_gpu")
    gas = config.get("gradient_accumulation_steps")
    if micro is None and train is not None:
        micro = train // (dp * (gas or 1))
    if gas is None:
        gas = train // (micro * dp) if train is not None and micro else 1
    if micro is None or micro < 1 or gas < 1 or \
            (train is not None and train != micro * gas * dp):
        raise DeepSpeedConfigError(
            f"DeepSpeed config: train_batch_size ({train}) must equal "
            f"train_micro_batch_size_per_gpu ({micro}) x gradient_accumulation_steps ({gas}) x "
            f"the data-parallel size ({dp}); give two of the three and the third follows")
    return micro, gas


class _Precision:
    """The fp16 / bf16 blocks of a DeepSpeed config, as megatron's precision settings."""

    def __init__(self, config: Dict[str, Any]):
        fp16 = config.get("fp16", {}) or {}
        bf16 = config.get("bf16", config.get("bfloat16", {})) or {}
        self.fp16, self.bf16 = bool(fp16.get("enabled")), bool(bf16.get("enabled"))
        if self.fp16 and self.bf16:
            raise DeepSpeedConfigError("DeepSpeed config enables both fp16 and bf16; pick one")
        self.loss_scale = float(fp16.get("loss_scale", 0))
        self.initial_scale_power = int(fp16.get("initial_scale_power", 16))
        self.loss_scale_window = int(fp16.get("loss_scale_window", 1000))
        self.hysteresis = int(fp16.get("hysteresis", 2))
        self.min_loss_scale = float(fp16.get("min_loss_scale", 1))
        self.dtype = torch.float16 if self.fp16 else torch.bfloat16 if self.bf16 \
            else torch.float32


class PipelineEngine:
    """DeepSpeed's pipeline engine API over tds's schedule and megatron's optimizer step.

    Args:
        module: the ``PipelineModule`` (tds's or DeepSpeed's), with the contract attributes.
        optimizer: a torch optimizer over ``module``'s parameters (or ``f(params) ->
            optimizer``).
        config: DeepSpeed's config dict.
        lr_scheduler: stepped once per optimizer step (or ``f(optimizer) -> scheduler``).
        batch_fn: raw batch -> ``(inputs, labels)`` (DeepSpeed's ``set_batch_fn``).
        batch_context: ``f(micro_batch) -> context manager`` around each batch_fn call.
        pipeline_schedule: "1f1b", "interleaved", "zb-h1" or "zbv" (default: what the
            module's chunks imply).
        weight_grad_store: zero-bubble schedules: where the layers defer their weight GEMMs
            (megatron's ``mpu.set_weight_grad_deferral(model)``).
    """

    def __init__(self, module, optimizer, config: Dict[str, Any], lr_scheduler=None,
                 batch_fn: Optional[Callable] = None, batch_context: Optional[Callable] = None,
                 pipeline_schedule: Optional[str] = None,
                 weight_grad_store: Optional[Any] = None):
        self.module = module
        self.grid = module.mpu()  # DeepSpeed's PipelineParallelGrid of the module's topology
        self.stage_id, self.num_stages = self.grid.get_stage_id(), module.num_stages
        self.dp_group = self.grid.get_data_parallel_group()
        self.micro_batch_size, self.micro_batches = \
            _batch_sizes(config, dist.get_world_size(self.dp_group))
        self.precision = _Precision(config)
        self.device = _device()
        module.to(self.device)
        _apply_pipeline_block(module, config.get("pipeline", {}) or {})
        stage = (config.get("zero_optimization", {}) or {}).get("stage", 0)
        if stage not in (0, 1):
            raise DeepSpeedConfigError(f"DeepSpeed config: zero_optimization.stage {stage} "
                                       f"cannot be combined with pipeline parallelism; use 0 "
                                       f"or 1 (the distributed optimizer)")
        self.model = DataParallel(module, DDPConfig(use_distributed_optimizer=stage == 1),
                                  tied_weights_of(module), mpu.defer_sequence_parallel_grads(
                                      module) if mpu.model_parallel_is_initialized() else (),
                                  group=self.dp_group)
        if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
            optimizer = optimizer(module.parameters())
        self.optimizer = build_optimizer(
            optimizer, build_grad_scaler(self.precision),
            float(config.get("gradient_clipping", 0.0)), False, self.model,
            model_parallel=(self.grid.get_slice_parallel_rank(),
                            self.grid.get_model_parallel_group()))
        if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
            lr_scheduler = lr_scheduler(self.optimizer)
        self.lr_scheduler = lr_scheduler
        self.link = StageLink(self.grid.get_slice_parallel_group(), self.device)
        self.pipeline_schedule = pipeline_schedule or default_schedule(module)
        self.schedule = ScheduleStep(
            module, self.pipeline_schedule, Stage(self.stage_id, [
                self.grid.stage_to_global(s) for s in range(self.num_stages)], self.link),
            contract_of(module), batch_fn, batch_context, weight_grad_store,
            forward_context=self._autocast, grad_sync=self._backward_region)
        self.data_iterator: Optional[Iterator] = None
        self.global_steps = 0
        self._grad_norm = None

    # ------------------------------------------------------------ DeepSpeed's API
    def train_batch(self, data_iter: Optional[Iterator] = None) -> torch.Tensor:
        """One optimizer step over ``gradient_accumulation_steps`` micro-batches.

        Returns:
            the step's mean loss, averaged over data-parallel ranks, on every rank (as
            DeepSpeed's engine returns it).
        """
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        self.optimizer.zero_grad()
        gas = self.micro_batches
        with self._autocast():  # one region: each weight cast once per step
            stats = self.schedule.train(self.data_iterator, gas,
                                        lambda loss: self.optimizer.scale_loss(loss / gas))
        self.model.finish_grad_sync()
        updated, self._grad_norm = self.optimizer.step()
        if self.lr_scheduler is not None and (torch.is_tensor(updated) or updated):
            self.lr_scheduler.step()
        self.global_steps += 1
        return self._mean_loss(stats)

    def eval_batch(self, data_iter: Optional[Iterator], return_logits: bool = False,
                   compute_loss: bool = True, reduce_output: str = "avg",
                   bcast_loss: bool = True, num_micro_batches: Optional[int] = None):
        """Forward passes of ``num_micro_batches`` (default: the gradient accumulation
        steps); returns the mean loss on every rank (DeepSpeed's defaults)."""
        if return_logits or not compute_loss or reduce_output != "avg" or not bcast_loss:
            raise NotImplementedError("tds's eval_batch returns the mean loss (DeepSpeed's "
                                      "defaults: no logits, reduce_output='avg', bcast_loss)")
        self.model.finish_param_sync()
        stats = self.schedule.evaluate(data_iter, num_micro_batches or self.micro_batches)
        return self._mean_loss(stats)

    def _mean_loss(self, stats) -> torch.Tensor:
        """The loss stage's mean over micro-batches, averaged over data-parallel ranks and
        broadcast to every stage."""
        loss = torch.zeros((), device=self.device)
        if self.schedule.is_loss_rank:
            loss = torch.stack([s["lm loss"].float() for s in stats]).mean()
            if dist.get_world_size(self.dp_group) > 1:
                dist.all_reduce(loss, group=self.dp_group)
                loss = loss / dist.get_world_size(self.dp_group)
        if self.num_stages > 1:
            dist.broadcast(loss, src=self.grid.stage_to_global(self.schedule.loss_stage),
                           group=self.grid.get_pipe_parallel_group())
        return loss

    def set_dataiterator(self, iterator: Iterator) -> None:
        self.data_iterator = iterator

    def set_batch_fn(self, fn: Callable) -> None:
        self.schedule.batch_fn = fn

    def set_batch_context(self, context: Optional[Callable]) -> None:
        """``context(micro_batch) -> context manager`` around each batch-function call (the
        same micro-batch on every stage that calls it)."""
        self.schedule.batch_context = context

    def _set_contract(self, types=None, grads=None, partitioned=None):
        c = self.schedule.contract
        self.schedule.set_contract(StageContract.build(
            types if types is not None else c.types, grads if grads is not None else c.grads,
            partitioned if partitioned is not None else c.partitioned))

    def set_input_type(self, types) -> None:
        """Per position ``'float'`` / ``'int'`` / ``'bool'`` (CPM-Pretrain's setter)."""
        self._set_contract(types=types)

    def set_input_grad(self, grads) -> None:
        """Per position: whether its gradient goes back to the previous stage."""
        self._set_contract(grads=grads)

    def set_input_pipe_partitioned(self, partitioned) -> None:
        """Per position: split across tensor-parallel ranks for the send."""
        self._set_contract(partitioned=partitioned)

    def reset_activation_shape(self) -> None:
        """Learn the inter-stage shapes again before the next batch."""
        self.schedule.set_contract(self.schedule.contract)

    def is_first_stage(self) -> bool:
        return 0 in self.schedule.chunks

    def is_last_stage(self) -> bool:
        """Whether this stage computes the loss (owns the last chunk: rank 0 in a V)."""
        return self.schedule.is_loss_rank

    def gradient_accumulation_steps(self) -> int:
        return self.micro_batches

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.micro_batch_size

    def get_global_grad_norm(self):
        """The last step's gradient norm (a device tensor; None before the first step)."""
        return self._grad_norm

    def _autocast(self):
        return autocast_region(self.precision.dtype, self.device.type)

    def _backward_region(self, last: bool):
        return self.model.backward_region(last, self.precision.dtype)

    # ------------------------------------------------------------ checkpoints
    def save_checkpoint(self, save_dir: str, tag: Optional[str] = None,
                        client_state: Optional[dict] = None, save_latest: bool = True) -> bool:
        """Every rank writes its stage's module, optimizer and schedule state under
        ``save_dir/tag/`` (DeepSpeed's ``latest`` file names the tag)."""
        tag = str(tag if tag is not None else f"global_step{self.global_steps}")
        path = self._checkpoint_path(save_dir, tag)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        state = {"module": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "lr_scheduler": self.lr_scheduler.state_dict()
                 if self.lr_scheduler is not None else None,
                 "global_steps": self.global_steps, "client_state": client_state or {}}
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)
        dist.barrier()
        if save_latest and dist.get_rank() == 0:
            with open(os.path.join(save_dir, "latest"), "w", encoding="utf-8") as handle:
                handle.write(tag)
        dist.barrier()
        return True

    def load_checkpoint(self, load_dir: str, tag: Optional[str] = None,
                        load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True):
        """Restore what :meth:`save_checkpoint` wrote (same layout); returns ``(path,
        client_state)``, ``(None, None)`` when there is nothing to load."""
        if tag is None:
            latest = os.path.join(load_dir, "latest")
            if not os.path.isfile(latest):
                return None, None
            with open(latest, encoding="utf-8") as handle:
                tag = handle.read().strip()
        path = self._checkpoint_path(load_dir, tag)
        state = torch.load(path, map_location="cpu", weights_only=True)
        self.module.load_state_dict(state["module"])
        if load_optimizer_states:
            self.optimizer.load_state_dict(state["optimizer"])
        if load_lr_scheduler_states and self.lr_scheduler is not None and state["lr_scheduler"]:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.global_steps = state["global_steps"]
        return path, state["client_state"]

    def _checkpoint_path(self, root: str, tag: str) -> str:
        coord = self.module.topology().get_coord(dist.get_rank())
        name = "_".join(f"{axis}_{getattr(coord, axis):02d}" for axis in coord._fields)
        return os.path.join(root, tag, f"{name}_states.pt")


def _apply_pipeline_block(module, pipeline: Dict[str, Any]) -> None:
    """DeepSpeed's config ``pipeline`` block: ``activation_checkpoint_interval`` and
    ``use_reentrant`` (False: DeepSpeed's non-reentrant checkpoint), as its engine applies
    them to the module."""
    if pipeline.get("use_reentrant") is False:
        import deepspeed

        module.activation_checkpoint_func = deepspeed.checkpointing.non_reentrant_checkpoint
    interval = pipeline.get("activation_checkpoint_interval", 0)
    if interval and interval > 0:  # the schedule then prepares the recompute blocks
        module.activation_checkpoint_interval = interval


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")

"""The project's training step, the same at every layout.

    zero the gradient buffers
    forward and backward of every micro-batch      pp 1: a loop; pp > 1: the pipeline schedule
    finish the gradient reduction                  data x context, tied weights, sequence parallel
    optimizer step                                 loss scale, overflow skip, clipping, update
    learning-rate step

The model is wrapped in :class:`~megatron.distributed.DataParallel` (gradient buffers in
buckets, reduced over the data x context ranks; reduce-scattered with
``--use-distributed-optimizer``); the optimizer is :class:`~megatron.optimizer.
MegatronOptimizer` (or its distributed form) over fp32 master weights, fp16 / bf16 compute
through ``torch.autocast``. At pp > 1 the forward and backward passes are tds's pipeline
schedule (:class:`tds.pipe.schedule_step.ScheduleStep`: 1F1B, interleaved, ZB-H1, ZB-V), which
returns the stats of each micro-batch's loss on the rank that computes it; the rest of the
step is the same code as at pp 1.
"""
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from .. import mpu
from ..config.run_config import V_SCHEDULE, ZERO_BUBBLE_SCHEDULES, RunConfig
from ..distributed import DataParallel, DDPConfig, autocast_region, tied_weights_of
from ..optimizer.learning_rates import AnnealingLR
from ..optimizer import build_grad_scaler, build_optimizer, get_param_groups
from ..optimizer.adamw import build_adamw
from .backend import TrainingBackend
from .state_io import state_io_for


def autocast(precision: Any) -> ContextManager:
    """autocast to the compute dtype of a PrecisionConfig (a no-op in fp32)."""
    return autocast_region(precision.dtype, mpu.get_device().type)


def ddp_config(cfg: RunConfig) -> DDPConfig:
    """The gradient path the run's flags ask for."""
    p = cfg.parallel
    return DDPConfig(use_distributed_optimizer=p.use_distributed_optimizer,
                     overlap_grad_reduce=p.overlap_grad_reduce,
                     overlap_param_gather=p.overlap_param_gather,
                     bucket_size=p.ddp_bucket_size)


class StepBackend(TrainingBackend):
    """The step of the module docstring, at pp 1 (``name`` "ddp") or pp > 1 ("pipeline")."""

    def __init__(self, model: DataParallel, optimizer, lr_scheduler, cfg: RunConfig, schedule=None):
        super().__init__(model, optimizer, lr_scheduler, cfg, state_io_for(optimizer))
        self.schedule = schedule
        self.name = "pipeline" if schedule is not None else "ddp"

    @classmethod
    def build(cls, module: torch.nn.Module, cfg: RunConfig, batch_fn: Optional[Callable] = None,
              pipeline: bool = False) -> "StepBackend":
        """Wrap ``module``, build its optimizer and LR schedule (and, at pp > 1, its pipeline
        schedule fed by ``batch_fn``)."""
        sequence_parallel = mpu.defer_sequence_parallel_grads(module)
        tied = tied_weights_of(module) if pipeline else []
        model = DataParallel(module, ddp_config(cfg), tied, sequence_parallel)
        o = cfg.optim
        # fused AdamW on CUDA; fp16 needs it everywhere: it skips an overflowing step on
        # the device
        adam = build_adamw(get_param_groups([module], o.weight_decay), lr=o.lr,
                           betas=o.adam_betas, eps=o.adam_eps, weight_decay=o.weight_decay,
                           impl="fused" if cfg.precision.fp16 else "auto")
        optimizer = build_optimizer(adam, build_grad_scaler(cfg.precision), o.clip_grad,
                                    o.skip_nonfinite_steps, model)
        lr_scheduler = AnnealingLR(optimizer, o.lr, o.min_lr, o.lr_warmup_iters,
                                   o.lr_decay_iters, o.lr_decay_style)
        schedule = _pipeline_schedule(module, cfg, batch_fn, model) if pipeline else None
        return cls(model, optimizer, lr_scheduler, cfg, schedule)

    @property
    def loss_scale(self) -> Any:
        return self.optimizer.loss_scale

    def module(self) -> Any:
        self.model.finish_param_sync()  # the weights of the last step, all-gathered
        return self.model.module

    @property
    def moe(self) -> bool:
        return self.cfg.moe.enabled

    def train_step(self, forward_step_func: Callable, data_iterator: Optional[Iterator]
                   ) -> Tuple[List[Dict[str, Any]], Any, Any]:
        self.optimizer.zero_grad()
        self.model.finish_param_sync()
        if self.moe:  # the routing losses' gradients: the LM loss's 1 / gas and loss scale
            mpu.moe.set_aux_loss_scale(self.optimizer.loss_multiplier() / self.cfg.batch.gas)
        per_micro_batch = self._forward_backward(forward_step_func, data_iterator)
        self.model.finish_grad_sync()
        if self.moe:  # aux-loss-free balancing: the experts' biases follow the step's loads
            mpu.moe.update_expert_bias(self.model.module)
        updated, grad_norm = self.optimizer.step()
        # a device flag (fp16 skipped on the device) is not read here: the schedule moves on
        # and take_back_skipped_steps corrects it when the loop reads the flags (log time)
        if torch.is_tensor(updated) or updated:
            self.lr_scheduler.step()
        return per_micro_batch, updated, grad_norm

    def _forward_backward(self, forward_step_func, data_iterator):
        """Every micro-batch's forward and backward inside one autocast region: each weight
        is cast to the compute dtype once per step (autocast's weight cache), not once per
        micro-batch, and a pipeline's micro-batches in flight share that one copy."""
        gas, precision = self.cfg.batch.gas, self.cfg.precision
        with autocast(precision):
            if self.schedule is not None:
                return self.schedule.train(data_iterator, gas,
                                           lambda loss: self.optimizer.scale_loss(loss / gas))
            per_micro_batch = []
            for i in range(gas):
                with self.micro_batch(i):
                    loss, stats = forward_step_func(data_iterator, self.model)
                with self.model.backward_region(i == gas - 1, precision.dtype):
                    self.optimizer.scale_loss(loss / gas).backward()
                per_micro_batch.append(stats)
            return per_micro_batch

    def take_back_skipped_steps(self, count: int) -> None:
        if count:
            self.lr_scheduler.step(-count)

    def eval_step(self, forward_step_func: Callable,
                  data_iterator: Optional[Iterator]) -> List[Dict[str, Any]]:
        self.model.finish_param_sync()
        if self.schedule is not None:
            return self.share_stats(self.schedule.evaluate(data_iterator, self.cfg.batch.gas))
        per_micro_batch = []
        for i in range(self.cfg.batch.gas):
            with self.micro_batch(i), autocast(self.cfg.precision):
                _, stats = forward_step_func(data_iterator, self.model)
            per_micro_batch.append(stats)
        return per_micro_batch

    def routing_stats(self) -> Optional[Dict[str, torch.Tensor]]:
        """The MoE layers' routing statistics since the last call, over every rank
        (collective; None without MoE): the routing losses, tokens per expert and dropped
        tokens (megatron.mpu.moe.routing_statistics), at log time."""
        if not self.moe:
            return None
        family = self.cfg.model_family
        layers = self.cfg.model.num_layers * (family.layer_stacks if family is not None else 1)
        stats = mpu.moe.routing_statistics(self.model.module, layers)
        return mpu.moe.reduce_routing_statistics(stats)

    def share_stats(self, rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
        """Per-step (or per-micro-batch) stats, known on the rank that computes the loss,
        on every rank of its pipeline: one broadcast of their count and names and one of
        their values (called at log time and per evaluation batch, not per step). Rows the
        other ranks hold (with the keys the loss rank lacks) keep those keys. At pp 1: as
        given."""
        if self.schedule is None:
            return rows
        group = mpu.get_pipeline_model_parallel_group()
        src = mpu.get_parallel_state().pp_ranks[self.schedule.loss_stage]
        header = [(len(rows), sorted(k for k, v in rows[0].items() if torch.is_tensor(v))
                   if rows else [])] if self.schedule.is_loss_rank else [None]
        dist.broadcast_object_list(header, src=src, group=group)
        count, names = header[0]
        values = torch.empty(count, len(names), device=mpu.get_device())
        if self.schedule.is_loss_rank and count and names:
            values = torch.stack([torch.stack([r[n].detach().float().reshape(())
                                               for n in names]) for r in rows])
        if count and names:
            dist.broadcast(values, src=src, group=group)
        rows = rows if len(rows) == count else [{} for _ in range(count)]
        return [{**row, **dict(zip(names, values[i]))} for i, row in enumerate(rows)]


def _pipeline_schedule(module, cfg: RunConfig, batch_fn, model):
    """tds's pipeline schedule for this rank of the run, fed by ``batch_fn`` (each call in
    its micro-batch's seeded draws); the log names the schedule."""
    from tds.pipe import StageLink, contract_of
    from tds.pipe.schedule_step import ScheduleStep, Stage

    from ..common.utils import print_rank_0
    from .batch_draws import SeededBatchFn

    name, p = cfg.parallel.pipeline_schedule, cfg.parallel.pp
    store = mpu.set_weight_grad_deferral(module) if name in ZERO_BUBBLE_SCHEDULES else None
    chunks = f"{cfg.parallel.vpp} chunks per rank" + (" in a V" if name == V_SCHEDULE else "") \
        if cfg.parallel.vpp > 1 else "1 chunk per rank"
    split = ", backward split into input and weight passes" if store is not None else ""
    print_rank_0(f"> pipeline schedule: {name} ({p} stages, {chunks}, {cfg.batch.gas} "
                 f"micro-batches per step{split})")
    state = mpu.get_parallel_state()
    stage = Stage(state.pp_rank, state.pp_ranks,
                  StageLink(mpu.get_tensor_model_parallel_group(), mpu.get_device()))
    context = batch_fn.micro_batch if isinstance(batch_fn, SeededBatchFn) else None
    return ScheduleStep(module, name, stage, contract_of(module), batch_fn, context, store,
                        forward_context=lambda: autocast(cfg.precision),
                        grad_sync=lambda last: model.backward_region(last, cfg.precision.dtype))

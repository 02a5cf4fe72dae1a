"""tds's pipeline engine: DeepSpeed's optimizer machinery, tds's schedules, typed stage I/O.

DeepSpeed's ``PipelineEngine`` passes one tensor (or a tuple it treats with GPT-2 special
cases: the last tensor is a bool mask cast to half, only the first can be partitioned).
This engine keeps DeepSpeed's loss aggregation, tied-weight reduction, data-parallel
reduction and optimizer step, and moves every position of the tuple per the model's
contract (``_input_type`` / ``_input_grad`` / ``_input_pipe_partitioned``).

Training runs every schedule (1F1B, interleaved, ZB-H1, ZB-V: ``pipeline_schedule``) from a
checked per-rank action list through :mod:`tds.pipe.runner` (:mod:`tds.pipe.schedule_step`);
DeepSpeed's instruction schedule (``TrainSchedule``) is no longer on the training path.
Its instructions, reimplemented below for the typed tuple, still serve ``eval_batch`` of a
module with one chunk per rank (logits included) and users who drive them themselves.

Shapes are learned once, before the first step: one no-grad forward of the first
micro-batch runs through the stages exchanging only shapes and dtypes (RNG states are
restored afterwards and the batch is put back). A tuple that breaks the contract (wrong
length, wrong kind, a partitioned size that does not divide tp) is then a ValueError
naming the position on every rank, instead of a hang between two stages. After that, no
per-step metadata travels.

A module built with ``num_virtual_stages`` v > 1 (tds's ``PipelineModule``: v chunks per
rank) trains interleaved (or ZB-V with its V placement); the stage that computes the loss
is the owner of the last chunk (rank 0 in a V), which ``is_last_stage()`` then names.
"""
import itertools
from typing import Any, Iterator, Optional, Sequence

import torch
from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.pipe import schedule
from deepspeed.runtime.pipe.engine import PipelineEngine as _DeepSpeedPipelineEngine

from .. import fp16_loss_scale
from .boundary import discover_boundary
from .clip import clip_grad_norm_over_grid
from .contract import StageContract, contract_of
from .schedule_step import ScheduleStep, default_schedule
from .p2p import StageLink


class PipelineEngine(_DeepSpeedPipelineEngine):
    """DeepSpeed pipeline engine with CPM-Pretrain's typed inter-stage tuples.

    Built by ``tds.initialize()`` for a ``PipelineModule``, which must declare the contract
    attributes. ``tds.initialize(..., batch_fn=..., clip_grad_norm_fn=...)`` sets the batch
    function (raw batch -> ``(inputs, labels)``, as ``set_batch_fn``) and the gradient
    clipping (``f(parameters, max_norm) -> total norm``, clipping in place; default
    DeepSpeed's); ``pre_reduce_grads_fn`` (no arguments) runs once per step after the last
    backward, before the data-parallel gradient reduction. ``pipeline_schedule`` ("1f1b",
    "interleaved", "zb-h1", "zbv"; default: what the module's chunks imply) and, for the
    zero-bubble ones, ``weight_grad_store`` (where the model's layers defer their weight
    GEMMs: :mod:`tds.pipe.schedule_step`).
    """

    def __init__(self, *args, clip_grad_norm_fn=None, pre_reduce_grads_fn=None,
                 pipeline_schedule=None, weight_grad_store=None, **kwargs):
        model = kwargs.get("model")
        self.contract = contract_of(model)  # same attributes on every rank: all fail alike
        self.clip_grad_norm_fn = clip_grad_norm_fn
        self.pre_reduce_grads_fn = pre_reduce_grads_fn
        self._loss_stage = None  # DeepSpeed's (the last stage) while its __init__ runs
        super().__init__(*args, **kwargs)
        # Our instructions handle masks and partitioning per position: no GPT-2 hacks.
        self.has_attention_mask = self.has_bool_tensors = False
        self.is_pipe_partitioned = self.is_grad_partitioned = False
        self.link = StageLink(self.grid.get_slice_parallel_group(), self.device)
        self.recv_meta = self.send_meta = None
        self.prev_rank = self.grid.stage_to_global(self.prev_stage) if self.stage_id > 0 else None
        self.next_rank = self.grid.stage_to_global(self.next_stage) \
            if self.stage_id < self.num_stages - 1 else None
        self._warned_missing_grad = False
        self.batch_context = None  # set_batch_context
        self._loaded = 0  # micro-batches loaded by DeepSpeed's instructions (evaluation)
        _keep_gradless_blocks_out_of_checkpoints(self.module)
        # every schedule through tds.pipe.runner (schedule_step.py)
        self.pipeline_schedule = pipeline_schedule or default_schedule(self.module)
        self.schedule_step = ScheduleStep(self, self.pipeline_schedule, weight_grad_store)
        self._reserve_pipe_buffers(1)  # the last chunk's labels
        placement = self.schedule_step.placement
        self._loss_stage = placement.owner(placement.num_chunks - 1)
        # several chunks per rank: evaluation runs them in turn (schedule_step)
        self.interleaved = self.schedule_step \
            if getattr(self.module, "num_virtual_stages", 1) > 1 else None

    def is_last_stage(self) -> bool:
        """Whether this stage computes the loss (owns the last chunk: rank 0 in a V)."""
        if self._loss_stage is None:
            return super().is_last_stage()
        return self.stage_id == self._loss_stage

    def _loss_stage_global_rank(self) -> int:
        if self._loss_stage is None:
            return super()._loss_stage_global_rank()
        return self.grid.stage_to_global(self._loss_stage)

    # DeepSpeed builds the receive buffers of its loss broadcasts from host data
    # (``torch.Tensor([0.] * n).to(device)``): on a GPU a copy from pageable memory, which
    # waits, every step. Here they are made on the device.
    def _aggregate_total_loss(self) -> torch.Tensor:
        """DeepSpeed's loss aggregation; a stage without the loss receives into a device
        buffer."""
        if self.is_last_stage():
            return super()._aggregate_total_loss()
        additional = self.module.get_additional_losses()
        names = [] if additional is None else list(additional.keys())
        losses = torch.zeros(2 + len(names), device=self.device)
        torch.distributed.broadcast(losses, src=self._loss_stage_global_rank(),
                                    group=self.grid.get_pipe_parallel_group())
        self.dp_group_loss = losses[0].clone().detach()
        if additional is not None:
            self.agg_additional_losses = {name: losses[2 + i].clone().detach()
                                          for i, name in enumerate(names)}
        return losses[1].clone().detach()

    def _bcast_pipe_scalar(self, data, src_rank=None, dtype=torch.float32):
        """DeepSpeed's evaluation-loss broadcast, received into a device buffer."""
        if src_rank is None:
            src_rank = self._loss_stage_global_rank()
        if self.global_rank == src_rank:
            return super()._bcast_pipe_scalar(data, src_rank, dtype)
        result = torch.zeros(1, dtype=dtype, device=self.device)
        torch.distributed.broadcast(result, src=src_rank,
                                    group=self.mpu.get_pipe_parallel_group())  # as DeepSpeed
        return result

    # ------------------------------------------------------------ CPM-Pretrain setters
    def _set_contract(self, types=None, grads=None, partitioned=None):
        c = self.contract
        self.contract = StageContract.build(types if types is not None else c.types,
                                            grads if grads is not None else c.grads,
                                            partitioned if partitioned is not None
                                            else c.partitioned)
        self.reset_activation_shape()

    def set_input_type(self, types: Sequence[str]) -> None:
        """Per position ``'float'`` / ``'int'`` / ``'bool'``."""
        self._set_contract(types=types)

    def set_input_grad(self, grads: Sequence[bool]) -> None:
        """Per position: whether its gradient goes back to the previous stage."""
        self._set_contract(grads=grads)

    def set_input_pipe_partitioned(self, partitioned: Sequence[bool]) -> None:
        """Per position: split across tensor-parallel ranks for the send."""
        self._set_contract(partitioned=partitioned)

    def set_batch_context(self, context: Optional[Any]) -> None:
        """``context(micro_batch) -> context manager`` around each batch-function call.

        Every stage that calls the batch function (the first for the inputs, the last for
        the labels, a V's rank 0 once for both) calls it for micro-batch ``micro_batch``
        (0 .. gas - 1, in the step's order) inside ``context(micro_batch)``, the shape probe
        included (as micro-batch 0). Megatron seeds torch's generators there from the run's
        seed, the iteration and the micro-batch, so a batch function that draws (a masking
        collator) draws the same batch on every stage. None: called as is.
        """
        self.batch_context = context

    def _next_batch(self, micro_batch: Optional[int] = None) -> Any:
        """The next raw batch through the batch function (DeepSpeed's, plus the micro-batch
        the call is for: :meth:`set_batch_context`)."""
        raw = next(self.data_iterator) if self.data_iterator is not None else None
        return self._apply_batch_fn(raw, micro_batch)

    def _apply_batch_fn(self, raw: Any, micro_batch: Optional[int]) -> Any:
        if not self.batch_fn:
            return raw
        if self.batch_context is None or micro_batch is None:
            return self.batch_fn(raw)
        with self.batch_context(micro_batch):
            return self.batch_fn(raw)

    def reset_activation_shape(self) -> None:
        super().reset_activation_shape()
        self.recv_meta = self.send_meta = None
        if getattr(self, "schedule_step", None) is not None:
            self.schedule_step.boundaries = self.schedule_step.runner = None

    # ------------------------------------------------------------ entry points
    def _ensure_boundary(self):
        if self.num_stages > 1 and self.recv_meta is None and self.send_meta is None:
            self.recv_meta, self.send_meta = discover_boundary(self)

    def _peek_first_batch(self):
        """The first micro-batch's inputs (first stage), putting the raw batch back."""
        raw = None
        if self.data_iterator is not None:
            raw = next(self.data_iterator)
            self.data_iterator = itertools.chain([raw], self.data_iterator)
        batch = self._apply_batch_fn(raw, 0)
        return self._to_device_inputs(batch[0])

    def train_batch(self, data_iter: Optional[Iterator] = None) -> torch.Tensor:
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        return self.schedule_step.train_batch()

    def eval_batch(self, data_iter: Optional[Iterator], *args: Any, **kwargs: Any) -> Any:
        if self.interleaved is not None:
            return self._interleaved_eval(data_iter, *args, **kwargs)
        if getattr(self.module, "chunk_regions", None) is not None and not args and \
                not kwargs:  # compiled chunks: the mean loss through their eval regions
            return self._interleaved_eval(data_iter)
        if self.num_stages > 1 and self.recv_meta is None and self.send_meta is None:
            train_iterator = self.data_iterator
            self.set_dataiterator(data_iter)
            self._ensure_boundary()
            data_iter = self.data_iterator  # the peeked batch is back in front
            self.set_dataiterator(train_iterator)
        self._loaded = 0
        return super().eval_batch(data_iter, *args, **kwargs)

    def _interleaved_eval(self, data_iter, return_logits=False, compute_loss=True,
                          reduce_output="avg", bcast_loss=True, num_micro_batches=None):
        """``eval_batch`` with virtual stages: the mean loss only (no logits)."""
        if return_logits or not compute_loss or reduce_output != "avg" or not bcast_loss:
            raise NotImplementedError("eval_batch with virtual pipeline stages returns the "
                                      "mean loss only (the defaults)")
        train_iterator = self.data_iterator
        self.set_dataiterator(data_iter)
        try:
            self._compute_loss = True
            return self.schedule_step.eval_batch(num_micro_batches or self.micro_batches)
        finally:
            self.set_dataiterator(train_iterator)

    # ------------------------------------------------------------ instructions
    def _to_device_inputs(self, inputs):
        def move(t):
            t = t.to(self.device)
            if self._reentrant_activation_checkpointing() and t.is_floating_point():
                t = t.detach().requires_grad_()
            return t

        if torch.is_tensor(inputs):
            return move(inputs)
        return tuple(move(t) for t in inputs)

    def _exec_load_micro_batch(self, buffer_id):
        # DeepSpeed's instructions load micro-batches in order on the first and last stage
        batch = self._next_batch(self._loaded)
        self._loaded += 1
        if self.is_first_stage():
            self.pipe_buffers["inputs"][buffer_id] = self._to_device_inputs(batch[0])
        if self.is_last_stage():
            labels = batch[1]
            self.pipe_buffers["labels"][buffer_id] = labels.to(self.device) \
                if torch.is_tensor(labels) else tuple(t.to(self.device) for t in labels)

    def _exec_forward_pass(self, buffer_id):
        self.tput_timer.start()
        outputs = DeepSpeedEngine.forward(self, self.pipe_buffers["inputs"][buffer_id])
        if not self.module.training and \
                _unwrapped(self.module.activation_checkpoint_func) is ds_checkpointing.checkpoint:
            ds_checkpointing.reset()
        if self.is_last_stage():
            self._record_loss(outputs, buffer_id)
        else:
            self.pipe_buffers["outputs"][buffer_id] = outputs

    def _record_loss(self, outputs, buffer_id, loss=None):
        """Last stage: loss of this micro-batch, and running totals (DeepSpeed's bookkeeping).

        ``loss``: already computed (a compiled chunk whose region ends with the loss; then
        ``outputs`` is None)."""
        if self.eval_return_logits:  # a copy: a loss may overwrite its logits (in place)
            self.outputs = outputs.detach().clone() if torch.is_tensor(outputs) else \
                type(outputs)(x.detach().clone() for x in outputs)
        if loss is not None:
            self.loss = loss
        elif self._compute_loss and self.module.loss_fn is not None:
            self.loss = self.module.loss_fn(outputs, self.pipe_buffers["labels"][buffer_id])
        else:
            self.loss = outputs
        detached = self.loss.detach() if torch.is_tensor(self.loss) else \
            [x.detach() for x in self.loss]
        self.fwd_outputs.append(detached)
        self.total_loss = _accumulate(self.total_loss, detached)
        extra = self.module.get_additional_losses()
        if extra is not None:
            totals = self.total_additional_losses or {}
            for name, value in extra.items():
                totals[name] = _accumulate(totals.get(name), value.detach())
            self.total_additional_losses = totals

    def _exec_backward_pass(self, buffer_id):
        if self.is_last_stage():
            fp16_loss_scale.backward(self, self.loss)  # DeepSpeed's, with the fp16 scale
            return
        outputs = self.pipe_buffers["outputs"][buffer_id]
        grad_positions = [i for i, g in enumerate(self.contract.grads) if g]
        tensors = [outputs[i] for i in grad_positions]
        if self.using_bf16_optimizer:
            self.optimizer.clear_lp_grads()
        self._running_engine_backward = True
        try:
            torch.autograd.backward(tensors, grad_tensors=self.grad_layer)
        finally:
            self._running_engine_backward = False
        if self.using_bf16_optimizer and not self._config.bfloat16_config.immediate_grad_update:
            self.optimizer.update_hp_grads(clear_lp_grads=False)
        self.pipe_buffers["outputs"][buffer_id] = None
        self.grad_layer = None

    def _exec_send_activations(self, buffer_id):
        outputs = self.pipe_buffers["outputs"][buffer_id]
        self.contract.check_shapes(outputs, self.send_meta,
                                   f"pipeline stage {self.stage_id} output")
        for pos, tensor in enumerate(outputs):
            self.link.send(tensor, self.next_rank, self.contract.partitioned[pos])

    def _exec_recv_activations(self, buffer_id):
        received = []
        for pos, (shape, dtype) in enumerate(self.recv_meta):
            tensor = self.link.recv(shape, dtype, self.prev_rank, self.contract.partitioned[pos])
            received.append(tensor.requires_grad_(self.contract.grads[pos]))
        self.pipe_buffers["inputs"][buffer_id] = tuple(received)

    def _exec_send_grads(self, buffer_id):
        inputs = self.pipe_buffers["inputs"][buffer_id]
        for pos, tensor in enumerate(inputs):
            if not self.contract.grads[pos]:
                continue
            grad = tensor.grad
            if grad is None:  # the stage did not use this input: its gradient is zero
                grad = torch.zeros_like(tensor)
                self._warn_missing_grad(pos)
            self.link.send(grad, self.prev_rank, self.contract.partitioned[pos])
        self.pipe_buffers["inputs"][buffer_id] = None

    def _exec_recv_grads(self, buffer_id):
        self.grad_layer = [
            self.link.recv(shape, dtype, self.next_rank, self.contract.partitioned[pos])
            for pos, (shape, dtype) in enumerate(self.send_meta) if self.contract.grads[pos]]

    def _warn_missing_grad(self, pos):
        if not self._warned_missing_grad:
            self._warned_missing_grad = True
            print(f"WARNING: tds stage {self.stage_id}: input position {pos} is marked "
                  f"_input_grad but got no gradient; sending zeros", flush=True)

    # ------------------------------------------------------------ gradient clipping
    def clip_fp32_gradients(self) -> Any:
        """The caller's clip (megatron passes mpu.clip_grad_norm_tensor), else
        :func:`~tds.pipe.clip.clip_grad_norm_over_grid`: each parameter counted once across
        tp and pp, tied copies too, so the norm is the serial model's at any layout.

        DeepSpeed's own fp32 clip counts replicated parameters only on pipeline stage 0 and
        the tied embedding on both stages, so its norm is wrong once pp > 1.
        """
        clip = self.clip_grad_norm_fn or \
            (lambda params, max_norm: clip_grad_norm_over_grid(params, max_norm, self.grid))
        self._global_grad_norm = clip(self.module.parameters(), self.gradient_clipping())

    def _exec_reduce_grads(self):
        """The caller's gradient work of the step (``pre_reduce_grads_fn``: megatron sums
        its sequence-parallel gradients over tp in one call), then DeepSpeed's reduction."""
        if self.pre_reduce_grads_fn is not None:
            self.pre_reduce_grads_fn()
        super()._exec_reduce_grads()

    _INSTRUCTION_MAP = {
        schedule.OptimizerStep: _DeepSpeedPipelineEngine._exec_optimizer_step,
        schedule.ReduceGrads: _exec_reduce_grads,
        schedule.ReduceTiedGrads: _DeepSpeedPipelineEngine._exec_reduce_tied_grads,
        schedule.LoadMicroBatch: _exec_load_micro_batch,
        schedule.ForwardPass: _exec_forward_pass,
        schedule.BackwardPass: _exec_backward_pass,
        schedule.SendActivation: _exec_send_activations,
        schedule.RecvActivation: _exec_recv_activations,
        schedule.SendGrad: _exec_send_grads,
        schedule.RecvGrad: _exec_recv_grads,
    }


def _unwrapped(func):
    return getattr(func, "_tds_wraps", func)


def _keep_gradless_blocks_out_of_checkpoints(module):
    """Run a block none of whose inputs needs a gradient without the reentrant checkpoint.

    A reentrant checkpoint's output requires grad only if an input does, so a first block
    fed token ids and masks (an embedding) would get no parameter gradients. DeepSpeed 0.19
    skips such blocks only for classes named ``GPT2ModelPipe`` / ``GPTModelPipe`` (or with
    ``checkpointable_layers``); CPM-1's ``T5ModelPipe`` is neither. Such a block is cheap
    (the embedding) and holds no activation worth recomputing.
    """
    func = module.activation_checkpoint_func
    if func is not ds_checkpointing.checkpoint:  # non-reentrant, a user's, or wrapped already
        return

    def checkpoint(function, *args):
        if torch.is_grad_enabled() and not any(torch.is_tensor(a) and a.requires_grad
                                               for a in args):
            return function(*args)
        return func(function, *args)

    checkpoint._tds_wraps = func
    module.activation_checkpoint_func = checkpoint


def _accumulate(total, value):
    if torch.is_tensor(value):
        return value.clone() if total is None else total + value
    if total is None:
        return [v.clone() for v in value]
    return [t + v for t, v in zip(total, value)]


"""Training and evaluation steps of a pipeline with virtual stages (v chunks per rank).

The pipeline engine hands a module built with ``num_virtual_stages`` v > 1 to
:class:`InterleavedStep`: one step is Megatron-LM's interleaved 1F1B
(``schedules.interleaved_1f1b``) run by :class:`~tds.pipe.runner.ScheduleRunner`, whose
callbacks are this class's methods, followed by DeepSpeed's tied-gradient reduction,
data-parallel reduction (ZeRO-1 included) and optimizer step, then DeepSpeed's loss
aggregation; so the loss, the loss scaling by gradient-accumulation steps and the update
are the engine's own, only the order of the micro-batch passes changes.

Before the first step the boundaries are learned chunk by chunk (:func:`probe_chunks`):
chunk 0's owner runs the first micro-batch forward (no grad, eval mode, generators
restored), sends a shape header to the owner of chunk 1, and so on through all p v chunks;
a contract violation raises the same ValueError on every rank.

Evaluation runs each micro-batch through the p v chunks in turn (forward only).
"""
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .. import fp16_loss_scale
from .boundary import _ERROR, HEADER_SIZE, _decode, _encode, _side_effect_free
from .runner import Boundary, ScheduleRunner, StageCallbacks
from .schedules import interleaved_1f1b


def probe_chunks(engine, first_inputs) -> List[Boundary]:
    """Learn every chunk boundary's (shape, dtype) per position (collective over the job).

    Args:
        engine: the pipeline engine (its module has virtual stages).
        first_inputs: chunk 0's inputs for the first micro-batch (on the first stage; None
            elsewhere).

    Returns:
        the ``Boundary`` after each chunk c = 0 .. p v - 2 of this rank's pipeline.

    Raises:
        ValueError: on every rank, naming the chunk and the first rank that failed.
    """
    module, p = engine.module, engine.num_stages
    num_chunks = p * module.num_virtual_stages
    ranks = [engine.grid.stage_to_global(s) for s in range(p)]
    sent, error = {}, None
    for j, chunk in enumerate(module.local_chunks()):
        try:
            inputs = first_inputs if chunk == 0 else _recv_inputs(engine, ranks[(chunk - 1) % p])
            if error is None and inputs is not None:
                with _side_effect_free(module):
                    outputs = module.forward_chunk(j, inputs)
                if chunk < num_chunks - 1:
                    engine.contract.check_tensors(outputs, engine.link.tp_size,
                                                  f"pipeline chunk {chunk} output")
                    sent[chunk] = tuple((tuple(t.shape), t.dtype) for t in outputs)
                    dist.send(_encode(outputs).to(engine.device), ranks[(chunk + 1) % p])
                    continue
        except Exception as exc:  # downstream chunks must not wait forever
            error = error or exc
        if chunk < num_chunks - 1 and chunk not in sent:
            bad = torch.zeros(HEADER_SIZE, dtype=torch.long, device=engine.device)
            bad[0] = _ERROR
            dist.send(bad, ranks[(chunk + 1) % p])
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, (str(error) if error else None, sent))
    first = next(((rank, r[0]) for rank, r in enumerate(reports) if r[0]), None)
    if first is not None:
        raise ValueError(f"{first[1]} (found on rank {first[0]})")
    meta = {}
    for rank in ranks:
        meta.update(reports[rank][1])
    return [Boundary(engine.contract, meta[c]) for c in range(num_chunks - 1)]


def _recv_inputs(engine, src):
    """Zero inputs of the shapes the previous chunk announced, or None after an error."""
    header = torch.empty(HEADER_SIZE, dtype=torch.long, device=engine.device)
    dist.recv(header, src)
    meta = _decode(header.cpu())
    if meta is None:
        return None
    return tuple(torch.zeros(shape, dtype=dtype, device=engine.device) for shape, dtype in meta)


class InterleavedStep(StageCallbacks):
    """The runner's callbacks for one pipeline engine with virtual stages.

    Args:
        engine: tds's ``PipelineEngine`` (its module built with ``num_virtual_stages`` > 1).
    """

    def __init__(self, engine):
        self.engine = engine
        self.module = engine.module
        self.pp_size = engine.num_stages
        self.vpp_size = self.module.num_virtual_stages
        self.num_chunks = self.pp_size * self.vpp_size
        self.stage_ranks = [engine.grid.stage_to_global(s) for s in range(self.pp_size)]
        self.boundaries: Optional[List[Boundary]] = None
        self.runner: Optional[ScheduleRunner] = None
        self.runner_mbs = 0
        self.saved: Dict[Tuple[int, int], tuple] = {}

    # ------------------------------------------------------------ setup
    def ensure_boundaries(self) -> None:
        if self.boundaries is None:
            first = self.engine._peek_first_batch() if self.engine.is_first_stage() else None
            self.boundaries = probe_chunks(self.engine, first)

    def _runner(self, num_micro_batches: int) -> ScheduleRunner:
        if self.runner is None or self.runner_mbs != num_micro_batches:
            schedule = interleaved_1f1b(self.pp_size, self.vpp_size, num_micro_batches)
            self.runner = ScheduleRunner(schedule, self.vpp_size, num_micro_batches,
                                         self.stage_ranks, self.engine.link, self.boundaries)
            self.runner_mbs = num_micro_batches
        return self.runner

    # ------------------------------------------------------------ steps
    def train_batch(self) -> torch.Tensor:
        """One optimizer step over ``gradient_accumulation_steps`` micro-batches.

        Returns:
            the mean loss of the step (DeepSpeed's aggregation, on every rank).
        """
        e = self.engine
        if not torch.is_grad_enabled():
            raise RuntimeError("train_batch() requires gradients enabled; use eval_batch()")
        self.ensure_boundaries()
        e.module.train()
        e.total_loss = e.total_additional_losses = None
        e._compute_loss = True
        e.fwd_outputs = []
        self.saved = {}
        self._runner(e.micro_batches).run(self)
        e._exec_reduce_tied_grads()
        e._exec_reduce_grads()
        e._exec_optimizer_step()
        with torch.no_grad():
            e.agg_train_loss = e._aggregate_total_loss()
        return e.agg_train_loss

    def eval_batch(self, num_micro_batches: int) -> torch.Tensor:
        """Forward passes of ``num_micro_batches``: each through the p v chunks in turn.

        Returns:
            the mean loss (on every rank of the pipeline).
        """
        e = self.engine
        self.ensure_boundaries()
        e.module.eval()
        e.fwd_outputs, e.total_loss = [], None
        last = self.num_chunks - 1
        with torch.no_grad():
            for mb in range(num_micro_batches):
                for chunk in self.module.local_chunks():
                    inputs = self.load(mb) if chunk == 0 else self._recv_activation(chunk - 1)
                    outputs = self._run_chunk(chunk, inputs, mb)
                    if chunk < last:
                        peer = self.stage_ranks[(chunk + 1) % self.pp_size]
                        for pos, tensor in enumerate(outputs):
                            e.link.send(tensor, peer, self.boundaries[chunk].contract
                                        .partitioned[pos])
        output = e._reduce_outputs(e.fwd_outputs, reduce="avg",
                                   micro_batches=num_micro_batches) \
            if e.is_last_stage() else None
        return e._bcast_pipe_scalar(output)

    def _recv_activation(self, chunk: int):
        boundary, peer = self.boundaries[chunk], self.stage_ranks[chunk % self.pp_size]
        return tuple(self.engine.link.recv(shape, dtype, peer, boundary.contract.partitioned[pos])
                     for pos, (shape, dtype) in enumerate(boundary.meta))

    # ------------------------------------------------------------ runner callbacks
    def load(self, mb: int):
        """Chunk 0's inputs (rank 0; its batch function reads the next micro-batch)."""
        return self.engine._to_device_inputs(self.engine._next_batch()[0])

    def _run_chunk(self, chunk: int, inputs, mb: int):
        e = self.engine
        e.tput_timer.start()
        outputs = self.module.forward_chunk(chunk // self.pp_size, inputs)
        if chunk == self.num_chunks - 1:  # labels in call order: the order of load()'s
            # inputs (schedule_check.check_micro_batch_order proves it before any step)
            labels = e._next_batch()[1]
            labels = labels.to(e.device) if torch.is_tensor(labels) else \
                tuple(t.to(e.device) for t in labels)
            e.pipe_buffers["labels"][0] = labels
            e._record_loss(outputs, 0)
            return e.loss
        return outputs

    def forward(self, chunk: int, mb: int, inputs):
        outputs = self._run_chunk(chunk, inputs, mb)
        self.saved[(chunk, mb)] = (inputs, outputs)
        return outputs

    def backward(self, chunk: int, mb: int, output_grads):
        e = self.engine
        inputs, outputs = self.saved.pop((chunk, mb))
        if chunk == self.num_chunks - 1:
            if e.using_bf16_optimizer:  # the forward hooks that would clear them are not
                e.optimizer.clear_lp_grads()  # registered: chunks bypass engine.forward
            fp16_loss_scale.backward(e, outputs)  # the loss: gas and fp16 scaling as 1F1B
        else:
            pairs = [(t, g) for t, g in zip(outputs, output_grads)
                     if g is not None and t.requires_grad]
            if e.using_bf16_optimizer:
                e.optimizer.clear_lp_grads()
            e._running_engine_backward = True
            try:
                torch.autograd.backward([t for t, _ in pairs], grad_tensors=[g for _, g in pairs])
            finally:
                e._running_engine_backward = False
            if e.using_bf16_optimizer and not e._config.bfloat16_config.immediate_grad_update:
                e.optimizer.update_hp_grads(clear_lp_grads=False)
        if chunk == 0:
            return None
        return tuple(t.grad if t.is_floating_point() and t.requires_grad else None
                     for t in inputs)

"""Training and evaluation steps of tds's pipeline engine, for every schedule.

One step is the schedule's per-rank action list (``schedules.build_schedule``: 1F1B,
interleaved 1F1B, ZB-H1 or ZB-V) run by :class:`~tds.pipe.runner.ScheduleRunner`, whose
callbacks are :class:`ScheduleStep`'s methods, followed by DeepSpeed's tied-gradient
reduction, data-parallel reduction (ZeRO-1 included) and optimizer step, then the loss
aggregation; so the loss, the loss scaling by gradient-accumulation steps and the update
are the engine's own, only the order of the micro-batch passes changes.

Zero-bubble schedules split each backward into ``BackwardInput`` (what the previous chunk
waits for) and ``BackwardWeight``: the input pass runs inside ``weight_grad_store.record(
(chunk, mb))``, where layers that can defer their weight-gradient GEMM (megatron's mpu
linear layers with ``set_weight_grad_deferral``) leave it in the store, and the weight pass
runs ``weight_grad_store.flush((chunk, mb))``. Without a store the input pass computes
every gradient and the weight pass does nothing (correct, no gain).

Before the first step the boundaries are learned chunk by chunk (:func:`probe_chunks`):
chunk 0's owner runs the first micro-batch forward (no grad, eval mode, generators
restored), sends a shape header to the owner of chunk 1 (or hands it on locally where the
same rank holds both, the turn of a V), and so on through all chunks; a contract violation
raises the same ValueError on every rank.

Evaluation runs each micro-batch through the chunks in turn (forward only).
"""
import contextlib
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .. import fp16_loss_scale
from .boundary import _ERROR, HEADER_SIZE, _decode, _encode, _side_effect_free
from .runner import Boundary, ScheduleRunner, StageCallbacks
from .schedules import Placement, build_schedule

ZERO_BUBBLE = ("zb-h1", "zbv")


def module_placement(module, pp_size: int) -> Placement:
    """The module's chunk placement: tds's ``PipelineModule`` says; DeepSpeed's own (CPM-1's
    models are built on it) holds one chunk per stage."""
    placement = getattr(module, "placement", None)
    return placement if isinstance(placement, Placement) else Placement.loop(pp_size)


def run_chunk(module, j: int, inputs):
    """Local chunk ``j`` of ``module`` on ``inputs`` (DeepSpeed's module: its forward)."""
    forward_chunk = getattr(module, "forward_chunk", None)
    return forward_chunk(j, inputs) if callable(forward_chunk) else module(inputs)


def default_schedule(module) -> str:
    """The schedule a module's chunk layout implies: zbv (V placement), interleaved (v > 1)
    or 1f1b."""
    if getattr(module, "placement_kind", "loop") == "v":
        return "zbv"
    return "interleaved" if getattr(module, "num_virtual_stages", 1) > 1 else "1f1b"


def probe_chunks(engine, first_inputs) -> List[Boundary]:
    """Learn every chunk boundary's (shape, dtype) per position (collective over the job).

    Args:
        engine: the pipeline engine.
        first_inputs: chunk 0's inputs for the first micro-batch (on the first stage; None
            elsewhere).

    Returns:
        the ``Boundary`` after each chunk c = 0 .. num_chunks - 2 of this rank's pipeline.

    Raises:
        ValueError: on every rank, naming the chunk and the first rank that failed.
    """
    module, placement = engine.module, module_placement(engine.module, engine.num_stages)
    num_chunks = placement.num_chunks
    ranks = [engine.grid.stage_to_global(s) for s in range(engine.num_stages)]
    sent, error, handed = {}, None, None
    for j, chunk in enumerate(placement.chunks(engine.stage_id)):
        try:
            if chunk == 0:
                inputs = first_inputs
            elif placement.is_local(chunk - 1):
                inputs = handed
            else:
                inputs = _recv_inputs(engine, ranks[placement.owner(chunk - 1)])
            handed = None
            if error is None and inputs is not None:
                with _side_effect_free(module):
                    outputs = run_chunk(module, j, inputs)
                if chunk < num_chunks - 1:
                    engine.contract.check_tensors(outputs, engine.link.tp_size,
                                                  f"pipeline chunk {chunk} output")
                    sent[chunk] = tuple((tuple(t.shape), t.dtype) for t in outputs)
                    if placement.is_local(chunk):  # the same rank runs chunk + 1 next
                        handed = outputs
                    else:
                        dist.send(_encode(outputs).to(engine.device),
                                  ranks[placement.owner(chunk + 1)])
                    continue
        except Exception as exc:  # downstream chunks must not wait forever
            error = error or exc
        if chunk < num_chunks - 1 and chunk not in sent and not placement.is_local(chunk):
            bad = torch.zeros(HEADER_SIZE, dtype=torch.long, device=engine.device)
            bad[0] = _ERROR
            dist.send(bad, ranks[placement.owner(chunk + 1)])
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


class ScheduleStep(StageCallbacks):
    """The runner's callbacks for one pipeline engine, and its train / eval steps.

    Args:
        engine: tds's ``PipelineEngine``.
        schedule: "1f1b", "interleaved", "zb-h1" or "zbv" (must fit the module's chunks:
            ``schedules.build_schedule`` says why not).
        weight_grad_store: zero-bubble schedules: the store the model's deferring layers
            record their weight-gradient work in (``record(key)``, ``flush(key)``,
            ``check_flushed(where=...)``); None: the input pass computes every gradient.
    """

    def __init__(self, engine, schedule: str, weight_grad_store=None):
        self.engine = engine
        self.module = engine.module
        self.placement = module_placement(self.module, engine.num_stages)
        self.pp_size, self.vpp_size = self.placement.pp_size, self.placement.vpp_size
        self.num_chunks = self.placement.num_chunks
        self.schedule = schedule
        _, placement = build_schedule(schedule, self.pp_size, self.vpp_size, 1)
        if placement != self.placement:
            raise ValueError(f"pipeline schedule {schedule} places the chunks as "
                             f"{placement.kind!r}, but the module was built with placement "
                             f"{self.placement.kind!r}; build the PipelineModule with "
                             f"placement={placement.kind!r}")
        self.store = weight_grad_store if schedule in ZERO_BUBBLE else None
        self.stage_ranks = [engine.grid.stage_to_global(s) for s in range(self.pp_size)]
        chunks = self.chunks = self.placement.chunks(engine.stage_id)
        self.local_index = {chunk: j for j, chunk in enumerate(chunks)}
        # the rank that loads a micro-batch also computes its loss (a V): keep its labels
        self.keeps_labels = 0 in chunks and self.num_chunks - 1 in chunks
        self.labels: Dict[int, object] = {}
        self.boundaries: Optional[List[Boundary]] = None
        self.runner: Optional[ScheduleRunner] = None
        self.runner_mbs = 0
        self.saved: Dict[Tuple[int, int], tuple] = {}
        # (chunk, mb) forwarded and not yet through its (weight) backward: its peak per step
        self.in_flight: set = set()
        self.peak_in_flight = 0
        self.deferred_gemms = 0  # weight-gradient GEMMs the weight passes ran, per step
        self._warned_empty = False

    # ------------------------------------------------------------ setup
    def ensure_boundaries(self) -> None:
        if self.boundaries is None:
            first = self.engine._peek_first_batch() if self.engine.is_first_stage() else None
            self.boundaries = probe_chunks(self.engine, first)

    def _runner(self, num_micro_batches: int) -> ScheduleRunner:
        if self.runner is None or self.runner_mbs != num_micro_batches:
            actions, placement = build_schedule(self.schedule, self.pp_size, self.vpp_size,
                                                num_micro_batches)
            self.runner = ScheduleRunner(actions, self.vpp_size, num_micro_batches,
                                         self.stage_ranks, self.engine.link, self.boundaries,
                                         placement=placement)
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
        self.saved, self.labels, self.in_flight, self.peak_in_flight = {}, {}, set(), 0
        self.deferred_gemms = 0
        self._runner(e.micro_batches).run(self)
        if self.store is not None:
            self.store.check_flushed(where=f"the end of a {self.schedule} step")
        self._warn_if_nothing_deferred()
        e._exec_reduce_tied_grads()
        e._exec_reduce_grads()
        e._exec_optimizer_step()
        with torch.no_grad():
            e.agg_train_loss = e._aggregate_total_loss()
        return e.agg_train_loss

    def eval_batch(self, num_micro_batches: int) -> torch.Tensor:
        """Forward passes of ``num_micro_batches``: each through the chunks in turn.

        Returns:
            the mean loss (on every rank of the pipeline).
        """
        e = self.engine
        self.ensure_boundaries()
        e.module.eval()
        e.fwd_outputs, e.total_loss, self.labels = [], None, {}
        last = self.num_chunks - 1
        with torch.no_grad():
            for mb in range(num_micro_batches):
                handed = None
                for chunk in self.chunks:
                    if chunk == 0:
                        inputs = self.load(mb)
                    elif self.placement.is_local(chunk - 1):
                        inputs = handed
                    else:
                        inputs = self._recv_activation(chunk - 1)
                    outputs = self._run_chunk(chunk, inputs, mb)
                    if chunk < last and self.placement.is_local(chunk):
                        handed = outputs
                    elif chunk < last:
                        peer = self.stage_ranks[self.placement.owner(chunk + 1)]
                        for pos, tensor in enumerate(outputs):
                            e.link.send(tensor, peer, self.boundaries[chunk].contract
                                        .partitioned[pos])
        output = e._reduce_outputs(e.fwd_outputs, reduce="avg",
                                   micro_batches=num_micro_batches) \
            if e.is_last_stage() else None
        return e._bcast_pipe_scalar(output)

    def _recv_activation(self, chunk: int):
        boundary = self.boundaries[chunk]
        peer = self.stage_ranks[self.placement.owner(chunk)]
        return tuple(self.engine.link.recv(shape, dtype, peer, boundary.contract.partitioned[pos])
                     for pos, (shape, dtype) in enumerate(boundary.meta))

    # ------------------------------------------------------------ runner callbacks
    def load(self, mb: int):
        """Chunk 0's inputs (its batch function reads the next micro-batch)."""
        inputs, labels = self.engine._next_batch(mb)
        if self.keeps_labels:
            self.labels[mb] = labels
        return self.engine._to_device_inputs(inputs)

    def _run_chunk(self, chunk: int, inputs, mb: int):
        e = self.engine
        e.tput_timer.start()
        j = self.local_index[chunk]
        regions = getattr(self.module, "chunk_regions", None)
        if chunk < self.num_chunks - 1:
            if regions is not None:  # one compiled region (tds/pipe/compiled.py)
                return regions.run(j, inputs, training=self.module.training)
            return run_chunk(self.module, j, inputs)
        labels = self._labels(mb)
        e.pipe_buffers["labels"][0] = labels
        if regions is not None and regions.has_loss(j) and e._compute_loss and \
                not e.eval_return_logits:  # the loss inside the chunk's region
            e._record_loss(None, 0, loss=regions.run(j, inputs, labels, self.module.training))
        else:
            e._record_loss(run_chunk(self.module, j, inputs), 0)
        return e.loss

    def _labels(self, mb: int):
        """The last chunk's labels of micro-batch ``mb``, on the device: kept by load() where
        this rank loads too, else read in call order, the order of load()'s inputs
        (schedule_check proves it before any step)."""
        e = self.engine
        labels = self.labels.pop(mb) if self.keeps_labels else e._next_batch(mb)[1]
        return labels.to(e.device) if torch.is_tensor(labels) else \
            tuple(t.to(e.device) for t in labels)

    def forward(self, chunk: int, mb: int, inputs):
        outputs = self._run_chunk(chunk, inputs, mb)
        self.saved[(chunk, mb)] = (inputs, outputs)
        self.in_flight.add((chunk, mb))
        self.peak_in_flight = max(self.peak_in_flight, len(self.in_flight))
        return outputs

    def backward(self, chunk: int, mb: int, output_grads):
        """Input and weight gradients of (chunk, mb)."""
        self.in_flight.discard((chunk, mb))
        return self._backward(chunk, mb, output_grads)

    def _backward(self, chunk: int, mb: int, output_grads):
        e = self.engine
        inputs, outputs = self.saved.pop((chunk, mb))
        if e.using_bf16_optimizer:  # the forward hooks that would clear them are not
            e.optimizer.clear_lp_grads()  # registered: chunks bypass engine.forward
        if chunk == self.num_chunks - 1:  # the loss: gas and fp16 scaling as 1F1B; bf16:
            fp16_loss_scale.backward(e, outputs)  # DeepSpeed's backward moves the grads
        else:
            pairs = [(t, g) for t, g in zip(outputs, output_grads)
                     if g is not None and t.requires_grad]
            e._running_engine_backward = True
            try:
                torch.autograd.backward([t for t, _ in pairs], grad_tensors=[g for _, g in pairs])
            finally:
                e._running_engine_backward = False
            self._bf16_grads_to_master()
        if chunk == 0:
            return None
        return tuple(t.grad if t.is_floating_point() and t.requires_grad else None
                     for t in inputs)

    def backward_input(self, chunk: int, mb: int, output_grads):
        """Input gradients now; deferring layers leave their weight GEMMs in the store."""
        record = self.store.record((chunk, mb)) if self.store is not None \
            else contextlib.nullcontext()
        with record:
            return self._backward(chunk, mb, output_grads)

    def backward_weight(self, chunk: int, mb: int) -> None:
        """The weight-gradient GEMMs ``backward_input`` left for (chunk, mb)."""
        self.in_flight.discard((chunk, mb))
        if self.store is None:
            return
        e = self.engine
        if e.using_bf16_optimizer:
            e.optimizer.clear_lp_grads()
        self.deferred_gemms += self.store.flush((chunk, mb))
        self._bf16_grads_to_master()

    def _warn_if_nothing_deferred(self):
        if self.schedule in ZERO_BUBBLE and self.deferred_gemms == 0 and not self._warned_empty:
            self._warned_empty = True
            print(f"WARNING: tds pipeline stage {self.engine.stage_id}: the {self.schedule} "
                  f"weight passes deferred no GEMM (no weight_grad_store, or no layer of this "
                  f"stage defers its weight gradient): correct, but no bubble is saved",
                  flush=True)

    def _bf16_grads_to_master(self):
        e = self.engine
        if e.using_bf16_optimizer and not e._config.bfloat16_config.immediate_grad_update:
            e.optimizer.update_hp_grads(clear_lp_grads=False)

"""The pipeline as a schedule a training step calls: forward and backward of every
micro-batch of one step (or forward only, to evaluate), on this rank's chunks.

One step is the schedule's per-rank action list (``schedules.build_schedule``: 1F1B,
interleaved 1F1B, ZB-H1 or ZB-V; ``schedules.forward_only`` to evaluate) run by
:class:`~tds.pipe.runner.ScheduleRunner`, whose callbacks are :class:`ScheduleStep`'s
methods. The step owns what the schedule produces: each micro-batch's labels, its loss and
the stats the loss function returns (``loss_fn(outputs, labels) -> loss`` or ``(loss,
{name: value})``), on the rank that computes the loss. What follows the schedule (the
data-parallel reduction, clipping, the loss scaler and the optimizer) is the caller's, the
same code as without a pipeline (torchtitan's ``pp_schedule.step()`` then the optimizer).

The caller supplies: the batch function (raw batch -> ``(inputs, labels)``) with an optional
per-micro-batch context around each call (the seeded draws of megatron's batch function),
``scale_loss`` (what the last chunk back-propagates: the loss divided by the micro-batches
and times the fp16 loss scale), a ``forward_context`` (autocast), and ``grad_sync(enabled)``
(the data-parallel wrapper's: gradient reduction starts only during the step's last
micro-batch).

Zero-bubble schedules split each backward into ``BackwardInput`` and ``BackwardWeight``: the
input pass runs inside ``weight_grad_store.record((chunk, mb))``, where layers that defer
their weight-gradient GEMM (megatron's mpu linear layers with ``set_weight_grad_deferral``)
leave it in the store, and the weight pass runs ``weight_grad_store.flush((chunk, mb))``.

Before the first step the boundaries are learned chunk by chunk (:mod:`.probe`).
"""
import contextlib
import itertools
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from .contract import StageContract
from .p2p import StageLink
from .probe import probe_chunks
from .runner import Boundary, ScheduleRunner, StageCallbacks
from .schedules import (ZERO_BUBBLE, Backward, BackwardInput, BackwardWeight, Placement,
                        build_schedule, forward_only)


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


def reentrant_checkpointing(module) -> bool:
    """Whether the module recomputes with DeepSpeed's reentrant checkpoint: then the first
    chunk's floating inputs must require grad, or its first segment is cut from autograd."""
    if getattr(module, "activation_checkpoint_interval", 0) <= 0:
        return False
    import deepspeed

    func = getattr(module.activation_checkpoint_func, "_tds_wraps",
                   module.activation_checkpoint_func)
    return func is not getattr(deepspeed.checkpointing, "non_reentrant_checkpoint", None)


def keep_gradless_blocks_out_of_checkpoints(module) -> None:
    """Run a block none of whose inputs needs a gradient without DeepSpeed's reentrant
    checkpoint.

    A reentrant checkpoint's output requires grad only if an input does, so a first block
    fed token ids and masks (an embedding) would get no parameter gradients. DeepSpeed
    skips such blocks only for classes named ``GPT2ModelPipe`` / ``GPTModelPipe`` (or with
    ``checkpointable_layers``); CPM-1's ``T5ModelPipe`` is neither. Such a block is cheap
    (the embedding) and holds no activation worth recomputing. The module's
    ``activation_checkpoint_func`` (its constructor argument) is wrapped; DeepSpeed's own
    function is left as it is.
    """
    func = getattr(module, "activation_checkpoint_func", None)
    if func is None or getattr(func, "_tds_wraps", None) is not None:
        return
    import deepspeed

    if func is not deepspeed.checkpointing.checkpoint:  # non-reentrant, or a user's own
        return

    def checkpoint(function, *args):
        if torch.is_grad_enabled() and not any(torch.is_tensor(a) and a.requires_grad
                                               for a in args):
            return function(*args)
        return func(function, *args)

    checkpoint._tds_wraps = func
    module.activation_checkpoint_func = checkpoint


def prepare_recompute_blocks(module) -> None:
    """DeepSpeed's ``PipelineModule`` runs its recompute blocks from a table it fills in
    ``_precompute_checkpointable_values``, which DeepSpeed's engine calls before the module
    runs (its public ``set_checkpoint_interval`` did not before 0.19.8): the one private
    method of DeepSpeed's that tds calls, on a module DeepSpeed built."""
    if getattr(module, "activation_checkpoint_interval", 0) > 0:
        precompute = getattr(module, "_precompute_checkpointable_values", None)
        if callable(precompute) and getattr(module, "num_virtual_stages", 1) == 1:
            # a fresh table: DeepSpeed before 0.19.8 appends to the one it finds
            module.is_checkpointable_results, module.is_checkpointable_results_interval = \
                [], None
            precompute()


@dataclass
class Stage:
    """Where this rank sits in its pipeline.

    Attributes:
        stage_id: this rank's pipeline rank.
        stage_ranks: the global rank of each stage of this rank's pipeline.
        link: the point-to-point link (tensor-parallel group and device).
    """

    stage_id: int
    stage_ranks: Sequence[int]
    link: StageLink

    @property
    def device(self) -> torch.device:
        return self.link.device


def _nullcontext(*_):
    return contextlib.nullcontext()


def _as_loss_and_stats(result) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """``loss`` or ``(loss, stats)`` -> ``(loss, stats)``, with ``lm loss`` in the stats."""
    loss, stats = (result if isinstance(result, tuple) and len(result) == 2 and
                   isinstance(result[1], dict) else (result, {}))
    return loss, {"lm loss": loss.detach(), **{k: v.detach() if torch.is_tensor(v) else v
                                                for k, v in stats.items()}}


class ScheduleStep(StageCallbacks):
    """One pipeline rank's schedule and the runner's callbacks for it.

    Args:
        module: the pipeline module (tds's ``PipelineModule`` or DeepSpeed's).
        schedule: "1f1b", "interleaved", "zb-h1" or "zbv" (must fit the module's chunks).
        stage: this rank's :class:`Stage`.
        contract: what crosses each boundary (``contract_of(module)``).
        batch_fn: raw batch -> ``(inputs, labels)`` (None: the iterator yields that pair).
        batch_context: ``f(micro_batch) -> context manager`` around each batch_fn call.
        weight_grad_store: zero-bubble schedules: where deferring layers record their
            weight-gradient GEMMs (``record`` / ``flush`` / ``check_flushed``).
        forward_context: ``f() -> context manager`` around every forward (e.g. autocast).
        grad_sync: ``f(enabled) -> context manager`` around every backward; enabled for
            each chunk's last backward and last weight pass of the step (the data-parallel
            reduction of what they complete may start then).
    """

    def __init__(self, module, schedule: str, stage: Stage, contract: StageContract,
                 batch_fn: Optional[Callable] = None,
                 batch_context: Optional[Callable[[int], Any]] = None,
                 weight_grad_store: Optional[Any] = None,
                 forward_context: Callable[[], Any] = _nullcontext,
                 grad_sync: Callable[[bool], Any] = _nullcontext):
        self.module, self.stage, self.contract = module, stage, contract
        self.batch_fn, self.batch_context = batch_fn, batch_context
        self.forward_context, self.grad_sync = forward_context, grad_sync
        self.placement = module_placement(module, len(stage.stage_ranks))
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
        chunks = self.chunks = self.placement.chunks(stage.stage_id)
        self.local_index = {chunk: j for j, chunk in enumerate(chunks)}
        # the rank that loads a micro-batch also computes its loss (a V): keep its labels
        self.keeps_labels = 0 in chunks and self.num_chunks - 1 in chunks
        keep_gradless_blocks_out_of_checkpoints(module)
        prepare_recompute_blocks(module)
        self.reentrant = reentrant_checkpointing(module)
        self.boundaries: Optional[List[Boundary]] = None
        self._runners: Dict[Tuple[bool, int], ScheduleRunner] = {}
        self.runner: Optional[ScheduleRunner] = None  # the last step's (its results)
        self._last_passes: Dict[Tuple[str, int], int] = {}
        self.deferred_gemms = 0  # weight-gradient GEMMs the weight passes ran, per step
        self.peak_in_flight = 0  # (chunk, mb) forwarded and not yet through its backward
        self._warned_empty = False
        self._grad_contract: Optional[List[str]] = None  # the first step's findings
        self._grads_checked = False

    @property
    def is_loss_rank(self) -> bool:
        """Whether this rank computes the loss (it owns the last chunk: rank 0 in a V)."""
        return self.placement.owner(self.num_chunks - 1) == self.stage.stage_id

    @property
    def loss_stage(self) -> int:
        return self.placement.owner(self.num_chunks - 1)

    def set_contract(self, contract: StageContract) -> None:
        """A new contract (CPM's setters): the boundaries are learned again."""
        self.contract, self.boundaries = contract, None
        self._runners, self.runner = {}, None
        self._grads_checked = False

    # ------------------------------------------------------------ steps
    def train(self, data_iterator: Optional[Iterator], num_micro_batches: int,
              scale_loss: Callable[[torch.Tensor], torch.Tensor]) -> List[Dict[str, Any]]:
        """Forward and backward of ``num_micro_batches`` micro-batches (the gradients are
        accumulated; nothing is reduced or stepped).

        Args:
            data_iterator: raw batches (on the ranks that load or compute the loss).
            num_micro_batches: micro-batches in the step.
            scale_loss: ``loss -> tensor to back-propagate`` (divided by the micro-batches,
                times the loss scale).

        Returns:
            per micro-batch the stats of its loss (``lm loss`` and what ``loss_fn``
            returned) on the loss rank, in micro-batch order; ``[]`` elsewhere.
        """
        if not torch.is_grad_enabled():
            raise RuntimeError("a training step needs gradients enabled; evaluate instead")
        data_iterator = self._ensure_boundaries(data_iterator)
        self.module.train()
        self._begin(data_iterator, num_micro_batches, scale_loss)
        checking = not self._grads_checked
        self._grad_contract = [] if checking else None
        self._runner(num_micro_batches, False).run(self)
        if checking:
            self._grads_checked = True
            self._agree_on_grad_contract()
        if self.store is not None:
            self.store.check_flushed(where=f"the end of a {self.schedule} step")
        self._warn_if_nothing_deferred()
        return [self.stats[mb] for mb in sorted(self.stats)]

    def evaluate(self, data_iterator: Optional[Iterator],
                 num_micro_batches: int) -> List[Dict[str, Any]]:
        """Forward passes of ``num_micro_batches`` (no grad, eval mode) through the same
        runner; returns the loss rank's per-micro-batch stats (``[]`` elsewhere)."""
        data_iterator = self._ensure_boundaries(data_iterator)
        training = self.module.training
        self.module.eval()
        self._begin(data_iterator, num_micro_batches, None)
        try:
            with torch.no_grad():
                self._runner(num_micro_batches, True).run(self)
        finally:
            self.module.train(training)
        return [self.stats[mb] for mb in sorted(self.stats)]

    def _begin(self, data_iterator, num_micro_batches, scale_loss):
        self.data_iterator, self.num_micro_batches = data_iterator, num_micro_batches
        self.scale_loss = scale_loss
        self.labels, self.saved, self.stats = {}, {}, {}
        self.in_flight, self.peak_in_flight, self.deferred_gemms = set(), 0, 0

    def _ensure_boundaries(self, data_iterator):
        """Probe the boundaries before the first step; returns the iterator (with the
        peeked batch put back in front)."""
        if self.boundaries is not None:
            return data_iterator
        first = None
        if 0 in self.chunks:
            raw = next(data_iterator) if data_iterator is not None else None
            if data_iterator is not None:
                data_iterator = itertools.chain([raw], data_iterator)
            with self.forward_context():
                first = self._device_inputs(self._apply_batch_fn(raw, 0)[0])
        link = self.stage.link

        def probe_run(j, inputs):  # eager: the probe compiles nothing
            with self.forward_context():
                return run_chunk(self.module, j, inputs)

        self.boundaries = probe_chunks(self.module, self.placement, self.stage.stage_id,
                                       self.stage.stage_ranks, self.contract, link.tp_size,
                                       link.device, probe_run, first)
        return data_iterator

    def _runner(self, num_micro_batches: int, evaluate: bool) -> ScheduleRunner:
        key = (evaluate, num_micro_batches)
        if key not in self._runners:
            if evaluate:
                actions, placement = forward_only(self.placement, num_micro_batches), \
                    self.placement
            else:
                actions, placement = build_schedule(self.schedule, self.pp_size,
                                                    self.vpp_size, num_micro_batches)
            self._runners[key] = ScheduleRunner(
                actions, self.vpp_size, num_micro_batches, self.stage.stage_ranks,
                self.stage.link, self.boundaries, placement=placement, forward_only=evaluate)
        self.runner = self._runners[key]
        self._last_passes = _last_passes(self.runner.actions)
        return self.runner

    # ------------------------------------------------------------ data
    def _apply_batch_fn(self, raw, mb: int):
        if self.batch_fn is None:
            return raw
        if self.batch_context is None:
            return self.batch_fn(raw)
        with self.batch_context(mb):
            return self.batch_fn(raw)

    def _next_batch(self, mb: int):
        raw = next(self.data_iterator) if self.data_iterator is not None else None
        return self._apply_batch_fn(raw, mb)

    def _device_inputs(self, inputs):
        def move(t):
            t = t.to(self.stage.device)
            if self.reentrant and t.is_floating_point() and torch.is_grad_enabled():
                t = t.detach().requires_grad_()
                t._tds_reentrant_leaf = True  # for the reentrant checkpoint, not the contract
            return t

        return move(inputs) if torch.is_tensor(inputs) else tuple(move(t) for t in inputs)

    def _labels(self, mb: int):
        """The last chunk's labels of micro-batch ``mb``, on the device: kept by load() where
        this rank loads too, else read in call order, the order of load()'s inputs
        (schedule_check proves it before any step)."""
        labels = self.labels.pop(mb) if self.keeps_labels else self._next_batch(mb)[1]
        device = self.stage.device
        return labels.to(device) if torch.is_tensor(labels) else \
            tuple(t.to(device) for t in labels)

    # ------------------------------------------------------------ runner callbacks
    def load(self, mb: int):
        """Chunk 0's inputs (its batch function reads the next micro-batch)."""
        inputs, labels = self._next_batch(mb)
        if self.keeps_labels:
            self.labels[mb] = labels
        return self._device_inputs(inputs)

    def _forward_chunk(self, j: int, inputs, training: bool):
        """Local chunk ``j``'s layers: its compiled region (tds/pipe/compiled.py) where it
        has one, else the module's forward."""
        regions = getattr(self.module, "chunk_regions", None)
        if regions is not None:
            return regions.run(j, inputs, training=training)
        return run_chunk(self.module, j, inputs)

    def forward(self, chunk: int, mb: int, inputs):
        j = self.local_index[chunk]
        training = self.module.training
        with self.forward_context():
            if chunk < self.num_chunks - 1:
                outputs = self._forward_chunk(j, inputs, training)
            else:
                outputs = self._loss(j, inputs, mb, training)
        if training:
            if self._grad_contract is not None and mb == 0 and chunk < self.num_chunks - 1:
                self._check_grad_contract(chunk, outputs)
            self.saved[(chunk, mb)] = (inputs, outputs)
            self.in_flight.add((chunk, mb))
            self.peak_in_flight = max(self.peak_in_flight, len(self.in_flight))
        return outputs

    def _check_grad_contract(self, chunk: int, outputs) -> None:
        """The first step's outputs against ``_input_grad`` (the probe ran without grad, so
        only a real forward shows which positions carry a gradient): a position that
        depends on the stage's parameters but is declared without a gradient would lose it
        silently; one declared with a gradient that nothing before it needs would get one
        sent back for nothing."""
        grads = self.boundaries[chunk].contract.grads
        for pos, tensor in enumerate(outputs):
            if not torch.is_tensor(tensor) or not tensor.is_floating_point():
                continue
            where = (f"pipeline stage {self.stage.stage_id}, chunk {chunk} output position "
                     f"{pos}")
            # a batch tensor passed through unchanged needs no gradient: it requires one only
            # because a reentrant checkpoint asks its float inputs to (_device_inputs)
            passed_through = tensor.grad_fn is None and getattr(tensor, "_tds_reentrant_leaf",
                                                                False)
            if tensor.requires_grad and not grads[pos] and not passed_through:
                self._grad_contract.append(
                    f"{where} carries a gradient (it depends on this stage's parameters or "
                    f"inputs) but _input_grad[{pos}] is False: the earlier stages would "
                    f"silently lose it; set _input_grad[{pos}] = True")
            elif grads[pos] and not tensor.requires_grad:
                self._grad_contract.append(
                    f"{where} carries no gradient (nothing it depends on needs one) but "
                    f"_input_grad[{pos}] is True: a gradient would be sent back for nothing; "
                    f"set _input_grad[{pos}] = False")

    def _agree_on_grad_contract(self) -> None:
        """Every rank learns of any rank's findings (one all-gather, the first step only)
        and raises the same ValueError, before the caller's optimizer step."""
        import torch.distributed as dist

        reports = [None] * dist.get_world_size()
        dist.all_gather_object(reports, self._grad_contract)
        found = [(rank, m) for rank, messages in enumerate(reports) for m in messages or []]
        self._grad_contract = None
        if found:
            rank, message = found[0]
            more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
            raise ValueError(f"{message} (found on rank {rank}){more}")

    def _loss(self, j: int, inputs, mb: int, training: bool):
        """The last chunk: its loss (inside its compiled region where it has one) and
        stats."""
        labels = self._labels(mb)
        regions = getattr(self.module, "chunk_regions", None)
        if regions is not None and regions.has_loss(j):
            result = regions.run(j, inputs, labels, training)
        else:
            outputs = self._forward_chunk(j, inputs, training)
            loss_fn = getattr(self.module, "loss_fn", None)
            result = loss_fn(outputs, labels) if loss_fn is not None else outputs
        loss, stats = _as_loss_and_stats(result)
        extra = getattr(self.module, "get_additional_losses", None)
        extra = extra() if callable(extra) else None
        if extra:
            stats.update({name: value.detach() for name, value in extra.items()})
        self.stats[mb] = stats
        return loss

    def backward(self, chunk: int, mb: int, output_grads):
        """Input and weight gradients of (chunk, mb)."""
        self.in_flight.discard((chunk, mb))
        return self._backward(chunk, mb, output_grads)

    def _backward(self, chunk: int, mb: int, output_grads):
        inputs, outputs = self.saved.pop((chunk, mb))
        with self.grad_sync(self._last_passes.get(("backward", chunk)) == mb):
            if chunk == self.num_chunks - 1:  # the loss
                torch.autograd.backward(self.scale_loss(outputs))
            else:
                pairs = [(t, g) for t, g in zip(outputs, output_grads)
                         if g is not None and t.requires_grad]
                if pairs:  # none: no position carries a gradient back (the contract says)
                    torch.autograd.backward([t for t, _ in pairs],
                                            grad_tensors=[g for _, g in pairs])
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
        with self.grad_sync(self._last_passes.get(("weight", chunk)) == mb):
            self.deferred_gemms += self.store.flush((chunk, mb))

    def _warn_if_nothing_deferred(self):
        if self.schedule in ZERO_BUBBLE and self.deferred_gemms == 0 and not self._warned_empty:
            self._warned_empty = True
            print(f"WARNING: tds pipeline stage {self.stage.stage_id}: the {self.schedule} "
                  f"weight passes deferred no GEMM (no weight_grad_store, or no layer of this "
                  f"stage defers its weight gradient): correct, but no bubble is saved",
                  flush=True)


def _last_passes(actions) -> Dict[Tuple[str, int], int]:
    """``{("backward" | "weight", chunk): micro-batch}`` of each local chunk's last input
    (or whole) backward and last weight pass in this rank's action list: the passes after
    which the chunk's gradients are final (a zero-bubble schedule may run the weight passes
    out of micro-batch order), where the data-parallel reduction may start."""
    last = {}
    for action in actions:
        if isinstance(action, (Backward, BackwardInput)):
            last[("backward", action.chunk)] = action.mb
        elif isinstance(action, BackwardWeight):
            last[("weight", action.chunk)] = action.mb
    return last

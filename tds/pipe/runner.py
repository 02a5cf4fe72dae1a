"""Run one pipeline rank's schedule with torch.distributed point-to-point calls.

The runner walks the rank's action list (``schedules.py``) and calls back into the engine
for the computations; it owns only the tensors in transit:

- ``Forward(c, mb)``: ``callbacks.load(mb)`` (chunk 0) or the received activations go
  into ``callbacks.forward(c, mb, inputs)``; its output tuple waits for its send (the last
  chunk's output, e.g. the loss, is returned by ``run``);
- ``Backward(c, mb)`` / ``BackwardInput(c, mb)``: the received gradients of c's outputs go
  into ``callbacks.backward`` / ``backward_input``; the returned gradients of c's inputs
  wait for their send; ``BackwardWeight(c, mb)`` calls ``callbacks.backward_weight``;
- a local hand-off (chunks c and c + 1 on this rank, the turn of a V ``Placement``) moves
  no tensor over the network: c's output tuple becomes c + 1's input as new leaves, as if
  received, and the input gradients of c + 1's backward become c's output gradients;
- a send or receive, or an ``Exchange`` of several, is one ``dist.batch_isend_irecv``
  call waited for before the next action (gloo on CPU, NCCL on GPU). Each tuple travels
  per ``StageLink`` and the boundary's ``StageContract``: a partitioned position moves 1/tp
  of its elements and is all-gathered inside the tensor-parallel group on arrival; only
  ``_input_grad`` positions carry gradients back.

``schedule_check.check_schedule`` proves the whole schedule (every rank's list, which every
rank holds) when the runner is built, so a bad schedule raises the same ValueError on
every rank instead of hanging (or pairing one micro-batch's inputs with another's labels).
With NCCL, torch requires a collective on the default group (a barrier, say) before the
first batched point-to-point call of a job.
"""
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from .contract import StageContract
from .p2p import StageLink
from .schedule_check import check_schedule
from .actions import (Backward, BackwardInput, BackwardWeight, Exchange, Forward, Placement,
                        RecvAct, RecvGrad, SendAct, SendGrad, as_placement, p2p_ops)

Meta = Tuple[Tuple[Tuple[int, ...], torch.dtype], ...]
Grads = Tuple[Optional[torch.Tensor], ...]


@dataclass(frozen=True)
class Boundary:
    """What leaves a chunk for the next: its contract and per position (full shape, dtype)."""
    contract: StageContract
    meta: Meta

    def __post_init__(self):
        if len(self.meta) != len(self.contract):
            raise ValueError(f"pipeline boundary: {len(self.meta)} (shape, dtype) entries for "
                             f"a contract of {len(self.contract)} positions")


class StageCallbacks:
    """What the engine provides to the runner (subclass it, or duck-type the methods).

    Chunks are global chunk ids (0 .. p v - 1); this rank only sees its own.
    """

    def load(self, mb: int) -> Tuple[torch.Tensor, ...]:
        """Inputs of chunk 0 for micro-batch ``mb`` (called on the rank holding chunk 0).

        The checked schedule calls it in the micro-batch order in which the last chunk's
        ``forward`` runs, so inputs and labels may both be read from the data in call order.
        """
        raise NotImplementedError

    def forward(self, chunk: int, mb: int, inputs: Tuple[torch.Tensor, ...]) -> Any:
        """Run ``chunk`` on ``inputs``; return the boundary tuple (anything for the last chunk).

        Received floating ``_input_grad`` positions arrive with ``requires_grad=True``.
        """
        raise NotImplementedError

    def backward(self, chunk: int, mb: int, output_grads: Optional[Grads]) -> Optional[Grads]:
        """Input and weight gradients of (chunk, mb).

        Args:
            output_grads: gradients of the chunk's output tuple, None at positions without
                ``_input_grad``; None for the last chunk (back-propagate its loss).

        Returns:
            gradients of the chunk's input tuple (None where none); ignored for chunk 0.
        """
        raise NotImplementedError

    def backward_input(self, chunk: int, mb: int,
                       output_grads: Optional[Grads]) -> Optional[Grads]:
        """ZB schedules: like ``backward`` but the input gradients only."""
        raise NotImplementedError

    def backward_weight(self, chunk: int, mb: int) -> None:
        """ZB schedules: the weight gradients of (chunk, mb), after its ``backward_input``."""
        raise NotImplementedError


def _detached(outputs):
    """The last chunk's output without its graph (tensors detached, anything else as is)."""
    if torch.is_tensor(outputs):
        return outputs.detach()
    if isinstance(outputs, (tuple, list)):
        return type(outputs)(_detached(t) for t in outputs)
    return outputs


def _implements(callbacks, name: str) -> bool:
    method = getattr(callbacks, name, None)
    return callable(method) and getattr(method, "__func__", None) is not \
        getattr(StageCallbacks, name)


class ScheduleRunner:
    """Executes this rank's part of a checked pipeline schedule.

    Args:
        actions: the action lists of all pipeline ranks (``schedules.one_f_one_b`` etc.).
        vpp_size: chunks per rank v.
        num_micro_batches: micro-batches m per step.
        stage_ranks: global rank of each pipeline stage of this rank's pipeline (this
            rank's tensor- and data-parallel coordinates); this rank must be among them.
        link: this rank's ``StageLink`` (tensor-parallel group and device).
        boundaries: the ``Boundary`` after chunk c for c = 0 .. p v - 2, or one for all.
        placement: which rank holds which chunk (default ``Placement.loop(p, v)``; ZB-V's
            is ``Placement.v_shape(p)``, as ``schedules.build_schedule`` returns it).
        forward_only: an evaluation schedule (``schedules.forward_only``).

    Raises:
        ValueError: the schedule is wrong (see ``check_schedule``) or the sizes disagree.
    """

    def __init__(self, actions: Sequence[Sequence], vpp_size: int, num_micro_batches: int,
                 stage_ranks: Sequence[int], link: StageLink,
                 boundaries: Union[Boundary, Sequence[Boundary]],
                 placement: Optional[Placement] = None, forward_only: bool = False):
        pp_size = len(actions)
        if len(stage_ranks) != pp_size:
            raise ValueError(f"pipeline runner: {len(stage_ranks)} stage ranks for a schedule "
                             f"of {pp_size} pipeline ranks")
        self.placement = as_placement(pp_size, pp_size * vpp_size, placement)
        check_schedule(actions, pp_size, vpp_size, num_micro_batches, self.placement,
                       forward_only)
        self.num_chunks = pp_size * vpp_size
        if isinstance(boundaries, Boundary):
            boundaries = [boundaries] * (self.num_chunks - 1)
        if len(boundaries) != self.num_chunks - 1:
            raise ValueError(f"pipeline runner: {len(boundaries)} boundaries for "
                             f"{self.num_chunks} chunks; give p v - 1 (one after each chunk "
                             f"but the last) or a single one")
        self.boundaries = list(boundaries)
        self.stage_ranks = list(stage_ranks)
        if dist.get_rank() not in self.stage_ranks:
            raise ValueError(f"pipeline runner: this rank ({dist.get_rank()}) is not among "
                             f"the stage ranks {self.stage_ranks}")
        self.pp_rank = self.stage_ranks.index(dist.get_rank())
        self.actions = list(actions[self.pp_rank])
        self.link = link
        self._warned_missing_grad = False
        kinds = {type(a) for rank_actions in actions for a in rank_actions}
        self.needs = ["load", "forward"] + [name for kind, name in (
            (Backward, "backward"), (BackwardInput, "backward_input"),
            (BackwardWeight, "backward_weight")) if kind in kinds]

    def run(self, callbacks) -> Dict[int, Any]:
        """One step: every action of this rank, in order.

        Returns:
            {mb: output of the last chunk's forward, detached} on the rank holding the last
            chunk, else {}.
        """
        self.inputs: Dict = {}       # (chunk, mb) -> received input tuple
        self.outputs: Dict = {}      # (chunk, mb) -> output tuple waiting for its send
        self.out_grads: Dict = {}    # (chunk, mb) -> received gradients of its outputs
        self.in_grads: Dict = {}     # (chunk, mb) -> input gradients waiting for their send
        self.results: Dict = {}
        missing = [name for name in self.needs if not _implements(callbacks, name)]
        if missing:  # the same on every rank: checked for the whole schedule
            raise ValueError(f"pipeline runner: the schedule needs callbacks "
                             f"{', '.join(missing)}, which {type(callbacks).__name__} does "
                             f"not implement")
        for action in self.actions:
            if isinstance(action, (SendAct, RecvAct, SendGrad, RecvGrad, Exchange)):
                self._communicate(p2p_ops(action))
            else:
                self._compute(action, callbacks)
        return self.results

    # ------------------------------------------------------------ computations
    def _compute(self, action, callbacks):
        c, mb, key = action.chunk, action.mb, (action.chunk, action.mb)
        last = c == self.num_chunks - 1
        if isinstance(action, Forward):
            inputs = callbacks.load(mb) if c == 0 else self.inputs.pop(key)
            outputs = callbacks.forward(c, mb, inputs)
            if last:  # detached: the graph (each micro-batch's received input and its
                self.results[mb] = _detached(outputs)  # gradient) must not outlive it
                return
            self._check_tuple(outputs, self.boundaries[c], f"chunk {c} output")
            if self.placement.is_local(c):  # chunk c + 1 is ours: no message
                grads = self.boundaries[c].contract.grads
                self.inputs[(c + 1, mb)] = tuple(
                    t.detach().requires_grad_(grads[pos] and t.is_floating_point())
                    for pos, t in enumerate(outputs))
            else:
                self.outputs[key] = outputs
        elif isinstance(action, BackwardWeight):
            callbacks.backward_weight(c, mb)
        else:
            grads = None if last else self.out_grads.pop(key)
            run = callbacks.backward if isinstance(action, Backward) else callbacks.backward_input
            input_grads = run(c, mb, grads)
            if c == 0:
                return
            to_send = self._grads_to_send(input_grads, self.boundaries[c - 1], c)
            if self.placement.is_local(c - 1):  # chunk c - 1 is ours: as if received
                self._store(RecvGrad(self.pp_rank, c, mb), to_send)
            else:
                self.in_grads[key] = to_send

    def _check_tuple(self, tensors, boundary: Boundary, where: str):
        boundary.contract.check_tensors(tensors, self.link.tp_size, f"pipeline runner: {where}")
        for pos, (tensor, (shape, dtype)) in enumerate(zip(tensors, boundary.meta)):
            if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
                raise ValueError(f"pipeline runner: {where} position {pos} is "
                                 f"{tuple(tensor.shape)} {tensor.dtype}, but the boundary "
                                 f"metadata says {tuple(shape)} {dtype}; the receiver would "
                                 f"read the wrong size")

    def _grads_to_send(self, input_grads, boundary: Boundary, chunk: int):
        grads = []
        for pos, wanted in enumerate(boundary.contract.grads):
            if not wanted:
                continue
            grad = input_grads[pos] if input_grads is not None else None
            if grad is None:  # the chunk did not use this input: its gradient is zero
                shape, dtype = boundary.meta[pos]
                grad = torch.zeros(shape, dtype=dtype, device=self.link.device)
                self._warn_missing_grad(chunk, pos)
            grads.append((pos, grad))
        return grads

    def _warn_missing_grad(self, chunk: int, pos: int):
        if not self._warned_missing_grad:
            self._warned_missing_grad = True
            print(f"WARNING: tds pipeline chunk {chunk}: input position {pos} is marked "
                  f"_input_grad but got no gradient; sending zeros", flush=True)

    # ------------------------------------------------------------ communication
    def _communicate(self, ops):
        """Post every tensor of ``ops`` in one batched call, wait, then store what arrived."""
        p2p, landed = [], []
        for op in ops:
            peer = self.stage_ranks[op.peer]
            if isinstance(op, SendAct):
                boundary = self.boundaries[op.chunk]
                for pos, tensor in enumerate(self.outputs.pop((op.chunk, op.mb))):
                    p2p.append(self.link.send_op(tensor, peer, boundary.contract.partitioned[pos]))
            elif isinstance(op, SendGrad):
                boundary = self.boundaries[op.chunk - 1]
                for pos, grad in self.in_grads.pop((op.chunk, op.mb)):
                    p2p.append(self.link.send_op(grad, peer, boundary.contract.partitioned[pos]))
            else:
                landed.append((op, self._post_recv(op, peer, p2p)))
        for work in dist.batch_isend_irecv(p2p) if p2p else ():  # a tuple with no gradient
            work.wait()
        for op, finishers in landed:
            self._store(op, [(pos, finish()) for pos, finish in finishers])

    def _post_recv(self, op, peer: int, p2p: list):
        """Append the receive ops of message ``op`` to ``p2p``; return its (pos, finish)."""
        boundary = self.boundaries[op.chunk if isinstance(op, RecvAct) else op.chunk - 1]
        contract, finishers = boundary.contract, []
        for pos, (shape, dtype) in enumerate(boundary.meta):
            if isinstance(op, RecvGrad) and not contract.grads[pos]:
                continue
            recv, finish = self.link.recv_op(shape, dtype, peer, contract.partitioned[pos])
            p2p.append(recv)
            finishers.append((pos, finish))
        return finishers

    def _store(self, op, tensors):
        if isinstance(op, RecvAct):  # the input of chunk + 1
            grads = self.boundaries[op.chunk].contract.grads
            self.inputs[(op.chunk + 1, op.mb)] = tuple(
                t.requires_grad_(grads[pos] and t.is_floating_point()) for pos, t in tensors)
        else:  # gradients of the outputs of chunk - 1, positionally; None without a gradient
            grads = [None] * len(self.boundaries[op.chunk - 1].meta)
            for pos, tensor in tensors:
                grads[pos] = tensor
            self.out_grads[(op.chunk - 1, op.mb)] = tuple(grads)

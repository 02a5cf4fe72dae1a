"""Pipeline actions, chunk placement and the lowering of computation orders into them.

The model is cut into ``pp_size * vpp_size`` chunks; a ``Placement`` says which pipeline
rank holds each: "loop" (the default, Megatron-LM's virtual stages: chunk c on rank
c % p, rank r holds r, r + p, ...) or "v" (ZB-V, two chunks per rank: 0..p-1 down the
ranks, p..2p-1 back up, so rank 0 holds the first and the last chunk). Chunk 0 reads the
micro-batch and chunk ``pp_size * vpp_size - 1`` computes the loss. A schedule is one list
of actions per pipeline rank:

- compute: ``Forward``, ``Backward`` (input and weight gradients together) or, for
  zero-bubble schedules, ``BackwardInput`` then ``BackwardWeight``, of (chunk, mb);
- communication: ``SendAct`` / ``RecvAct`` (the output of ``chunk``, to / from the owner of
  ``chunk + 1``), ``SendGrad`` / ``RecvGrad`` (the gradient of ``chunk``'s input, to / from
  the owner of ``chunk - 1``), each naming the peer pipeline rank, and ``Exchange``: several
  of those posted together and waited for together (``send_forward_recv_backward``).

A message is named by the chunk that computed it: ``SendAct(peer, c, mb)`` pairs with
``RecvAct(owner, c, mb)`` on the owner of c + 1. Where chunks c and c + 1 share a rank (the
V's turn) nothing is sent: a *local hand-off*, ordered by the rank's own list. The
generators (:mod:`.schedules`) place the computations and ``lower`` inserts the
communication; ``schedule_check.check_schedule`` proves a list is complete and deadlock-free
before anything runs.
"""
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union


@dataclass(frozen=True)
class Forward:
    chunk: int
    mb: int


@dataclass(frozen=True)
class Backward:
    """Input and weight gradients of (chunk, mb) in one pass."""
    chunk: int
    mb: int


@dataclass(frozen=True)
class BackwardInput:
    """Zero-bubble split, part 1: the input gradient only (what the previous chunk waits on)."""
    chunk: int
    mb: int


@dataclass(frozen=True)
class BackwardWeight:
    """Zero-bubble split, part 2: the weight gradient of (chunk, mb); no communication."""
    chunk: int
    mb: int


@dataclass(frozen=True)
class SendAct:
    """Send the output of ``chunk`` for ``mb`` to pipeline rank ``peer`` (owner of chunk + 1)."""
    peer: int
    chunk: int
    mb: int
    message = "act"


@dataclass(frozen=True)
class RecvAct:
    """Receive the output of ``chunk`` for ``mb`` from pipeline rank ``peer`` (its owner)."""
    peer: int
    chunk: int
    mb: int
    message = "act"


@dataclass(frozen=True)
class SendGrad:
    """Send the gradient of ``chunk``'s input to ``peer`` (owner of chunk - 1)."""
    peer: int
    chunk: int
    mb: int
    message = "grad"


@dataclass(frozen=True)
class RecvGrad:
    """Receive the gradient of ``chunk``'s input from ``peer`` (owner of ``chunk``)."""
    peer: int
    chunk: int
    mb: int
    message = "grad"


P2P = Union[SendAct, RecvAct, SendGrad, RecvGrad]


@dataclass(frozen=True)
class Exchange:
    """Several sends / receives posted together (one batched p2p call), completing together."""
    ops: Tuple[P2P, ...]


Compute = Union[Forward, Backward, BackwardInput, BackwardWeight]
Action = Union[Compute, P2P, Exchange]
COMPUTE = (Forward, Backward, BackwardInput, BackwardWeight)
SENDS, RECVS = (SendAct, SendGrad), (RecvAct, RecvGrad)
P2P_TYPES = SENDS + RECVS


PLACEMENT_KINDS = ("loop", "v")


@dataclass(frozen=True)
class Placement:
    """Which pipeline rank holds each of the ``pp_size * vpp_size`` global chunks.

    "loop" (default): chunk c on rank c % p. "v" (ZB-V, vpp_size 2): chunks 0..p-1 on ranks
    0..p-1, chunks p..2p-1 on ranks p-1..0; rank 0 reads the micro-batch (chunk 0) and
    computes the loss (chunk 2p - 1), and chunks p - 1 and p share rank p - 1.

    Args:
        pp_size: pipeline ranks p.
        vpp_size: chunks per rank v.
        kind: "loop" or "v".
    """
    pp_size: int
    vpp_size: int = 1
    kind: str = "loop"

    def __post_init__(self):
        _check_sizes(self.pp_size, self.vpp_size, 1)
        if self.kind not in PLACEMENT_KINDS:
            raise ValueError(f"chunk placement: kind {self.kind!r} is not one of "
                             f"{', '.join(PLACEMENT_KINDS)}")
        if self.kind == "v" and self.vpp_size != 2:
            raise ValueError(f"chunk placement: a V places exactly 2 chunks per rank, got "
                             f"vpp_size {self.vpp_size}")

    @classmethod
    def loop(cls, pp_size: int, vpp_size: int = 1) -> "Placement":
        """Megatron-LM's placement: chunk c on rank c % pp_size."""
        return cls(pp_size, vpp_size, "loop")

    @classmethod
    def v_shape(cls, pp_size: int) -> "Placement":
        """ZB-V's placement: 2 chunks per rank, down the ranks and back up."""
        return cls(pp_size, 2, "v")

    @property
    def num_chunks(self) -> int:
        return self.pp_size * self.vpp_size

    def owner(self, chunk: int) -> int:
        """The pipeline rank holding global chunk ``chunk``."""
        p = self.pp_size
        if not 0 <= chunk < self.num_chunks:
            raise ValueError(f"chunk placement: chunk {chunk} out of range "
                             f"0..{self.num_chunks - 1}")
        if self.kind == "v":
            return chunk if chunk < p else 2 * p - 1 - chunk
        return chunk % p

    def chunks(self, rank: int) -> Tuple[int, ...]:
        """The global chunks of pipeline rank ``rank`` in local order (local j -> global)."""
        p = self.pp_size
        if not 0 <= rank < p:
            raise ValueError(f"chunk placement: rank {rank} out of range 0..{p - 1}")
        if self.kind == "v":
            return (rank, 2 * p - 1 - rank)
        return tuple(j * p + rank for j in range(self.vpp_size))

    def is_local(self, chunk: int) -> bool:
        """Whether the hand-off from ``chunk`` to ``chunk + 1`` stays on one rank."""
        return 0 <= chunk < self.num_chunks - 1 and self.owner(chunk) == self.owner(chunk + 1)


def as_placement(pp_size: Union[int, Placement], num_chunks: Optional[int] = None,
                 placement: Optional[Placement] = None) -> Placement:
    """The placement meant by the old ``(pp_size, num_chunks)`` form or an explicit one.

    Args:
        pp_size: pipeline ranks, or a ``Placement`` (then nothing else is needed).
        num_chunks: chunks in all (p v); None means p (or the placement's).
        placement: explicit placement; must agree with ``pp_size`` and ``num_chunks``.

    Raises:
        ValueError: the placement disagrees with the sizes, or the chunks do not split.
    """
    if isinstance(pp_size, Placement):
        placement, pp_size = (placement or pp_size), pp_size.pp_size
    if placement is None:
        num_chunks = pp_size if num_chunks is None else num_chunks
        if not isinstance(pp_size, int) or pp_size < 1 or num_chunks % pp_size:
            raise ValueError(f"chunk placement: {num_chunks} chunks do not split over "
                             f"pp_size {pp_size!r}")
        return Placement.loop(pp_size, num_chunks // pp_size)
    if not isinstance(placement, Placement):
        raise ValueError(f"chunk placement: expected a Placement, got {placement!r}")
    if placement.pp_size != pp_size or num_chunks not in (None, placement.num_chunks):
        raise ValueError(f"chunk placement: {placement} does not match pp_size {pp_size} "
                         f"and {num_chunks} chunks")
    return placement


def p2p_ops(action: Action) -> Tuple[P2P, ...]:
    """The point-to-point operations of an action (none for a computation)."""
    if isinstance(action, Exchange):
        return action.ops
    return (action,) if isinstance(action, P2P_TYPES) else ()


def consumes(action: Compute, pp_size: Union[int, Placement], num_chunks: Optional[int] = None,
             placement: Optional[Placement] = None):
    """The receive a computation needs before it can run (None: nothing to receive,
    including a local hand-off, see ``handoff_in``). Placement as in ``as_placement``."""
    pl = as_placement(pp_size, num_chunks, placement)
    c, mb = action.chunk, action.mb
    if isinstance(action, Forward) and c > 0 and not pl.is_local(c - 1):
        return RecvAct(pl.owner(c - 1), c - 1, mb)
    if isinstance(action, (Backward, BackwardInput)) and c < pl.num_chunks - 1 and \
            not pl.is_local(c):
        return RecvGrad(pl.owner(c + 1), c + 1, mb)
    return None


def produces(action: Compute, pp_size: Union[int, Placement], num_chunks: Optional[int] = None,
             placement: Optional[Placement] = None):
    """The send that carries a computation's result on (None: nothing to send, including a
    local hand-off, see ``handoff_out``). Placement as in ``as_placement``."""
    pl = as_placement(pp_size, num_chunks, placement)
    c, mb = action.chunk, action.mb
    if isinstance(action, Forward) and c < pl.num_chunks - 1 and not pl.is_local(c):
        return SendAct(pl.owner(c + 1), c, mb)
    if isinstance(action, (Backward, BackwardInput)) and c > 0 and not pl.is_local(c - 1):
        return SendGrad(pl.owner(c - 1), c, mb)
    return None


def handoff_in(action: Compute, placement: Placement):
    """``(message, chunk, mb)`` a computation takes from an earlier one on its own rank (a
    local hand-off: the output of chunk c - 1, or the input gradient of c + 1), or None."""
    c, mb = action.chunk, action.mb
    if isinstance(action, Forward) and placement.is_local(c - 1):
        return ("act", c - 1, mb)
    if isinstance(action, (Backward, BackwardInput)) and placement.is_local(c):
        return ("grad", c + 1, mb)
    return None


def handoff_out(action: Compute, placement: Placement):
    """``(message, chunk, mb)`` a computation hands to the next one on its own rank, or None."""
    c, mb = action.chunk, action.mb
    if isinstance(action, Forward) and placement.is_local(c):
        return ("act", c, mb)
    if isinstance(action, (Backward, BackwardInput)) and placement.is_local(c - 1):
        return ("grad", c, mb)
    return None


def _input_key(action: Compute, placement: Placement):
    """``(message, chunk, mb)`` a computation waits for (received or handed off), or None."""
    need = consumes(action, placement)
    return (need.message, need.chunk, need.mb) if need is not None else \
        handoff_in(action, placement)


def _rounds(steps, placement: Placement) -> List[List[Action]]:
    """Run per-rank steps in synchronous rounds and insert the communication (see ``lower``)."""
    pcs, lowered = [0] * len(steps), [[] for _ in steps]
    arrived = set()  # (rank, message, chunk, mb) received or handed off in an earlier round
    while any(pc < len(order) for pc, order in zip(pcs, steps)):
        sent, handed, progressed = [], [], False
        for rank, order in enumerate(steps):
            step = order[pcs[rank]] if pcs[rank] < len(order) else ()
            needs = [_input_key(action, placement) for action in step]
            if step and all(need is None or (rank,) + need in arrived for need in needs):
                lowered[rank] += step
                pcs[rank], progressed = pcs[rank] + 1, True
                sent += [(rank, produces(action, placement)) for action in step]
                handed += [(rank,) + key for key in (handoff_out(a, placement) for a in step)
                           if key is not None]
        if not progressed:
            raise ValueError("pipeline schedule: the computation orders wait on each other in "
                             "a cycle; next on each rank: " + ", ".join(
                                 f"rank {r}: {o[pcs[r]]}" for r, o in enumerate(steps)
                                 if pcs[r] < len(o)))
        arrived.update(handed)
        ops = [[] for _ in steps]
        for rank, send in sent:
            if send is not None:
                ops[rank].append(send)
                ops[send.peer].append(_recv_of(rank, send))
                arrived.add((send.peer, send.message, send.chunk, send.mb))
        for rank, rank_ops in enumerate(ops):
            rank_ops.sort(key=_op_order)
            lowered[rank] += [Exchange(tuple(rank_ops))] if len(rank_ops) > 1 else rank_ops
    return lowered


def lower(steps: Sequence[Sequence[Union[Compute, Tuple[Compute, ...]]]], pp_size: int,
          vpp_size: int, placement: Optional[Placement] = None) -> List[List[Action]]:
    """Insert the communication into per-rank computation orders, in rounds.

    The ranks step through synchronous rounds: in a round each rank runs its next step
    (one computation, or a tuple of them run back to back) if every message it needs
    arrived in an earlier round; then every rank posts one ``Exchange`` with what it
    produced this round and what its neighbours produced for it (a lone operation stays a
    plain send or receive). A round's exchanges pair only with each other, so they cannot
    wait on one another in a cycle, and both ends list the messages of one channel in the
    same order (sorted by kind, chunk, micro-batch). This is Megatron's
    ``send_forward_recv_backward`` pattern, derived instead of written case by case. A
    local hand-off (chunks c and c + 1 on one rank) gets no message; its taker waits, as
    for a received result, until a round after its giver.

    Args:
        steps: per pipeline rank, its computations in order; a tuple is one round's work.
        pp_size: pipeline ranks.
        vpp_size: chunks per rank.
        placement: which rank holds which chunk (default ``Placement.loop(pp_size,
            vpp_size)``).

    Raises:
        ValueError: the orders wait on each other in a cycle (no round makes progress).
    """
    placement = as_placement(pp_size, pp_size * vpp_size, placement)
    steps = [[s if isinstance(s, tuple) else (s,) for s in order] for order in steps]
    return _rounds(steps, placement)


def _recv_of(sender: int, send):
    kind = RecvAct if isinstance(send, SendAct) else RecvGrad
    return kind(sender, send.chunk, send.mb)


def _op_order(op):
    """One order for both ends of a channel: by message kind, chunk, micro-batch."""
    return (op.message, op.chunk, op.mb, isinstance(op, RECVS))


def _check_sizes(pp_size: int, vpp_size: int, num_micro_batches: int):
    for name, value in (("pp_size", pp_size), ("vpp_size", vpp_size),
                        ("num_micro_batches", num_micro_batches)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"pipeline schedule: {name} must be a positive integer, got "
                             f"{value!r}")

"""Pipeline schedules as explicit per-rank action lists.

The model is cut into ``pp_size * vpp_size`` chunks. Global chunk ``c`` lives on pipeline
rank ``c % pp_size`` (rank r holds chunks r, r + p, r + 2p, ...: Megatron-LM's virtual
pipeline stages), chunk 0 reads the micro-batch and chunk ``pp_size * vpp_size - 1``
computes the loss. A schedule is one list of actions per pipeline rank:

- compute: ``Forward``, ``Backward`` (input and weight gradients together) or, for
  zero-bubble schedules, ``BackwardInput`` then ``BackwardWeight``, of (chunk, mb);
- communication: ``SendAct`` / ``RecvAct`` (the output of ``chunk``, to / from the owner of
  ``chunk + 1``), ``SendGrad`` / ``RecvGrad`` (the gradient of ``chunk``'s input, to / from
  the owner of ``chunk - 1``), each naming the peer pipeline rank, and ``Exchange``: several
  of those posted together and waited for together (``send_forward_recv_backward``).

A message is named by the chunk that computed it: ``SendAct(peer, c, mb)`` pairs with
``RecvAct(owner, c, mb)`` on the owner of c + 1. Generators place the computations and
``lower`` inserts the communication; ``schedule_check.check_schedule`` proves a list is
complete and deadlock-free before anything runs.
"""
from dataclasses import dataclass
from typing import List, Sequence, Tuple, Union


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


def p2p_ops(action: Action) -> Tuple[P2P, ...]:
    """The point-to-point operations of an action (none for a computation)."""
    if isinstance(action, Exchange):
        return action.ops
    return (action,) if isinstance(action, P2P_TYPES) else ()


def consumes(action: Compute, pp_size: int, num_chunks: int):
    """The receive a computation needs before it can run (None: nothing to receive)."""
    c, mb = action.chunk, action.mb
    if isinstance(action, Forward) and c > 0:
        return RecvAct((c - 1) % pp_size, c - 1, mb)
    if isinstance(action, (Backward, BackwardInput)) and c < num_chunks - 1:
        return RecvGrad((c + 1) % pp_size, c + 1, mb)
    return None


def produces(action: Compute, pp_size: int, num_chunks: int):
    """The send that carries a computation's result on (None: nothing to send)."""
    c, mb = action.chunk, action.mb
    if isinstance(action, Forward) and c < num_chunks - 1:
        return SendAct((c + 1) % pp_size, c, mb)
    if isinstance(action, (Backward, BackwardInput)) and c > 0:
        return SendGrad((c - 1) % pp_size, c, mb)
    return None


def _rounds(steps, pp_size: int, num_chunks: int) -> List[List[Action]]:
    """Run per-rank steps in synchronous rounds and insert the communication (see ``lower``)."""
    pcs, lowered = [0] * len(steps), [[] for _ in steps]
    arrived = set()  # (rank, message, chunk, mb) received in an earlier round
    while any(pc < len(order) for pc, order in zip(pcs, steps)):
        sent = []
        for rank, order in enumerate(steps):
            step = order[pcs[rank]] if pcs[rank] < len(order) else ()
            needs = [consumes(action, pp_size, num_chunks) for action in step]
            if step and all(need is None or (rank, need.message, need.chunk, need.mb) in arrived
                            for need in needs):
                lowered[rank] += step
                pcs[rank] += 1
                sent += [(rank, produces(action, pp_size, num_chunks)) for action in step]
        if not sent:
            raise ValueError("pipeline schedule: the computation orders wait on each other in "
                             "a cycle; next on each rank: " + ", ".join(
                                 f"rank {r}: {o[pcs[r]]}" for r, o in enumerate(steps)
                                 if pcs[r] < len(o)))
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
          vpp_size: int) -> List[List[Action]]:
    """Insert the communication into per-rank computation orders, in rounds.

    The ranks step through synchronous rounds: in a round each rank runs its next step
    (one computation, or a tuple of them run back to back) if every message it needs
    arrived in an earlier round; then every rank posts one ``Exchange`` with what it
    produced this round and what its neighbours produced for it (a lone operation stays a
    plain send or receive). A round's exchanges pair only with each other, so they cannot
    wait on one another in a cycle, and both ends list the messages of one channel in the
    same order (sorted by kind, chunk, micro-batch). This is Megatron's
    ``send_forward_recv_backward`` pattern, derived instead of written case by case.

    Args:
        steps: per pipeline rank, its computations in order; a tuple is one round's work.
        pp_size: pipeline ranks.
        vpp_size: chunks per rank.

    Raises:
        ValueError: the orders wait on each other in a cycle (no round makes progress).
    """
    steps = [[s if isinstance(s, tuple) else (s,) for s in order] for order in steps]
    return _rounds(steps, pp_size, pp_size * vpp_size)


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


def _alternate(forwards, backwards, warmup: int, backward_type=None, paired=False):
    """``warmup`` forwards, then one forward / one backward, then the remaining backwards.

    With ``paired`` each steady forward and backward form one round (a tuple).
    """
    backward_type = backward_type or Backward
    order = [Forward(*key) for key in forwards[:warmup]]
    for f_key, b_key in zip(forwards[warmup:], backwards):
        pair = (Forward(*f_key), backward_type(*b_key))
        order += [pair] if paired else list(pair)
    return order + [backward_type(*key) for key in backwards[len(forwards) - warmup:]]


def one_f_one_b(pp_size: int, num_micro_batches: int) -> List[List[Action]]:
    """1F1B (PipeDream-flush): rank r runs min(p - r - 1, m) forwards, then alternates.

    Args:
        pp_size: pipeline ranks p.
        num_micro_batches: micro-batches per step m (any m >= 1).
    """
    _check_sizes(pp_size, 1, num_micro_batches)
    m = num_micro_batches
    steps = [_alternate([(r, i) for i in range(m)], [(r, i) for i in range(m)],
                        min(pp_size - r - 1, m)) for r in range(pp_size)]
    return lower(steps, pp_size, 1)


def interleaved_groups(pp_size: int, num_micro_batches: int) -> List[int]:
    """Sizes of the micro-batch groups that pass through all v chunks together.

    Megatron-LM uses groups of p and requires p | m. Here m splits into floor(m / p)
    groups as even as possible, larger first (m = 9, p = 4: [5, 4]): no group is smaller
    than p, so a micro-batch never comes back round to rank 0 before rank 0 is done with
    its group, and the bubble stays (p - 1) / (v m + p - 1). m < p is one group of m.
    """
    count = max(num_micro_batches // pp_size, 1)
    size, extra = divmod(num_micro_batches, count)
    return [size + 1] * extra + [size] * (count - extra)


def interleaved_order(pp_size: int, vpp_size: int, num_micro_batches: int, rank: int,
                      backward: bool) -> List[Tuple[int, int]]:
    """(global chunk, mb) in the order ``rank`` forwards (or backwards) them.

    Each group of ``interleaved_groups`` passes through the rank's v chunks in turn
    (chunk r, r + p, ... forward; the reverse backward) before the next group starts.
    """
    p, v = pp_size, vpp_size
    chunks = range(v - 1, -1, -1) if backward else range(v)
    order, start = [], 0
    for size in interleaved_groups(p, num_micro_batches):
        order += [(j * p + rank, mb) for j in chunks for mb in range(start, start + size)]
        start += size
    return order


def interleaved_warmup(pp_size: int, vpp_size: int, num_micro_batches: int, rank: int) -> int:
    """Forwards ``rank`` runs before its first backward: 2 (p - r - 1) + (v - 1) g, <= v m.

    Megatron-LM's count, with g the first group's size (p when p divides m).
    """
    p, v, m = pp_size, vpp_size, num_micro_batches
    first_group = interleaved_groups(p, m)[0]
    return min(2 * (p - rank - 1) + (v - 1) * first_group, v * m)


def interleaved_1f1b(pp_size: int, vpp_size: int, num_micro_batches: int) -> List[List[Action]]:
    """Megatron-LM's interleaved 1F1B: rank r holds chunks r, r + p, ..., r + (v - 1) p.

    Warm-up forwards (``interleaved_warmup``), then one forward and one backward per round
    in the group order of ``interleaved_order`` (with one exchange after both, as Megatron's
    ``send_forward_backward_recv_forward_backward``), then the remaining backwards. When p
    divides m this is Megatron's schedule; otherwise see ``interleaved_groups``. v = 1 is
    1F1B with a deeper warm-up.

    Args:
        pp_size: pipeline ranks p (>= 2 when v > 1).
        vpp_size: model chunks per rank v.
        num_micro_batches: micro-batches per step m (any m >= 1).
    """
    _check_sizes(pp_size, vpp_size, num_micro_batches)
    p, v, m = pp_size, vpp_size, num_micro_batches
    if p == 1 and v > 1:
        raise ValueError("pipeline schedule: interleaving needs pp_size >= 2 (with one rank "
                         "the chunks are simply consecutive layers); use vpp_size=1")
    steps = [_alternate(interleaved_order(p, v, m, r, backward=False),
                        interleaved_order(p, v, m, r, backward=True),
                        interleaved_warmup(p, v, m, r), paired=True) for r in range(p)]
    return lower(steps, p, v)


def zb_h1(pp_size: int, num_micro_batches: int) -> List[List[Action]]:
    """Zero-bubble ZB-H1 (Qi et al. 2024): 1F1B with the backward split in two.

    Rank r runs 1F1B's order with ``BackwardInput`` (what rank r - 1 waits for) in place of
    the backward, and ``BackwardWeight`` passes kept at most r behind: the later ranks
    defer their weight passes while the pipeline fills and run them where 1F1B would idle
    in the drain. Every rank holds at most p micro-batches between forward and weight pass
    (1F1B's peak, on rank 0). With equal forward, input and weight costs the step takes
    3 m + p - 1 units for m >= p: bubble (p - 1) / (3 m + p - 1).

    Args:
        pp_size: pipeline ranks p.
        num_micro_batches: micro-batches per step m.
    """
    _check_sizes(pp_size, 1, num_micro_batches)
    p, m, steps = pp_size, num_micro_batches, []
    for r in range(p):
        keys = [(r, i) for i in range(m)]
        order, pending = [], []
        for action in _alternate(keys, keys, min(p - r - 1, m), BackwardInput):
            order.append(action)
            if isinstance(action, BackwardInput):
                pending.append(BackwardWeight(action.chunk, action.mb))
                while len(pending) > r:
                    order.append(pending.pop(0))
        steps.append(order + pending)
    return lower(steps, p, 1)

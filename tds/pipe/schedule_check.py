"""Prove a pipeline schedule right before the first step runs.

``check_schedule`` takes the action lists of every pipeline rank (see ``schedules.py``) and
raises ``ValueError`` naming the rank, the action index and the action when:

1. an action is malformed or on the wrong rank (per the ``Placement``, default "loop"): a
   chunk on a rank that does not own it, a send to or receive from a peer other than the
   owner of the neighbouring chunk, a message for a local hand-off (chunks c and c + 1 on
   one rank pass their results in memory), a rank that would send to itself, an index out
   of range;
2. a rank's own order is wrong: a backward before its forward (or without the gradient it
   needs received or handed over on the rank), a forward without its input received or
   handed over, a weight pass before its input pass, a ``Backward`` and a
   ``BackwardInput`` of one (chunk, mb), a send of something not yet computed, anything
   twice, anything missing (a ``BackwardInput`` without its ``BackwardWeight`` is named by
   the input pass);
3. a send and a receive do not pair: point-to-point messages between two ranks are matched
   in posting order (NCCL ignores tags; gloo matches one tag in order), so the k-th message
   rank a sends to rank b must be the k-th that b receives from a, same kind, chunk and
   micro-batch. At pp = 2 the next and the previous stage are one rank: the activation and
   the gradient travel the same channel and must not be confused;
4. the first chunk loads micro-batches in another order than the last chunk reads their
   labels: engines read both from their data iterator in call order (the k-th chunk-0
   forward takes the k-th micro-batch's inputs, the k-th last-chunk forward the k-th one's
   labels), so the two orders must be one, or inputs meet another micro-batch's labels;
5. the ranks can deadlock. The simulation is stricter than NCCL and gloo: a send blocks
   until its receive is posted (no buffering), a rank posts the operations of one action
   at a time in list order, and an ``Exchange`` completes only together with every action
   holding one of its partner operations, all of them posted at once. A schedule that
   completes under this model completes on the real backends.
"""
from collections import defaultdict
from typing import Dict, Optional, Sequence, Tuple

from .actions import (COMPUTE, P2P_TYPES, RECVS, SENDS, Backward, BackwardInput,
                        BackwardWeight, Exchange, Forward, Placement, as_placement, consumes,
                        handoff_in, handoff_out, p2p_ops, produces)

Slot = Tuple[int, int, int]
"""(pipeline rank, action index, position inside the action's operations)."""


def _where(rank: int, index: int, action) -> str:
    return f"pipeline schedule: rank {rank} action {index} {action}"


def _expected_peer(rank: int, op, placement: Placement):
    """The peer ``op`` must name, or an error string when it is on the wrong rank."""
    c, num_chunks = op.chunk, placement.num_chunks
    low, high = (0, num_chunks - 2) if op.message == "act" else (1, num_chunks - 1)
    if not low <= c <= high:
        return f"chunk {c} has no {op.message} message (chunks {low}..{high} do)"
    sender = placement.owner(c)
    receiver = placement.owner(c + 1 if op.message == "act" else c - 1)
    if sender == receiver:
        other = c + 1 if op.message == "act" else c - 1
        return (f"is no message: chunks {c} and {other} both live on rank {sender}, which "
                f"hands the {op.message} over in memory (a local hand-off)")
    me, peer = (sender, receiver) if isinstance(op, SENDS) else (receiver, sender)
    if rank != me:
        return f"belongs on rank {me} (chunk {c} lives on rank {sender})"
    return peer


def _check_action(rank: int, index: int, action, placement: Placement, m: int):
    where, num_chunks = _where(rank, index, action), placement.num_chunks
    if isinstance(action, Exchange):
        if not action.ops or not all(isinstance(op, P2P_TYPES) for op in action.ops):
            raise ValueError(f"{where}: an Exchange holds one or more sends / receives")
        if len(set(action.ops)) != len(action.ops):
            raise ValueError(f"{where}: the same operation twice in one Exchange")
        ops = action.ops
    elif isinstance(action, COMPUTE + P2P_TYPES):
        ops = p2p_ops(action)
    else:
        raise ValueError(f"{where}: not a schedule action ({type(action).__name__})")
    if isinstance(action, COMPUTE):
        if not 0 <= action.chunk < num_chunks:
            raise ValueError(f"{where}: chunk out of range 0..{num_chunks - 1}")
        if placement.owner(action.chunk) != rank:
            raise ValueError(f"{where}: chunk {action.chunk} lives on rank "
                             f"{placement.owner(action.chunk)}, not on rank {rank}")
    for op in (action,) if isinstance(action, COMPUTE) else ops:
        if not 0 <= op.mb < m:
            raise ValueError(f"{where}: micro-batch {op.mb} out of range 0..{m - 1}")
    for op in ops:
        peer = _expected_peer(rank, op, placement)
        if isinstance(peer, str):
            raise ValueError(f"{where}: {op} {peer}")
        if op.peer == rank:
            raise ValueError(f"{where}: {op} names rank {rank} itself as its peer; a rank "
                             f"would wait on itself")
        if op.peer != peer:
            raise ValueError(f"{where}: {op} names peer rank {op.peer}, but that message "
                             f"travels between ranks {rank} and {peer}")


class _RankState:
    """What one rank has computed, received and sent so far (its own order only)."""

    def __init__(self, placement: Placement):
        self.placement = placement
        self.done = defaultdict(set)  # compute type -> {(chunk, mb)}
        self.received, self.sent = set(), set()
        self.handed = set()  # (message, chunk, mb) handed over in memory on this rank
        self.where_computed = {}

    def run(self, rank: int, index: int, action):
        where = _where(rank, index, action)
        ops = p2p_ops(action)
        for op in ops:
            key = (op.message, op.chunk, op.mb)
            if isinstance(op, SENDS):
                source = (Forward,) if op.message == "act" else (Backward, BackwardInput)
                if not any((op.chunk, op.mb) in self.done[t] for t in source):
                    raise ValueError(f"{where}: {op} sends a result not computed yet")
                if key in self.sent:
                    raise ValueError(f"{where}: {op} sent a second time")
                self.sent.add(key)
        for op in ops:  # receives land when the action completes, after its sends left
            key = (op.message, op.chunk, op.mb)
            if isinstance(op, RECVS):
                if key in self.received:
                    raise ValueError(f"{where}: {op} received a second time")
                self.received.add(key)
        if isinstance(action, COMPUTE):
            self._compute(where, action)
            self.where_computed[(type(action), action.chunk, action.mb)] = index

    def _compute(self, where: str, action):
        key, done = (action.chunk, action.mb), self.done
        backward_done = key in done[Backward] or key in done[BackwardInput]
        if key in done[type(action)]:
            raise ValueError(f"{where}: runs a second time")
        if isinstance(action, (Backward, BackwardInput)):
            if key not in done[Forward]:
                raise ValueError(f"{where}: backward before the forward of chunk "
                                 f"{action.chunk}, micro-batch {action.mb}")
            if backward_done:
                raise ValueError(f"{where}: the input gradient of chunk {action.chunk}, "
                                 f"micro-batch {action.mb} was already computed (a Backward "
                                 f"and a BackwardInput of one chunk and micro-batch)")
        if isinstance(action, BackwardWeight) and key not in done[BackwardInput]:
            raise ValueError(f"{where}: weight pass before the BackwardInput of chunk "
                             f"{action.chunk}, micro-batch {action.mb}")
        need = consumes(action, self.placement)
        if need is not None and (need.message, need.chunk, need.mb) not in self.received:
            raise ValueError(f"{where}: needs {need} first, and this rank has not received "
                             f"it yet")
        local = handoff_in(action, self.placement)
        if local is not None and local not in self.handed:
            giver = f"the output of {Forward(*local[1:])}" if local[0] == "act" else \
                f"the input gradient from the backward of chunk {local[1]}, micro-batch {local[2]}"
            raise ValueError(f"{where}: needs {giver} first, handed over on this rank (chunks "
                             f"{local[1]} and {action.chunk} share it), and it has not run yet")
        done[type(action)].add(key)
        if handoff_out(action, self.placement) is not None:
            self.handed.add(handoff_out(action, self.placement))

    def missing(self, rank: int, m: int, forward_only: bool = False):
        """First piece of work this rank never does (a message), or None."""
        for c in self.placement.chunks(rank):
            for mb in range(m):
                key, done = (c, mb), self.done
                if key not in done[Forward]:
                    return f"never runs Forward(chunk={c}, mb={mb})"
                if forward_only:
                    if any(key in done[t] for t in (Backward, BackwardInput, BackwardWeight)):
                        return f"runs a backward of chunk {c}, micro-batch {mb} in a " \
                               f"forward-only schedule"
                    send = produces(Forward(c, mb), self.placement)
                    if send is not None and (send.message, c, mb) not in self.sent:
                        return f"never sends the output of Forward(chunk={c}, mb={mb})"
                    continue
                if key not in done[Backward] and key not in done[BackwardInput]:
                    return f"never runs the backward of chunk {c}, micro-batch {mb}"
                if key in done[BackwardInput] and key not in done[BackwardWeight]:
                    index = self.where_computed[(BackwardInput, c, mb)]
                    return (f"action {index} {BackwardInput(c, mb)}: no "
                            f"BackwardWeight(chunk={c}, mb={mb}) follows it on this rank")
                for action in (Forward(c, mb), Backward(c, mb)):
                    send = produces(action, self.placement)
                    if send is not None and (send.message, c, mb) not in self.sent:
                        kind = Forward if isinstance(action, Forward) else \
                            Backward if key in done[Backward] else BackwardInput
                        index = self.where_computed[(kind, c, mb)]
                        return (f"action {index} {kind.__name__}(chunk={c}, mb={mb}): its "
                                f"result is never sent ({send} is missing)")
        return None


def _forwards_of(per_rank_actions, chunk: int, placement: Placement):
    """``[(action index, Forward)]`` of ``chunk`` on its owner, in the order it runs them."""
    rank = placement.owner(chunk)
    return rank, [(index, action) for index, action in enumerate(per_rank_actions[rank])
                  if isinstance(action, Forward) and action.chunk == chunk]


def check_micro_batch_order(per_rank_actions: Sequence[Sequence], pp_size: int,
                            num_chunks: int, placement: Optional[Placement] = None) -> None:
    """The first chunk's input loads and the last chunk's label reads see one order.

    Args:
        per_rank_actions: one action list per pipeline rank (each forward present once).
        pp_size: pipeline ranks p.
        num_chunks: chunks p v.
        placement: which rank holds which chunk (default: chunk c on rank c % p).

    Raises:
        ValueError: naming the last chunk's rank and action where the orders first differ,
            and the chunk-0 action it would be paired with.
    """
    placement = as_placement(pp_size, num_chunks, placement)
    first_rank, loads = _forwards_of(per_rank_actions, 0, placement)
    last_rank, reads = _forwards_of(per_rank_actions, num_chunks - 1, placement)
    for k, ((i, load), (j, read)) in enumerate(zip(loads, reads)):
        if load.mb != read.mb:
            raise ValueError(
                f"{_where(last_rank, j, read)}: the last chunk's forward number {k + 1} is "
                f"micro-batch {read.mb}, but chunk 0's forward number {k + 1} (rank "
                f"{first_rank} action {i} {load}) is micro-batch {load.mb}; inputs and labels "
                f"are read from the data in call order, so micro-batch {read.mb}'s inputs "
                f"would meet another micro-batch's labels: run the first and the last "
                f"chunk's forwards in the same micro-batch order")


def match_messages(per_rank_actions: Sequence[Sequence]) -> Dict[Slot, Slot]:
    """Pair every send with the receive it meets (k-th send a -> b with k-th receive on b).

    Returns:
        {slot: partner slot} for both directions.

    Raises:
        ValueError: an unpaired operation, or a pair whose kind, chunk or micro-batch differ.
    """
    sends, recvs = defaultdict(list), defaultdict(list)
    for rank, actions in enumerate(per_rank_actions):
        for index, action in enumerate(actions):
            for pos, op in enumerate(p2p_ops(action)):
                if isinstance(op, SENDS):
                    sends[(rank, op.peer)].append(((rank, index, pos), op, action))
                else:
                    recvs[(op.peer, rank)].append(((rank, index, pos), op, action))
    partner = {}
    for channel in sorted(set(sends) | set(recvs)):
        out, into = sends[channel], recvs[channel]
        for k in range(max(len(out), len(into))):
            if k >= len(into) or k >= len(out):
                (rank, index, _), op, action = out[k] if k < len(out) else into[k]
                other = channel[1] if k < len(out) else channel[0]
                raise ValueError(f"{_where(rank, index, action)}: {op} is not matched by any "
                                 f"operation on rank {other}")
            (s_slot, s_op, _), (r_slot, r_op, r_action) = out[k], into[k]
            if (s_op.message, s_op.chunk, s_op.mb) != (r_op.message, r_op.chunk, r_op.mb):
                raise ValueError(
                    f"{_where(r_slot[0], r_slot[1], r_action)}: {r_op} would receive "
                    f"{s_op} (rank {s_slot[0]} action {s_slot[1]}): messages between two "
                    f"ranks pair in posting order, so the two ranks must post them in the "
                    f"same order")
            partner[s_slot], partner[r_slot] = r_slot, s_slot
    return partner


def _component(start: int, pcs, per_rank_actions, partner):
    """Actions that must complete together with rank ``start``'s current one, or a blocker.

    Returns (ranks, None) when every partner action is posted, else (None, (rank, slot)).
    """
    ranks, todo = {start}, [start]
    while todo:
        rank = todo.pop()
        for pos in range(len(p2p_ops(per_rank_actions[rank][pcs[rank]]))):
            peer, peer_index, _ = partner[(rank, pcs[rank], pos)]
            if pcs[peer] != peer_index:
                return None, (rank, pos, peer, peer_index)
            if peer not in ranks:
                ranks.add(peer)
                todo.append(peer)
    return ranks, None


def _deadlock_message(pcs, per_rank_actions, blocked):
    lines = []
    for rank, (pos, peer, peer_index) in sorted(blocked.items()):
        action = per_rank_actions[rank][pcs[rank]]
        op, peer_actions = p2p_ops(action)[pos], per_rank_actions[peer]
        state = f"at action {pcs[peer]} {peer_actions[pcs[peer]]}" \
            if pcs[peer] < len(peer_actions) else "finished"
        lines.append(f"{_where(rank, pcs[rank], action)}: {op} waits for rank {peer}'s "
                     f"action {peer_index} {peer_actions[peer_index]}, but rank {peer} is "
                     f"{state}")
    return "pipeline schedule deadlocks:\n  " + "\n  ".join(lines)


def simulate_deadlock(per_rank_actions: Sequence[Sequence], partner: Dict[Slot, Slot]):
    """Run the schedule under strict rendezvous semantics; raise ValueError on a deadlock."""
    pcs = [0] * len(per_rank_actions)
    while True:
        for rank, actions in enumerate(per_rank_actions):  # computations never block
            while pcs[rank] < len(actions) and isinstance(actions[pcs[rank]], COMPUTE):
                pcs[rank] += 1
        waiting = [r for r, a in enumerate(per_rank_actions) if pcs[r] < len(a)]
        if not waiting:
            return
        blocked, progressed = {}, False
        for rank in waiting:
            if not (pcs[rank] < len(per_rank_actions[rank]) and
                    isinstance(per_rank_actions[rank][pcs[rank]], P2P_TYPES + (Exchange,))):
                continue  # moved on with an earlier component this round
            ranks, blocker = _component(rank, pcs, per_rank_actions, partner)
            if ranks is None:
                blocked[blocker[0]] = blocker[1:]
                continue
            for r in ranks:
                pcs[r] += 1
            progressed = True
        if not progressed:
            raise ValueError(_deadlock_message(pcs, per_rank_actions, blocked))


def check_schedule(per_rank_actions: Sequence[Sequence], pp_size: int, vpp_size: int,
                   num_micro_batches: int, placement: Optional[Placement] = None,
                   forward_only: bool = False) -> None:
    """Prove a schedule complete, well paired, in one micro-batch order for inputs and labels,
    and deadlock-free (see the module docstring).

    Args:
        per_rank_actions: one action list per pipeline rank.
        pp_size: pipeline ranks p.
        vpp_size: chunks per rank v (p * v chunks in all).
        num_micro_batches: micro-batches m per step; each (chunk, mb) runs exactly once.
        placement: which rank holds which chunk (default ``Placement.loop(p, v)``: chunk c
            on rank c % p); must agree with p and v.
        forward_only: an evaluation schedule (every forward, no backward).

    Raises:
        ValueError: naming the rank, the action index and the action (and, for a deadlock,
            where each peer stands).
    """
    if len(per_rank_actions) != pp_size:
        raise ValueError(f"pipeline schedule: {len(per_rank_actions)} action lists for "
                         f"pp_size {pp_size}; give one per pipeline rank")
    placement = as_placement(pp_size, pp_size * vpp_size, placement)
    for rank, actions in enumerate(per_rank_actions):
        state = _RankState(placement)
        for index, action in enumerate(actions):
            _check_action(rank, index, action, placement, num_micro_batches)
            state.run(rank, index, action)
        missing = state.missing(rank, num_micro_batches, forward_only)
        if missing:
            raise ValueError(f"pipeline schedule: rank {rank} {missing}")
    check_micro_batch_order(per_rank_actions, pp_size, placement.num_chunks, placement)
    simulate_deadlock(per_rank_actions, match_messages(per_rank_actions))

"""ZB-V's computation order: a unit-cost list schedule over the V placement.

``schedules.zbv`` lowers what ``best_zbv_order`` returns. Each chunk pass (``Forward``,
``BackwardInput``, ``BackwardWeight``) costs one round and a result is usable the round
after, as in ``schedules.lower``; every rank greedily runs what is ready, within ZB-V's
memory bound (at most 2p chunk-micro-batches between forward and weight pass: 1F1B's p
stage activations). Three priority variants are scheduled and the shortest kept.
"""
from typing import List, Optional, Tuple

from .actions import BackwardInput, BackwardWeight, Compute, Forward, Placement


class _ZbvRank:
    """One rank of ZB-V's unit-cost list schedule (``zbv_order``): its counters and order."""

    def __init__(self, placement: Placement, rank: int, m: int, down_cap: int,
                 backward_first: bool):
        self.down, self.up = placement.chunks(rank)
        self.last, self.m, self.bound = placement.num_chunks - 1, m, 2 * placement.pp_size
        self.down_cap, self.backward_first = down_cap, backward_first
        self.next_f, self.next_b = {self.down: 0, self.up: 0}, {self.down: 0, self.up: 0}
        self.weights: List[BackwardWeight] = []  # waiting, oldest first
        self.held = self.held_down = 0  # chunk-mbs forwarded whose weight pass is still due
        self.order: List[Compute] = []

    def _backward(self, ready):
        for c in sorted((self.down, self.up), key=lambda c: (self.next_b[c], c)):
            mb = self.next_b[c]
            if mb < self.m and ready("F", c, mb) and (c == self.last or ready("B", c + 1, mb)):
                return BackwardInput(c, mb)
        return None

    def _forward(self, ready):
        for c in (self.up, self.down):  # the up leg first: micro-batches reach the loss early
            mb = self.next_f[c]
            room = self.held < self.bound and (c == self.up or self.held_down < self.down_cap)
            if mb < self.m and room and (c == 0 or ready("F", c - 1, mb)):
                return Forward(c, mb)
        return None

    def pick(self, ready) -> Optional[Compute]:
        """This round's computation: a ready input pass or forward (in the variant's order),
        else the oldest waiting weight pass, else None (idle)."""
        first, then = (self._backward, self._forward) if self.backward_first else \
            (self._forward, self._backward)
        action = first(ready) or then(ready)
        return action if action is not None else (self.weights[0] if self.weights else None)

    def run(self, action: Compute) -> str:
        """Record ``action``; return its kind "F", "B" or "W"."""
        self.order.append(action)
        down = action.chunk == self.down
        if isinstance(action, Forward):
            self.next_f[action.chunk] += 1
            self.held, self.held_down = self.held + 1, self.held_down + down
            return "F"
        if isinstance(action, BackwardInput):
            self.next_b[action.chunk] += 1
            self.weights.append(BackwardWeight(action.chunk, action.mb))
            return "B"
        self.weights.remove(action)
        self.held, self.held_down = self.held - 1, self.held_down - down
        return "W"


def zbv_order(pp_size: int, num_micro_batches: int, backward_first: bool = True,
              staggered_cap: bool = False) -> Tuple[List[List[Compute]], int]:
    """ZB-V's computation order per rank from a unit-cost list schedule, and its length.

    Every ``Forward``, ``BackwardInput`` and ``BackwardWeight`` of a chunk takes one round;
    a result is usable the round after. In each round every rank runs a ready input pass
    or forward (``backward_first`` says which first; forwards prefer the up leg), else its
    oldest waiting weight pass, else idles. A forward needs room: at most 2p chunk-mbs per
    rank between forward and weight pass (1F1B's p stage activations), and at most
    2p - 1 (``staggered_cap``: 2p - 1 - rank) of them on the down leg, so an up-leg forward
    can always enter and the ranks cannot fill up with work that waits on itself.

    Args:
        pp_size: pipeline ranks p (>= 2).
        num_micro_batches: micro-batches m (>= 1).
        backward_first: ready input passes before ready forwards.
        staggered_cap: the down-leg cap shrinks with the rank.

    Returns:
        (per-rank computation orders for ``lower``, rounds the schedule takes).
    """
    placement, p = Placement.v_shape(pp_size), pp_size
    ranks = [_ZbvRank(placement, r, num_micro_batches, 2 * p - 1 - (r if staggered_cap else 0),
                      backward_first) for r in range(p)]
    finished: dict = {}  # (kind, chunk, mb) -> round it ran in
    total, done, t = 3 * placement.num_chunks * num_micro_batches, 0, 0
    while done < total:
        def ready(kind, c, mb, now=t):
            return finished.get((kind, c, mb), now) < now

        picks = [rank.pick(ready) for rank in ranks]
        if all(action is None for action in picks):
            raise ValueError(f"ZB-V list schedule stalled at round {t} (p={p}, "
                             f"m={num_micro_batches}); this is a bug in zbv_order")
        for rank, action in zip(ranks, picks):
            if action is not None:
                finished[(rank.run(action), action.chunk, action.mb)] = t
                done += 1
        t += 1
    return [rank.order for rank in ranks], t


ZBV_VARIANTS = ((True, False), (False, True), (False, False))
"""``(backward_first, staggered_cap)`` of ``zbv_order``, tried in this order: input passes
first with down-leg cap 2p - 1 (issue 37's suggestion), then forwards first with cap
2p - 1 - r, then forwards first with cap 2p - 1. Each alone misses the least step for a
few (p, m) (the first from p = 5 on, by up to 8 rounds at p <= 12); together they reach
it for every m >= p tested (p <= 12, m <= 4p + 2)."""


def best_zbv_order(pp_size: int, num_micro_batches: int) -> List[List[Compute]]:
    """The shortest of ``zbv_order``'s variants (``ZBV_VARIANTS``; the first on a tie).

    Args:
        pp_size: pipeline ranks p (>= 2).
        num_micro_batches: micro-batches m (>= 1).
    """
    orders = [zbv_order(pp_size, num_micro_batches, *variant) for variant in ZBV_VARIANTS]
    return min(orders, key=lambda order: order[1])[0]

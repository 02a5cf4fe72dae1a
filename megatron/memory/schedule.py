"""How many micro-batches' activations each pipeline rank holds at once.

Counted on the schedules' own computation orders (tds/pipe/schedules.py): the most forwards
a rank has run whose backward has not run yet (under a zero-bubble schedule, whose weight
pass has not run yet: until then the store keeps each deferred GEMM's input and output
gradient, about what the chunk saved). For 1F1B that is ``min(p - r, m)`` on rank r; with
several chunks per rank (interleaved, ZB-V) it is counted in model chunks. The walk itself
is :mod:`.walk`'s, which also weighs each moment in bytes.
"""
from functools import lru_cache
from typing import List

from .walk import rank_walks


def schedule_name(vpp: int, schedule: str = "") -> str:
    """The schedule of a layout: the name given, else interleaved for vpp > 1, else 1f1b."""
    return schedule or ("interleaved" if vpp > 1 else "1f1b")


@lru_cache(maxsize=256)
def in_flight(pp: int, num_micro_batches: int, vpp: int = 1, schedule: str = "") -> List[int]:
    """Per pipeline rank: the most (chunk, micro-batch) forwards alive at once.

    Args:
        pp: pipeline ranks.
        num_micro_batches: micro-batches per step.
        vpp: model chunks per rank (1: 1F1B or ZB-H1).
        schedule: the schedule's name (default: what vpp implies).
    """
    if pp == 1:
        return [1]  # forward and backward of one micro-batch at a time
    walks = rank_walks(schedule_name(vpp, schedule), pp, vpp, num_micro_batches)
    return [int(w.after[:, :2 * vpp].sum(axis=1).max()) for w in walks]

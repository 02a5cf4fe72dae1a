"""How many micro-batches' activations each pipeline rank holds at once, and the bubble.

Counted on the schedules' own action lists (tds/pipe/schedules.py, ``build_schedule``): the
most forwards a rank has run whose backward has not run yet (under a zero-bubble schedule,
whose weight pass has not run yet: until then the store keeps each deferred GEMM's input and
output gradient, about what the chunk saved). For 1F1B that is ``min(p - r, m)`` on rank r;
with several chunks per rank (interleaved, ZB-V) it is counted in model chunks.
"""
from functools import lru_cache
from typing import List, Tuple


def schedule_name(vpp: int, schedule: str = "") -> str:
    """The schedule of a layout: the name given, else interleaved for vpp > 1, else 1f1b."""
    return schedule or ("interleaved" if vpp > 1 else "1f1b")


@lru_cache(maxsize=64)
def rank_actions(pp: int, num_micro_batches: int, vpp: int, schedule: str = ""):
    """``(schedules module, per-rank action lists, placement)`` of a pipelined layout."""
    from tds.pipe import schedules  # here: importing tds starts DeepSpeed

    actions, placement = schedules.build_schedule(schedule_name(vpp, schedule), pp, vpp,
                                                  num_micro_batches)
    return schedules, actions, placement


def _held_peaks(pp: int, num_micro_batches: int, vpp: int, schedule: str,
                chunk_bytes: Tuple[int, ...], deferred: Tuple[int, ...] = ()) -> List[int]:
    """Per rank: the most bytes held at once, a (chunk, micro-batch) holding its
    ``chunk_bytes`` from its forward to its backward (zero bubble: to its input pass, then
    its ``deferred`` bytes to its weight pass; without them, ``chunk_bytes`` until then)."""
    schedules, actions, _ = rank_actions(pp, num_micro_batches, vpp, schedule)
    deferred = deferred or chunk_bytes
    peaks = []
    for one_rank in actions:
        alive = most = 0
        for action in one_rank:
            c = getattr(action, "chunk", None)
            if isinstance(action, schedules.Forward):
                alive += chunk_bytes[c]
            elif isinstance(action, schedules.Backward):
                alive -= chunk_bytes[c]
            elif isinstance(action, schedules.BackwardInput):
                alive += deferred[c] - chunk_bytes[c]
            elif isinstance(action, schedules.BackwardWeight):
                alive -= deferred[c]
            most = max(most, alive)
        peaks.append(most)
    return peaks


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
    return _held_peaks(pp, num_micro_batches, vpp, schedule, (1,) * (pp * vpp))


@lru_cache(maxsize=256)
def activation_peaks(pp: int, num_micro_batches: int, vpp: int,
                     chunk_bytes: Tuple[int, ...], schedule: str = "",
                     deferred: Tuple[int, ...] = ()) -> List[int]:
    """Per pipeline rank: the most activation bytes alive at once, walking its actions with
    each (chunk, micro-batch) forward adding its own chunk's bytes until its backward (the
    embedding's and the head's chunks weigh what they hold, not an average).

    Args:
        pp: pipeline ranks.
        num_micro_batches: micro-batches per step.
        vpp: model chunks per rank.
        chunk_bytes: bytes one micro-batch saves in each global chunk (``pp x vpp``).
        schedule: the schedule's name (default: what vpp implies).
        deferred: zero bubble: bytes each global chunk keeps from its input pass to its
            weight pass (:func:`.deferred.deferred_bytes`; default: ``chunk_bytes``).
    """
    return _held_peaks(pp, num_micro_batches, vpp, schedule, chunk_bytes, deferred)


def rank_chunks(pp: int, vpp: int, schedule: str = "") -> List[Tuple[int, ...]]:
    """Per pipeline rank, its global chunks (the schedule's placement: a loop, or ZB-V's V)."""
    if pp == 1 or vpp == 1:
        return [(rank,) for rank in range(pp)]
    from tds.pipe.schedules import Placement  # here: importing tds starts DeepSpeed

    kind = "v" if schedule_name(vpp, schedule) == "zbv" else "loop"
    placement = Placement(pp, vpp, kind)
    return [placement.chunks(rank) for rank in range(pp)]

"""How many micro-batches' activations each pipeline rank holds at once, and the bubble.

Counted on the schedules' own action lists (tds/pipe/schedules.py): the most forwards a
rank has run whose backward has not run yet. For 1F1B that is ``min(p - r, m)`` on rank r;
for the interleaved schedule it is counted in model chunks (each ``1 / v`` of the rank's
layers).
"""
from functools import lru_cache
from typing import List, Sequence, Tuple



@lru_cache(maxsize=256)
def in_flight(pp: int, num_micro_batches: int, vpp: int = 1) -> List[int]:
    """Per pipeline rank: the most (chunk, micro-batch) forwards alive at once.

    Args:
        pp: pipeline ranks.
        num_micro_batches: micro-batches per step.
        vpp: model chunks per rank (1: 1F1B).
    """
    if pp == 1:
        return [1]  # forward and backward of one micro-batch at a time
    from tds.pipe import schedules  # here: importing tds starts DeepSpeed

    if vpp == 1:
        actions = schedules.one_f_one_b(pp, num_micro_batches)
    else:
        actions = schedules.interleaved_1f1b(pp, vpp, num_micro_batches)
    counts = []
    for rank_actions in actions:
        alive = most = 0
        for action in rank_actions:
            if isinstance(action, schedules.Forward):
                alive += 1
                most = max(most, alive)
            elif isinstance(action, (schedules.Backward, schedules.BackwardInput)):
                alive -= 1
        counts.append(most)
    return counts


def _actions(pp: int, num_micro_batches: int, vpp: int):
    from tds.pipe import schedules  # here: importing tds starts DeepSpeed

    if vpp == 1:
        return schedules, schedules.one_f_one_b(pp, num_micro_batches)
    return schedules, schedules.interleaved_1f1b(pp, vpp, num_micro_batches)


@lru_cache(maxsize=256)
def activation_peaks(pp: int, num_micro_batches: int, vpp: int,
                     chunk_bytes: Tuple[int, ...]) -> List[int]:
    """Per pipeline rank: the most activation bytes alive at once, walking its actions with
    each (chunk, micro-batch) forward adding its own chunk's bytes until its backward (the
    embedding's and the head's chunks weigh what they hold, not an average).

    Args:
        pp: pipeline ranks.
        num_micro_batches: micro-batches per step.
        vpp: model chunks per rank.
        chunk_bytes: bytes one micro-batch saves in each global chunk (``pp x vpp``).
    """
    schedules, actions = _actions(pp, num_micro_batches, vpp)
    peaks = []
    for rank_actions in actions:
        alive = most = 0
        for action in rank_actions:
            if isinstance(action, schedules.Forward):
                alive += chunk_bytes[action.chunk]
                most = max(most, alive)
            elif isinstance(action, (schedules.Backward, schedules.BackwardInput)):
                alive -= chunk_bytes[action.chunk]
        peaks.append(most)
    return peaks


def bubble_fraction(pp: int, num_micro_batches: int, vpp: int = 1) -> float:
    """Idle share of a step: ``(p - 1) / (v m + p - 1)`` (Narayanan et al. 2021).

    Args:
        pp: pipeline ranks.
        num_micro_batches: micro-batches per step.
        vpp: model chunks per rank.
    """
    return (pp - 1) / (vpp * num_micro_batches + pp - 1)

"""When in a step a rank's weight gradients exist, against its activations.

DeepSpeed's engine frees every ``.grad`` after the optimizer step (``zero_grad`` with
``set_to_none``; ZeRO-1 and the BF16_Optimizer keep their flat buffers, counted as optimizer
state), so a rank allocates its gradients again during its first backward of the next step.
A rank whose activations peak before that backward (1F1B's first stage when the step has no
more micro-batches than stages, an interleaved rank whose warm-up is all its forwards) never
holds both at their largest; interleaved, a chunk's gradients appear with its own first
backward, so the first chunks' come late. Counted on tds's own action lists
(tds/pipe/schedules.py), as :mod:`.schedule` counts the in-flight micro-batches.
"""
from functools import lru_cache
from typing import List, Sequence, Tuple

from .spec import MemorySpec


@lru_cache(maxsize=256)
def with_grads_peaks(pp: int, num_micro_batches: int, vpp: int, chunk_bytes: Tuple[int, ...],
                     chunk_grads: Tuple[int, ...]) -> List[Tuple[int, int]]:
    """Per pipeline rank: the most activation bytes alive at once, and the most activation
    and gradient bytes alive at once, a chunk's gradients appearing with its first backward
    of the step (all of the rank's at once under 1F1B, one chunk's at a time interleaved).

    Args:
        pp: pipeline ranks.
        num_micro_batches: micro-batches per step.
        vpp: model chunks per rank (1: 1F1B).
        chunk_bytes: bytes one micro-batch saves in each global chunk (``pp x vpp``).
        chunk_grads: gradient bytes of each global chunk.
    """
    if pp == 1:  # forward and backward of one micro-batch at a time
        later = chunk_bytes[0] if num_micro_batches > 1 else 0
        return [(chunk_bytes[0], max(chunk_bytes[0], later + chunk_grads[0]))]
    from tds.pipe import schedules  # here: importing tds starts DeepSpeed

    actions = schedules.one_f_one_b(pp, num_micro_batches) if vpp == 1 else \
        schedules.interleaved_1f1b(pp, vpp, num_micro_batches)
    out = []
    for rank_actions in actions:
        alive = grads = most = most_with_grads = 0
        started = set()
        for action in rank_actions:
            if isinstance(action, schedules.Forward):
                alive += chunk_bytes[action.chunk]
            elif isinstance(action, (schedules.Backward, schedules.BackwardInput)):
                alive -= chunk_bytes[action.chunk]
            if isinstance(action, (schedules.Backward, schedules.BackwardWeight)) and \
                    action.chunk not in started:  # weight gradients: the W pass when split
                started.add(action.chunk)
                grads += chunk_grads[action.chunk]
            most = max(most, alive)
            most_with_grads = max(most_with_grads, alive + grads)
        out.append((most, most_with_grads))
    return out


def grads_freed_each_step(spec: MemorySpec) -> bool:
    """The engine sets every ``.grad`` to None after its step (no ZeRO, or ZeRO-1); ZeRO-2
    keeps a partitioned gradient buffer, and torch DDP's buckets are counted as buffers.

    Args:
        spec: the run.
    """
    return spec.backend == "engine" and spec.zero_stage <= 1


def late_grads(spec: MemorySpec, per_rank: Sequence[Tuple[int, int]],
               rank_grads: int, rank: int) -> int:
    """Gradient bytes not yet allocated when ``rank``'s activations peak: what the model's
    ``states + activations`` overcounts the rank's most activations and gradients at once.

    Args:
        spec: the run.
        per_rank: :func:`with_grads_peaks`'s figures.
        rank_grads: the rank's gradient bytes (the sum of its chunks').
        rank: the pipeline rank.
    """
    if not grads_freed_each_step(spec):
        return 0
    most, most_with_grads = per_rank[rank]
    return max(0, most + rank_grads - most_with_grads)

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

from .schedule import rank_actions
from .spec import MemorySpec


@lru_cache(maxsize=256)
def with_grads_peaks(pp: int, num_micro_batches: int, vpp: int, chunk_bytes: Tuple[int, ...],
                     chunk_grads: Tuple[int, ...], schedule: str = "",
                     gemm_grads: Tuple[int, ...] = ()) -> List[Tuple[int, int]]:
    """Per pipeline rank: the most activation bytes alive at once, and the most activation
    and gradient bytes alive at once, a chunk's gradients appearing with its first backward
    of the step (all of the rank's at once under 1F1B, one chunk's at a time interleaved).

    Args:
        pp: pipeline ranks.
        num_micro_batches: micro-batches per step.
        vpp: model chunks per rank (1: 1F1B).
        chunk_bytes: bytes one micro-batch saves in each global chunk (``pp x vpp``).
        chunk_grads: gradient bytes of each global chunk.
        schedule: the schedule's name (default: what vpp implies); under a zero-bubble one
            a (chunk, micro-batch) is held until its weight pass.
        gemm_grads: zero bubble: of each chunk's gradient bytes, those of the weights its
            weight pass makes (they appear at its first weight pass, the rest at its first
            input pass; :func:`.deferred.gemm_weight_params`).
    """
    if pp == 1:  # forward and backward of one micro-batch at a time
        later = chunk_bytes[0] if num_micro_batches > 1 else 0
        return [(chunk_bytes[0], max(chunk_bytes[0], later + chunk_grads[0]))]
    schedules, actions, _ = rank_actions(pp, num_micro_batches, vpp, schedule)
    gemm_grads = gemm_grads or (0,) * len(chunk_grads)
    first = {schedules.Backward: lambda c: chunk_grads[c],
             schedules.BackwardInput: lambda c: chunk_grads[c] - gemm_grads[c],
             schedules.BackwardWeight: lambda c: gemm_grads[c]}
    out = []
    for one_rank in actions:
        alive = grads = most = most_with_grads = 0
        started = set()
        for action in one_rank:
            if isinstance(action, schedules.Forward):
                alive += chunk_bytes[action.chunk]
            elif isinstance(action, (schedules.Backward, schedules.BackwardWeight)):
                alive -= chunk_bytes[action.chunk]
            kind = type(action)
            if kind in first and (kind, action.chunk) not in started:
                started.add((kind, action.chunk))  # a chunk's gradients at its first pass
                grads += first[kind](action.chunk)
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

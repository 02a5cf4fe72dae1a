"""The planner's ranking in seconds: every candidate layout, with the same figures as
evaluating each in full (:func:`.planner.evaluate`), but

- **pruned by a bound**: a layout's peak is at least its states plus the optimizer step's
  temporaries (:func:`states_bound`), which depend on neither the micro-batch, the
  recompute nor the schedule's order; a layout whose bound exceeds the memory is never
  evaluated further (one bound per group of layouts that share it);
- **walked once per schedule**: the layouts that share a ``(schedule, p, v, m)`` share its
  walk (:func:`~.walk.rank_walks`), and their peaks are one matrix product per rank over
  all of them (:func:`_group_peaks`) instead of one walk per layout;
- **chunks computed once**: each distinct chunk's bytes once per layout
  (:func:`~.chunks.part_bytes`), the partition once per (layers, pp, v);
- **timed only if they fit**: the step time of the layouts that fit, each stage's layer
  time computed once per layout.
"""
from collections import defaultdict
from dataclasses import replace
from typing import Dict, List, Sequence, Tuple

import numpy as np

from .chunks import chunk_bytes, rank_states, stage_layout
from .plans import Hardware, Plan, plan_of
from .report import stage_memory
from .spec import MemorySpec
from .walk import ChunkBytes, RankPeaks, RankWalk, rank_walks


def states_bound(spec: MemorySpec) -> int:
    """The largest ``states + optimizer step temporaries`` over the ranks: a lower bound of
    the layout's peak (``StageMemory.peak >= step_peak``)."""
    return max(states.total + step for states, step in rank_states(spec))


def fitting_plans(specs: Sequence[MemorySpec], hw: Hardware, step_flops: float) -> List[Plan]:
    """The :class:`~.planner.Plan` of every layout of ``specs`` that fits in ``hw.usable``
    (unsorted), each with the figures :func:`~.planner.evaluate` gives it.

    Args:
        specs: the candidate layouts.
        hw: the cluster.
        step_flops: model FLOPs of one step.
    """
    groups: Dict[tuple, List[MemorySpec]] = defaultdict(list)
    for spec in specs:
        spec.check()
        if states_bound(spec) <= hw.usable:
            key = (spec.pipeline_schedule if spec.pp > 1 else "", spec.pp, spec.vpp,
                   spec.num_micro_batches)
            groups[key].append(spec)
    plans = []
    for key, members in groups.items():
        stages = _group_stages(rank_walks(*key), members)
        for spec, memory in zip(members, stages):
            if max(s.peak for s in memory) <= hw.usable:
                plans.append(plan_of(spec, memory, hw, step_flops))
    return plans


def _group_stages(walks: Tuple[RankWalk, ...], members: List[MemorySpec]):
    """Per member, its ``StageMemory`` list: the walk's rows times every member's weights."""
    weights = [chunk_bytes(spec, stage_layout(spec).parts) for spec in members]
    held = _Weights([cb for _, cb in weights])
    saved = _Weights([replace(cb, saved=s) for s, cb in weights])
    states = [rank_states(spec) for spec in members]
    out = [[] for _ in members]
    for rank, walk in enumerate(walks):
        with_held = _group_peaks(walk, held)
        saved_peaks = _group_peaks(walk, saved)
        for i, spec in enumerate(members):
            out[i].append(stage_memory(spec, rank, weights[i][0], with_held[i],
                                       saved_peaks[i].activations, states[i]))
    return out


class _Weights:
    """Many layouts' :class:`~.walk.ChunkBytes` as ``[layouts, chunks]`` arrays, one per
    column block of :data:`~.walk.BLOCKS` (``after``: the first five; ``extra``: all ten)."""

    def __init__(self, cbs: List[ChunkBytes]):
        def block(field, default=0):
            return np.array([getattr(cb, field) or (default,) * len(cb.saved) for cb in cbs],
                            dtype=np.int64)

        saved, deferred, grads, gemm = (block(f) for f in ("saved", "deferred", "grads",
                                                           "gemm_grads"))
        transient, first, forward, tw = (block(f) for f in (
            "transient", "transient_first", "forward", "weight_pass"))
        self.after = [saved, deferred, grads, grads - gemm, gemm]
        self.extra = self.after + [transient, first - transient, forward, tw, gemm - tw]

    def rank(self, chunks: Tuple[int, ...]):
        """``(after [K, 5v], extra [K, 10v])`` weights of a rank holding ``chunks``."""
        index = list(chunks)
        return (np.concatenate([b[:, index] for b in self.after], axis=1),
                np.concatenate([b[:, index] for b in self.extra], axis=1))


def _group_peaks(walk: RankWalk, weights: _Weights) -> List[RankPeaks]:
    """:func:`~.walk.peaks` of one rank for many layouts at once."""
    v = len(walk.chunks)
    after_w, extra_w = weights.rank(walk.chunks)
    after = walk.after[:, :5 * v]
    alive = (after[:, :2 * v] @ after_w[:, :2 * v].T).max(axis=0)
    with_grads = (after @ after_w.T).max(axis=0)
    moments = (walk.extra @ extra_w.T).max(axis=0) if len(walk.extra) else with_grads
    in_flight = int(walk.after[:, :2 * v].sum(axis=1).max())
    return [RankPeaks(int(a), int(g), int(max(x, g)), in_flight)
            for a, g, x in zip(alive, with_grads, moments)]

"""A pipeline schedule's memory moments, as small integer matrices, once per schedule.

What a rank holds at any moment of a step is linear in a few per-chunk byte counts: the
(chunk, micro-batch) forwards whose backward (zero bubble: input pass) has not run keep
the chunk's saved activations ``a``; under a zero-bubble schedule those whose input pass
ran but whose weight pass has not keep the deferred GEMM operands ``d``; a chunk's
gradients exist from its first backward (zero bubble: the non-GEMM ones from its first
input pass, the GEMM ones from its first weight pass); a backward holds its chunk's
transient ``tr`` on top of what was alive before it, a forward its ``tf`` (the loss's
16-bit logits copy) on top of what is alive after it. So each rank's walk through its
actions is a set of integer rows (counts and flags per local chunk), and any byte counts
give the rank's peaks as the largest row-vector product (:func:`peaks`): the walk is made
once per ``(schedule, p, v, m)`` and reused by every layout that shares it.

The orders are tds's (:func:`tds.pipe.schedules.compute_orders`, what the engine runs),
built here on arrays in the same order (ZB-V's list schedule in :mod:`.walk_zbv`;
tests/test_planner_fast.py checks every one against tds's).
"""
from dataclasses import dataclass
from functools import lru_cache
from typing import List, Sequence, Tuple

import numpy as np

from .walk_zbv import BI, B, F, W, zbv_orders  # noqa: F401  (the action kinds)
#: Column blocks of a moment row, each ``v`` wide (one column per local chunk).
BLOCKS = ("alive", "deferred", "grads_b", "grads_bi", "grads_w", "transient", "first",
          "forward", "weight_pass", "weight_first")


@dataclass(frozen=True)
class RankWalk:
    """One rank's moments: unique rows over :data:`BLOCKS` (``10 v`` columns).

    ``after``: the state after each action (its last five blocks zero); ``extra``: before
    each backward (or input pass) with that chunk's transient flag (and its ``first`` flag
    when the chunk's gradients are not made yet), after each forward with its forward flag,
    and before each weight pass with its flags.
    """

    after: np.ndarray
    extra: np.ndarray
    chunks: Tuple[int, ...]
    """The rank's global chunks, in local order (column j is chunk ``chunks[j]``)."""


def _one_f_one_b(p: int, m: int, backward: int = B) -> np.ndarray:
    """Kinds ``[p, 2m]`` of 1F1B: rank r runs min(p - r - 1, m) forwards, then alternates."""
    t = np.arange(2 * m)[None, :]
    w = np.minimum(p - 1 - np.arange(p), m)[:, None]
    steady = (t >= w) & (t < 2 * m - w)
    return np.where(t < w, F, np.where(steady, np.where((t - w) % 2 == 0, F, backward),
                                       backward))


def _zb_h1(p: int, m: int) -> np.ndarray:
    """Kinds ``[p, 3m]`` of ZB-H1 (tds's ``zb_h1``): 1F1B with input passes, a rank r
    running its k-th weight pass right after its (k + r)-th input pass, the last r at the
    end."""
    base = _one_f_one_b(p, m, BI)
    out = np.empty((p, 3 * m), dtype=np.int64)
    for r in range(p):
        kinds = base[r]
        index = np.cumsum(kinds == BI)  # k-th input pass (1-based) at its position
        counts = np.where((kinds == BI) & (index > r), 2, 1)
        row = np.repeat(kinds, counts)
        starts = np.cumsum(counts) - counts
        row[(starts + 1)[counts == 2]] = W
        out[r] = np.concatenate([row, np.full(3 * m - len(row), W)])
    return out


def _interleaved(p: int, v: int, m: int):
    """Kinds and local chunks ``[p, 2 v m]`` of tds's interleaved 1F1B."""
    from tds.pipe.schedules import interleaved_groups, interleaved_warmup

    groups = interleaved_groups(p, m)
    fwd = np.concatenate([np.repeat(np.arange(v), g) for g in groups])
    bwd = np.concatenate([np.repeat(np.arange(v)[::-1], g) for g in groups])
    warmup = [interleaved_warmup(p, v, m, r) for r in range(p)]
    t = np.arange(2 * v * m)[None, :]
    w = np.array(warmup)[:, None]
    steady = (t >= w) & (t < 2 * v * m - w)
    kinds = np.where(t < w, F, np.where(steady, np.where((t - w) % 2 == 0, F, B), B))
    chunks = np.empty_like(kinds)
    for r in range(p):
        chunks[r, kinds[r] == F] = fwd
        chunks[r, kinds[r] == B] = bwd
    return kinds, chunks


def _from_tds(name: str, p: int, v: int, m: int, lowered: bool = False):
    """Kinds and local chunks from tds's own orders (ZB-V's list schedule); ``lowered``:
    from the action lists the engine runs (``build_schedule``, communication left out)."""
    from tds.pipe import schedules

    kind_of = {schedules.Forward: F, schedules.Backward: B, schedules.BackwardInput: BI,
               schedules.BackwardWeight: W}
    mine = rank_chunks(p, v, name)
    if lowered:
        orders = [[a for a in actions if type(a) in kind_of]
                  for actions in schedules.build_schedule(name, p, v, m)[0]]
    else:
        orders = schedules.compute_orders(name, p, v, m)
    kinds = np.array([[kind_of[type(a)] for a in order] for order in orders])
    chunks = np.array([[mine[r].index(a.chunk) for a in order]
                       for r, order in enumerate(orders)])
    return kinds, chunks


def orders(name: str, p: int, v: int, m: int, reference: bool = False):
    """``(kinds [p, T], local chunks [p, T])`` of a schedule (``p == 1``: forward then
    backward of each micro-batch); ``reference``: read off tds's lowered action lists (the
    slow path the planner's ranking is checked against)."""
    if p == 1:
        return np.tile([F, B], (1, m)), np.zeros((1, 2 * m), dtype=np.int64)
    if reference:
        return _from_tds(name, p, v, m, lowered=True)
    if name == "1f1b":
        kinds = _one_f_one_b(p, m)
        return kinds, np.zeros_like(kinds)
    if name == "zb-h1":
        kinds = _zb_h1(p, m)
        return kinds, np.zeros_like(kinds)
    if name == "interleaved":
        return _interleaved(p, v, m)
    if name == "zbv":
        return zbv_orders(p, m)
    return _from_tds(name, p, v, m)


def _rank_walk(kinds: np.ndarray, chunks: np.ndarray, v: int,
               mine: Tuple[int, ...]) -> RankWalk:
    hot = np.zeros((len(kinds), v), dtype=np.int64)
    hot[np.arange(len(kinds)), chunks] = 1
    is_ = [(kinds == k)[:, None] for k in (F, B, BI, W)]
    alive = np.cumsum(hot * is_[F] - hot * (is_[B] | is_[BI]), axis=0)
    deferred = np.cumsum(hot * is_[BI] - hot * is_[W], axis=0)
    started = [np.minimum(np.cumsum(hot * is_[k], axis=0), 1) for k in (B, BI, W)]
    after = np.concatenate([alive, deferred] + started, axis=1)
    before = np.vstack([np.zeros((1, after.shape[1]), dtype=np.int64), after[:-1]])
    zeros = np.zeros((len(kinds), v), dtype=np.int64)
    backward = (is_[B] | is_[BI])[:, 0]
    # the chunk's first backward (input pass) of the step: its gradients not made yet
    made = before[:, 2 * v:3 * v] * is_[B] + before[:, 3 * v:4 * v] * is_[BI]
    first = hot * (1 - made)
    # a weight pass: its GEMMs' gradients on what was alive before it (on the chunk's
    # first, all of them are new; later, one at a time before it is added into .grad)
    weight_first = hot * (1 - before[:, 4 * v:5 * v])
    extra = np.vstack([np.hstack([before, hot, first, zeros, zeros, zeros])[backward],
                       np.hstack([after, zeros, zeros, hot, zeros, zeros])[is_[F][:, 0]],
                       np.hstack([before, zeros, zeros, zeros, hot, weight_first])[
                           is_[W][:, 0]]])
    return RankWalk(_unique_rows(np.hstack([after] + [zeros] * 5)), _unique_rows(extra), mine)


def _unique_rows(rows: np.ndarray) -> np.ndarray:
    """``np.unique(rows, axis=0)`` (the rows kept, in some order), by one int64 key per row:
    a mixed-radix number where the columns' ranges fit in 62 bits (exact), else a hash
    whose equal keys are then checked row by row (``np.unique`` itself on a collision)."""
    if not len(rows):
        return rows
    low = rows.min(axis=0)
    radix = rows.max(axis=0) - low + 1
    if float(np.prod(radix.astype(np.float64))) < 2.0 ** 62:
        place = np.concatenate([[1], np.cumprod(radix[::-1])[:-1]])[::-1].astype(np.int64)
        _, first = np.unique((rows - low) @ place, return_index=True)
        return rows[first]
    key = rows @ _HASH[:rows.shape[1]]  # wraps modulo 2^64
    order = np.argsort(key, kind="stable")
    sorted_key = key[order]
    starts = np.concatenate([[True], sorted_key[1:] != sorted_key[:-1]])
    group_first = order[starts][np.cumsum(starts) - 1]
    if (rows[order] != rows[group_first]).any():  # two different rows, one key
        return np.unique(rows, axis=0)
    return rows[order[starts]]


_HASH = np.random.default_rng(46).integers(1, 2 ** 62, size=4096, dtype=np.int64) | 1


@lru_cache(maxsize=512)
def rank_walks(name: str, p: int, v: int, m: int,
               reference: bool = False) -> Tuple[RankWalk, ...]:
    """Every rank's :class:`RankWalk` of a schedule (made once per argument set).

    Args:
        name: the schedule (1f1b, interleaved, zb-h1, zbv; anything with ``p == 1``).
        p, v, m: pipeline ranks, chunks per rank, micro-batches.
        reference: from tds's lowered action lists (:func:`orders`).
    """
    kinds, chunks = orders(name, p, v, m, reference)
    mine = rank_chunks(p, v, name)
    return tuple(_rank_walk(kinds[r], chunks[r], v, mine[r]) for r in range(p))


def rank_chunks(p: int, v: int, name: str = "") -> List[Tuple[int, ...]]:
    """Per pipeline rank, its global chunks (the schedule's placement: a loop, or ZB-V's V)."""
    if p == 1 or v == 1:
        return [(rank,) for rank in range(p)]
    if name == "zbv":
        return [(rank, 2 * p - 1 - rank) for rank in range(p)]
    return [tuple(j * p + rank for j in range(v)) for rank in range(p)]


@dataclass(frozen=True)
class ChunkBytes:
    """Per global chunk, the bytes :class:`RankWalk` rows weigh (each a tuple over chunks)."""

    saved: Sequence[int]
    deferred: Sequence[int]
    grads: Sequence[int]
    """Gradient bytes (0 when the gradients live through the step: counted as states)."""
    gemm_grads: Sequence[int]
    """Of ``grads``, those a zero-bubble weight pass makes."""
    transient: Sequence[int]
    """A backward's transient on what was alive before it."""
    transient_first: Sequence[int]
    """The same on the chunk's first backward of the step (its gradients made meanwhile)."""
    forward: Sequence[int]
    """The loss forward's transient on what is alive after it."""
    weight_pass: Sequence[int] = ()
    """Zero bubble: a weight pass's largest weight gradient before it is added into
    ``.grad`` (empty: none)."""


@dataclass(frozen=True)
class RankPeaks:
    """One rank's peaks (bytes beyond the states less the gradients)."""

    activations: int
    """Most saved (and deferred) bytes alive at once."""
    with_grads: int
    """Most activation and gradient bytes alive at once."""
    with_transient: int
    """Most bytes at once counting each backward's (and the loss forward's) transient."""
    in_flight: int
    """Most (chunk, micro-batch) activations alive at once."""


def peaks(walk: RankWalk, cb: ChunkBytes) -> RankPeaks:
    """The rank's :class:`RankPeaks` for the byte counts ``cb``.

    Args:
        walk: the rank's moments (:func:`rank_walks`).
        cb: per global chunk, its byte counts.
    """
    pick = [[getattr(cb, f)[c] for c in walk.chunks] for f in
            ("saved", "deferred", "grads")]
    gemm = [cb.gemm_grads[c] for c in walk.chunks]
    grads_bi = [g - x for g, x in zip(pick[2], gemm)]
    weights = np.array(pick[0] + pick[1] + pick[2] + grads_bi + gemm, dtype=np.int64)
    v = len(walk.chunks)
    after = walk.after[:, :5 * v]
    alive = after[:, :2 * v] @ weights[:2 * v]
    with_grads = after @ weights
    tw = [cb.weight_pass[c] if cb.weight_pass else 0 for c in walk.chunks]
    extra = np.concatenate([weights, [cb.transient[c] for c in walk.chunks],
                            [cb.transient_first[c] - cb.transient[c] for c in walk.chunks],
                            [cb.forward[c] for c in walk.chunks], tw,
                            [g - x for g, x in zip(gemm, tw)]]).astype(np.int64)
    moments = walk.extra @ extra if len(walk.extra) else np.zeros(1, dtype=np.int64)
    counts = walk.after[:, :2 * v].sum(axis=1)
    return RankPeaks(int(alive.max()), int(with_grads.max()),
                     int(max(moments.max(), with_grads.max())), int(counts.max()))

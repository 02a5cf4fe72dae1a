"""ZB-V's computation order on arrays: tds's unit-cost list schedule
(tds/pipe/schedule_zbv.py ``zbv_order`` and ``best_zbv_order``), every rank's pick of a
round made at once with numpy, so the planner can walk ZB-V at 64 pipeline ranks and 512
micro-batches in a second rather than a minute. The same rules, round by round: a rank
runs a ready input pass or forward (``backward_first`` says which first; input passes by
the lower next micro-batch, the down leg on a tie; forwards the up leg first, within the
2p held and the down-leg cap), else its oldest waiting weight pass; a result is usable
the round after. tests/test_planner_fast.py checks the orders against tds's.
"""
from typing import Tuple

import numpy as np

F, B, BI, W = 0, 1, 2, 3  # the kinds of a computation (megatron/memory/walk.py's rows)

_VARIANTS = ((True, False), (False, True), (False, False))  # tds's ZBV_VARIANTS


def zbv_orders(p: int, m: int) -> Tuple[np.ndarray, np.ndarray]:
    """``(kinds [p, 6m], local chunks [p, 6m])`` of tds's ``best_zbv_order(p, m)``: the
    variant of fewest rounds (the first on a tie). The three variants run side by side
    (a leading axis of every array)."""
    kinds, chunks, rounds = _zbv(p, m)
    best = int(np.argmin(rounds))  # the first of the fewest
    return kinds[best], chunks[best]


def _zbv(p: int, m: int):
    """Every variant of ``zbv_order`` at once: kinds and local chunks (0 down, 1 up)
    ``[variants, p, 6m]`` and each variant's rounds."""
    nv = len(_VARIANTS)
    backward_first = np.array([b for b, _ in _VARIANTS])[:, None]
    ranks = np.arange(p)
    chunk = np.stack([ranks, 2 * p - 1 - ranks], axis=1)[None]  # [1, p, 2]: down, up
    last, never = 2 * p - 1, np.iinfo(np.int64).max
    var = np.arange(nv)[:, None, None]
    fin_f = np.full((nv, 2 * p + 1, m + 1), never, dtype=np.int64)  # round a result came
    fin_b = np.full((nv, 2 * p + 1, m + 1), never, dtype=np.int64)
    nf, nb = np.zeros((nv, p, 2), dtype=np.int64), np.zeros((nv, p, 2), dtype=np.int64)
    held, held_down = np.zeros((nv, p), dtype=np.int64), np.zeros((nv, p), dtype=np.int64)
    cap = 2 * p - 1 - np.array([ranks if st else 0 * ranks for _, st in _VARIANTS])
    queue = np.zeros((nv, p, 2 * m), dtype=np.int64)  # waiting weight passes, FIFO
    head, tail = np.zeros((nv, p), dtype=np.int64), np.zeros((nv, p), dtype=np.int64)
    kinds = np.zeros((nv, p, 6 * m), dtype=np.int64)
    chunks = np.zeros((nv, p, 6 * m), dtype=np.int64)
    count = np.zeros((nv, p), dtype=np.int64)
    rounds = np.zeros(nv, dtype=np.int64)
    vv, rr = np.meshgrid(np.arange(nv), ranks, indexing="ij")
    t = 0
    while (count < 6 * m).any():
        ok_b = (nb < m) & (fin_f[var, chunk, nb] < t) & \
            ((chunk == last) | (fin_b[var, np.minimum(chunk + 1, 2 * p), nb] < t))
        first_j = np.where(nb[..., 0] <= nb[..., 1], 0, 1)  # the lower next mb, down on ties
        b_j = np.where(ok_b[vv, rr, first_j], first_j,
                       np.where(ok_b[vv, rr, 1 - first_j], 1 - first_j, -1))
        room = held < 2 * p
        ok_f = (nf < m) & np.stack([room & (held_down < cap), room], axis=2) & \
            ((chunk == 0) | (fin_f[var, np.maximum(chunk - 1, 0), nf] < t))
        f_j = np.where(ok_f[..., 1], 1, np.where(ok_f[..., 0], 0, -1))  # the up leg first
        kind = np.where(backward_first, np.where(b_j >= 0, BI, np.where(f_j >= 0, F, -1)),
                        np.where(f_j >= 0, F, np.where(b_j >= 0, BI, -1)))
        j = np.where(kind == BI, b_j, f_j)
        weight = (kind < 0) & (tail > head)
        kind = np.where(weight, W, kind)
        j = np.where(weight, queue[vv, rr, np.minimum(head, 2 * m - 1)], j)
        running = (count < 6 * m).any(axis=1)
        if ((kind < 0).all(axis=1) & running).any():
            raise ValueError(f"ZB-V list schedule stalled at round {t} (p={p}, m={m})")
        _apply(kind, j, vv, rr, chunk[0], t, fin_f, fin_b, nf, nb, held, held_down, queue,
               head, tail)
        act = kind >= 0
        kinds[vv[act], rr[act], count[act]] = kind[act]
        chunks[vv[act], rr[act], count[act]] = j[act]
        count += act
        t += 1
        rounds = np.where(running & (count >= 6 * m).all(axis=1), t, rounds)
    return kinds, chunks, rounds


def _apply(kind, j, vv, rr, chunk, t, fin_f, fin_b, nf, nb, held, held_down, queue, head,
           tail):
    """Run the round's picks (in place): results recorded, counters and queues moved."""
    fwd, bwd, wgt = kind == F, kind == BI, kind == W
    v, r, jj = vv[fwd], rr[fwd], j[fwd]
    fin_f[v, chunk[r, jj], nf[v, r, jj]] = t
    nf[v, r, jj] += 1
    held[v, r] += 1
    held_down[v, r] += jj == 0
    v, r, jj = vv[bwd], rr[bwd], j[bwd]
    fin_b[v, chunk[r, jj], nb[v, r, jj]] = t
    nb[v, r, jj] += 1
    queue[v, r, tail[v, r]] = jj
    tail[v, r] += 1
    v, r, jj = vv[wgt], rr[wgt], j[wgt]
    head[v, r] += 1
    held[v, r] -= 1
    held_down[v, r] -= jj == 0

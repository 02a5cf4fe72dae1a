"""Pipeline schedules as explicit per-rank action lists: 1F1B, interleaved 1F1B, ZB-H1 and
ZB-V, by name through ``build_schedule`` (with the chunk placement each needs), and
``peak_bound``, the chunk-micro-batches a rank holds at most.

The actions, the ``Placement`` and ``lower`` (which derives the communication from each
rank's computation order) are :mod:`.actions`', re-exported here; each generator decides
only the order of the computations on every rank.
"""
from typing import List, Tuple

from .actions import (  # noqa: F401  (re-exported: the schedule API in one place)
    COMPUTE, P2P, P2P_TYPES, PLACEMENT_KINDS, RECVS, SENDS, Action, Backward, BackwardInput,
    BackwardWeight, Compute, Exchange, Forward, Placement, RecvAct, RecvGrad, SendAct,
    SendGrad, _check_sizes, as_placement, consumes, handoff_in, handoff_out, lower, p2p_ops,
    produces)


def _alternate(forwards, backwards, warmup: int, backward_type=None, paired=False):
    """``warmup`` forwards, then one forward / one backward, then the remaining backwards.

    With ``paired`` each steady forward and backward form one round (a tuple).
    """
    backward_type = backward_type or Backward
    order = [Forward(*key) for key in forwards[:warmup]]
    for f_key, b_key in zip(forwards[warmup:], backwards):
        pair = (Forward(*f_key), backward_type(*b_key))
        order += [pair] if paired else list(pair)
    return order + [backward_type(*key) for key in backwards[len(forwards) - warmup:]]


def one_f_one_b(pp_size: int, num_micro_batches: int) -> List[List[Action]]:
    """1F1B (PipeDream-flush): rank r runs min(p - r - 1, m) forwards, then alternates.

    Args:
        pp_size: pipeline ranks p.
        num_micro_batches: micro-batches per step m (any m >= 1).
    """
    return lower(_one_f_one_b_steps(pp_size, num_micro_batches), pp_size, 1)


def _one_f_one_b_steps(pp_size: int, num_micro_batches: int):
    _check_sizes(pp_size, 1, num_micro_batches)
    m = num_micro_batches
    return [_alternate([(r, i) for i in range(m)], [(r, i) for i in range(m)],
                       min(pp_size - r - 1, m)) for r in range(pp_size)]


def interleaved_groups(pp_size: int, num_micro_batches: int) -> List[int]:
    """Sizes of the micro-batch groups that pass through all v chunks together.

    Megatron-LM uses groups of p and requires p | m. Here m splits into floor(m / p)
    groups as even as possible, larger first (m = 9, p = 4: [5, 4]): no group is smaller
    than p, so a micro-batch never comes back round to rank 0 before rank 0 is done with
    its group, and the bubble stays (p - 1) / (v m + p - 1). m < p is one group of m.
    """
    count = max(num_micro_batches // pp_size, 1)
    size, extra = divmod(num_micro_batches, count)
    return [size + 1] * extra + [size] * (count - extra)


def interleaved_order(pp_size: int, vpp_size: int, num_micro_batches: int, rank: int,
                      backward: bool) -> List[Tuple[int, int]]:
    """(global chunk, mb) in the order ``rank`` forwards (or backwards) them.

    Each group of ``interleaved_groups`` passes through the rank's v chunks in turn
    (chunk r, r + p, ... forward; the reverse backward) before the next group starts.
    """
    p, v = pp_size, vpp_size
    chunks = range(v - 1, -1, -1) if backward else range(v)
    order, start = [], 0
    for size in interleaved_groups(p, num_micro_batches):
        order += [(j * p + rank, mb) for j in chunks for mb in range(start, start + size)]
        start += size
    return order


def interleaved_warmup(pp_size: int, vpp_size: int, num_micro_batches: int, rank: int) -> int:
    """Forwards ``rank`` runs before its first backward: 2 (p - r - 1) + (v - 1) g, <= v m.

    Megatron-LM's count, with g the first group's size (p when p divides m).
    """
    p, v, m = pp_size, vpp_size, num_micro_batches
    first_group = interleaved_groups(p, m)[0]
    return min(2 * (p - rank - 1) + (v - 1) * first_group, v * m)


def interleaved_1f1b(pp_size: int, vpp_size: int, num_micro_batches: int) -> List[List[Action]]:
    """Megatron-LM's interleaved 1F1B: rank r holds chunks r, r + p, ..., r + (v - 1) p.

    Warm-up forwards (``interleaved_warmup``), then one forward and one backward per round
    in the group order of ``interleaved_order`` (with one exchange after both, as Megatron's
    ``send_forward_backward_recv_forward_backward``), then the remaining backwards. When p
    divides m this is Megatron's schedule; otherwise see ``interleaved_groups``. v = 1 is
    1F1B with a deeper warm-up.

    Args:
        pp_size: pipeline ranks p (>= 2 when v > 1).
        vpp_size: model chunks per rank v.
        num_micro_batches: micro-batches per step m (any m >= 1).
    """
    return lower(_interleaved_steps(pp_size, vpp_size, num_micro_batches), pp_size, vpp_size)


def _interleaved_steps(pp_size: int, vpp_size: int, num_micro_batches: int):
    _check_sizes(pp_size, vpp_size, num_micro_batches)
    p, v, m = pp_size, vpp_size, num_micro_batches
    if p == 1 and v > 1:
        raise ValueError("pipeline schedule: interleaving needs pp_size >= 2 (with one rank "
                         "the chunks are simply consecutive layers); use vpp_size=1")
    return [_alternate(interleaved_order(p, v, m, r, backward=False),
                       interleaved_order(p, v, m, r, backward=True),
                       interleaved_warmup(p, v, m, r), paired=True) for r in range(p)]


def zb_h1(pp_size: int, num_micro_batches: int) -> List[List[Action]]:
    """Zero-bubble ZB-H1 (Qi et al. 2024): 1F1B with the backward split in two.

    Rank r runs 1F1B's order with ``BackwardInput`` (what rank r - 1 waits for) in place of
    the backward, and ``BackwardWeight`` passes kept at most r behind: the later ranks
    defer their weight passes while the pipeline fills and run them where 1F1B would idle
    in the drain. Every rank holds at most p micro-batches between forward and weight pass
    (1F1B's peak, on rank 0). With equal forward, input and weight costs the step takes
    3 m + p - 1 units for m >= p: bubble (p - 1) / (3 m + p - 1).

    Args:
        pp_size: pipeline ranks p.
        num_micro_batches: micro-batches per step m.
    """
    return lower(_zb_h1_steps(pp_size, num_micro_batches), pp_size, 1)


def _zb_h1_steps(pp_size: int, num_micro_batches: int):
    _check_sizes(pp_size, 1, num_micro_batches)
    p, m, steps = pp_size, num_micro_batches, []
    for r in range(p):
        keys = [(r, i) for i in range(m)]
        order, pending = [], []
        for action in _alternate(keys, keys, min(p - r - 1, m), BackwardInput):
            order.append(action)
            if isinstance(action, BackwardInput):
                pending.append(BackwardWeight(action.chunk, action.mb))
                while len(pending) > r:
                    order.append(pending.pop(0))
        steps.append(order + pending)
    return steps


def zbv(pp_size: int, num_micro_batches: int) -> List[List[Action]]:
    """ZB-V (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory"): two chunks
    per rank in a V (``Placement.v_shape``), split backward, at most 2p chunk-mbs in flight.

    The order is a unit-cost list schedule (``schedule_zbv.best_zbv_order``). With equal
    forward, input and weight costs the step is 6 m + p - 1 chunk passes for every m >= p
    tested up to p = 12 (bubble (p - 1) / (6 m + p - 1), the least any order can reach:
    rank p - 1 cannot start before p - 1 forwards, half of ZB-H1's (p - 1) / (3 m + p - 1)).

    Args:
        pp_size: pipeline ranks p (>= 2).
        num_micro_batches: micro-batches per step m (any m >= 1).

    Returns:
        per-rank action lists, lowered with ``Placement.v_shape(pp_size)``.
    """
    _check_sizes(pp_size, 2, num_micro_batches)
    if pp_size < 2:
        raise ValueError("pipeline schedule: zbv needs pp_size >= 2 (one rank holding both "
                         "chunks of the V is a serial model)")
    from .schedule_zbv import best_zbv_order  # it builds on this module's actions

    return lower(best_zbv_order(pp_size, num_micro_batches), pp_size, 2,
                 Placement.v_shape(pp_size))


SCHEDULES = ("1f1b", "interleaved", "zb-h1", "zbv")
ZERO_BUBBLE = ("zb-h1", "zbv")
"""The schedules that split each backward into input and weight passes."""


def build_schedule(name: str, pp_size: int, vpp_size: int,
                   num_micro_batches: int) -> Tuple[List[List[Action]], Placement]:
    """The action lists and chunk placement of schedule ``name``.

    Args:
        name: "1f1b" (vpp 1), "interleaved" (vpp >= 2, pp >= 2), "zb-h1" (vpp 1, pp >= 2)
            or "zbv" (vpp exactly 2, pp >= 2: the model must be built with two chunks per
            rank; 1 is refused, not taken to mean 2, so a model cut for one chunk per rank
            cannot meet a two-chunk schedule).
        pp_size: pipeline ranks p.
        vpp_size: chunks per rank v.
        num_micro_batches: micro-batches per step m.

    Raises:
        ValueError: an unknown name or a combination the schedule cannot run.
    """
    if name not in SCHEDULES:
        raise ValueError(f"pipeline schedule: unknown schedule {name!r}; use one of "
                         f"{', '.join(SCHEDULES)}")
    _check_sizes(pp_size, vpp_size, num_micro_batches)
    needs = {"1f1b": (1, 1, "vpp_size 1"), "zb-h1": (2, 1, "pp_size >= 2 and vpp_size 1"),
             "interleaved": (2, None, "pp_size >= 2 and vpp_size >= 2"),
             "zbv": (2, 2, "pp_size >= 2 and vpp_size 2 (two chunks per rank, in a V)")}
    min_pp, vpp, what = needs[name]
    if pp_size < min_pp or (vpp_size != vpp if vpp else vpp_size < 2):
        raise ValueError(f"pipeline schedule: {name} needs {what}, got pp_size {pp_size}, "
                         f"vpp_size {vpp_size}")
    p, v, m = pp_size, vpp_size, num_micro_batches
    actions = {"1f1b": lambda: one_f_one_b(p, m), "zb-h1": lambda: zb_h1(p, m),
               "interleaved": lambda: interleaved_1f1b(p, v, m), "zbv": lambda: zbv(p, m)}
    placement = Placement.v_shape(p) if name == "zbv" else Placement.loop(p, v)
    return actions[name](), placement


def forward_only(placement: Placement, num_micro_batches: int) -> List[List[Action]]:
    """Evaluation's schedule: each micro-batch through the chunks in turn, forward only (each
    rank's chunks in order, micro-batch by micro-batch).

    Args:
        placement: which rank holds which chunk.
        num_micro_batches: micro-batches m.
    """
    p, v, m = placement.pp_size, placement.vpp_size, num_micro_batches
    _check_sizes(p, v, m)
    steps = [[Forward(c, mb) for mb in range(m) for c in placement.chunks(r)] for r in range(p)]
    return lower(steps, p, v, placement)


def compute_orders(name: str, pp_size: int, vpp_size: int,
                   num_micro_batches: int) -> List[List[Compute]]:
    """Each rank's computations in the order ``build_schedule(name, ...)`` runs them, without
    the communication (what a memory or cost model walks; ``lower`` keeps this order).

    Args:
        name, pp_size, vpp_size, num_micro_batches: as for :func:`build_schedule`.
    """
    p, v, m = pp_size, vpp_size, num_micro_batches
    if name == "zbv":
        _check_sizes(p, 2, m)
        from .schedule_zbv import best_zbv_order

        steps = best_zbv_order(p, m)
    else:
        steps = {"1f1b": lambda: _one_f_one_b_steps(p, m), "zb-h1": lambda: _zb_h1_steps(p, m),
                 "interleaved": lambda: _interleaved_steps(p, v, m)}[name]()
    return [[a for step in order for a in (step if isinstance(step, tuple) else (step,))]
            for order in steps]


def peak_bound(name: str, pp_size: int, vpp_size: int, num_micro_batches: int,
               rank: int) -> int:
    """Most chunk-micro-batches ``rank`` holds between forward and backward (weight pass).

    1F1B ``min(p - r, m)`` and ZB-H1 ``min(p, m)`` (stages); interleaved
    ``min(interleaved_warmup + 1, v m)``; ZB-V ``min(2p, 2m)`` chunks of half a stage
    (its generator's bound, i.e. 1F1B's p stage activations on every rank). Each is
    reached exactly on every rank for every p in {2, 3, 4, 8}, m in {1, p - 1, p, 2p + 1,
    3p} (simulator, tests/test_pipeline_zbv.py).

    Args:
        name: a schedule of ``SCHEDULES``.
        pp_size, vpp_size, num_micro_batches: p, v, m as given to ``build_schedule``.
        rank: pipeline rank r.
    """
    p, v, m = pp_size, vpp_size, num_micro_batches
    bounds = {"1f1b": lambda: min(p - rank, m), "zb-h1": lambda: min(p, m),
              "interleaved": lambda: min(interleaved_warmup(p, v, m, rank) + 1, v * m),
              "zbv": lambda: min(2 * p, 2 * m)}
    if name not in bounds or not 0 <= rank < p:
        raise ValueError(f"pipeline schedule: no peak bound for schedule {name!r} (one of "
                         f"{', '.join(SCHEDULES)}), rank {rank} (0..{p - 1})")
    return bounds[name]()

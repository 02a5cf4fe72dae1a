"""Rank arithmetic of the (pipeline, data, context, tensor) grid: which global rank sits at
which coordinate, and every group of every kind as tuples of global ranks (the order of
:mod:`.parallel_state`: tensor fastest, then context, data, pipeline). The expert groups are
carved out of each data x context group (:func:`expert_groups`)."""
from typing import Tuple


def grid_rank(pp_rank: int, dp_rank: int, tp_rank: int, tp_size: int, dp_size: int,
              cp_rank: int = 0, cp_size: int = 1) -> int:
    """Global rank of grid coordinate (pp_rank, dp_rank, cp_rank, tp_rank)."""
    return ((pp_rank * dp_size + dp_rank) * cp_size + cp_rank) * tp_size + tp_rank


def grid_coordinates(rank: int, tp_size: int, dp_size: int, cp_size: int = 1
                     ) -> Tuple[int, int, int, int]:
    """``(pp_rank, dp_rank, cp_rank, tp_rank)`` of a global rank (:func:`grid_rank`'s inverse)."""
    rest, tp_rank = divmod(rank, tp_size)
    rest, cp_rank = divmod(rest, cp_size)
    pp_rank, dp_rank = divmod(rest, dp_size)
    return pp_rank, dp_rank, cp_rank, tp_rank


def grid_groups(tp_size, pp_size, dp_size, cp_size=1):
    """Every group of every kind, as tuples of global ranks, in a fixed order."""
    tp, pp, dp, cp = tp_size, pp_size, dp_size, cp_size
    r = lambda p, d, c, t: grid_rank(p, d, t, tp, dp, c, cp)  # noqa: E731
    grid = [(p, d, c, t) for p in range(pp) for d in range(dp) for c in range(cp)
            for t in range(tp)]

    def groups(vary, key):
        """One group per value of ``key`` (the fixed coordinates), members ordered by ``vary``."""
        out = {}
        for coord in grid:
            out.setdefault(key(*coord), []).append((vary(*coord), r(*coord)))
        return [tuple(rank for _, rank in sorted(members)) for members in out.values()]

    pp_groups = groups(lambda p, d, c, t: p, lambda p, d, c, t: (d, c, t))
    return {
        "tp": groups(lambda p, d, c, t: t, lambda p, d, c, t: (p, d, c)),
        "cp": groups(lambda p, d, c, t: c, lambda p, d, c, t: (p, d, t)),
        "dp": groups(lambda p, d, c, t: d, lambda p, d, c, t: (p, c, t)),
        "dp_cp": groups(lambda p, d, c, t: (d, c), lambda p, d, c, t: (p, t)),
        "pp": pp_groups,
        "mp": groups(lambda p, d, c, t: (p, t), lambda p, d, c, t: (d, c)),
        "embedding": [g if len(g) == 1 else (g[0], g[-1]) for g in pp_groups]}


def expert_groups(dp_cp_groups, ep_size):
    """The expert-model-parallel and expert-data-parallel groups, carved out of the data x
    context groups as Megatron-core carves them: each data x context group (ranks in
    ``dp_rank * cp + cp_rank`` order) splits into consecutive runs of ``ep_size`` ranks
    (each holds a different slice of the experts: an expert-parallel group), and the ranks
    at the same place in every run hold the same experts (an expert-data-parallel group,
    which reduces those experts' gradients).

    Args:
        dp_cp_groups: every data x context group, as tuples of global ranks.
        ep_size: ranks sharing the experts of one layer; it divides every group's size.

    Returns:
        ``{"ep": [...], "edp": [...]}``: tuples of global ranks, in a fixed order.
    """
    ep, edp = [], []
    for group in dp_cp_groups:
        ep += [tuple(group[i:i + ep_size]) for i in range(0, len(group), ep_size)]
        edp += [tuple(group[j::ep_size]) for j in range(ep_size)]
    return {"ep": ep, "edp": edp}

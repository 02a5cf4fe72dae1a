"""Checkpoints of expert-parallel runs: each ep rank's experts in a folder of its own.

At expert-parallel size ep > 1 the ranks of one (tp, pp) hold different experts of every MoE
layer (stacked on dim 0 of the expert tensors) and the same copy of everything else. Each ep
rank's folder (``mp_rank_{tp:02d}_{pp:03d}_{ep:03d}``, :mod:`.format`) holds its model file
and, with the distributed optimizer, the optimizer files of the data-parallel ranks in that
ep rank. The distributed optimizer shards its dense buffers over all data x context ranks
and its expert buffer over the expert-data-parallel ranks (those of one ep rank), so a
dense parameter's slices are spread over every ep folder of its (tp, pp) and an expert
tensor's over the folder of its ep rank.

Reading one back (:mod:`.layout_change`): the ep ranks' tensors are put together first
(:func:`collapse_experts`: the expert tensors concatenated in ep order, as if saved at ep 1),
so the rest of the layout change (tp, pp, the sharding record, the optimizer state by
parameter name) is the ep 1 one; the run's ep rank then keeps its experts
(:func:`.sharding.slice_recorded`).
"""
from typing import Callable, Dict, List, Tuple

import torch

from ..common.errors import CheckpointError
from .format import load_rank_file, saved_ep, saved_ep_optimizer_files
from .optimizer_names import MOMENTS
from .sharding import experts_of

StateDict = Dict[str, torch.Tensor]


def is_expert(record: dict, key: str) -> bool:
    """Whether the sharding record says ``key`` stacks experts split over ep ranks."""
    return bool(experts_of(record.get(key, [])))


def collapse_experts(by_ep: Dict[int, StateDict], record: dict, where: str) -> StateDict:
    """One (tp, pp)'s tensors of every ep rank -> those of ep 1.

    Args:
        by_ep: ``{ep_rank: {key: tensor}}`` (weights, or one optimizer moment).
        record: the (tp, pp)'s sharding record (the same keys on every ep rank).
        where: the checkpoint, for messages.

    Returns:
        ``{key: tensor}``: expert tensors ``[E/ep, ...]`` x ep -> ``[E, ...]`` (ep order),
        the others ep rank 0's (replicas).
    """
    ranks = sorted(by_ep)
    out = {}
    for key, tensor in by_ep[ranks[0]].items():
        if not is_expert(record, key):
            out[key] = tensor
            continue
        lacking = [e for e in ranks if key not in by_ep[e]]
        if lacking:
            raise CheckpointError(f"{where}: {key} is missing from the files of expert-parallel "
                                  f"ranks {lacking}; the checkpoint is damaged")
        out[key] = torch.cat([by_ep[e][key] for e in ranks], dim=0)  # [E/ep, ..] x ep -> [E, ..]
    return out


def collapse_named(by_ep: Dict[int, dict], record: dict, where: str) -> dict:
    """``{ep_rank: {name: {"exp_avg", "exp_avg_sq", "step"}}}`` -> the same at ep 1."""
    first = by_ep[min(by_ep)]
    moments = {m: collapse_experts({e: {n: v[m] for n, v in named.items()}
                                    for e, named in by_ep.items()}, record, f"{where} ({m})")
               for m in MOMENTS}
    return {name: {**{m: moments[m][name] for m in MOMENTS}, "step": entry.get("step")}
            for name, entry in first.items()}


def read_ep_states(files: Dict[Tuple[int, int, int], str], read: Dict[tuple, dict]
                   ) -> Tuple[Dict[Tuple[int, int], dict], Dict[Tuple[int, int], Dict[int, dict]]]:
    """Read every rank file of a checkpoint (its rank folders checked), ``read`` those
    already read.

    Returns:
        ``({(tp, pp): state with the experts of every ep rank in its "model"},
        {(tp, pp): {ep_rank: state as saved}})``.
    """
    by_rank: Dict[Tuple[int, int], Dict[int, dict]] = {}
    for (t, p, e), path in files.items():
        by_rank.setdefault((t, p), {})[e] = read.get((t, p, e)) or load_rank_file(path)
    states = {}
    for key, by_ep in by_rank.items():
        first = by_ep[0]
        states[key] = dict(first, model=collapse_experts(
            {e: s.get("model", {}) for e, s in by_ep.items()}, first.get("sharding") or {},
            f"{files[key + (0,)]}"))
    return states, by_rank


def distributed_named(by_ep_states: Dict[int, dict], root: str, iteration: int, tp_rank: int,
                      pp_rank: int, from_slices: Callable) -> Dict[int, Tuple[dict, list]]:
    """The distributed optimizer's state of one (tp, pp) saved at ep > 1, per ep rank.

    Args:
        by_ep_states: ``{ep_rank: main file state}`` (its ``model`` shapes and record); one
            entry is enough when only that ep rank is wanted.
        root, iteration, tp_rank, pp_rank: where the ``optim_dp_rank_*`` files lie.
        from_slices: :func:`.layout_change.named_from_slices`.

    Returns:
        ``{ep_rank: ({name: {"exp_avg", "exp_avg_sq", "step"}}, param groups, loss scaler)}``:
        the dense parameters put together from every ep folder's files, the experts from
        their own.
    """
    first = next(iter(by_ep_states.values()))
    ep = saved_ep(first)
    paths = saved_ep_optimizer_files(root, iteration, tp_rank, pp_rank, ep)
    shards = {e: [load_rank_file(p) for p in paths[e]] for e in range(ep)}
    every: List[dict] = [s for e in range(ep) for s in shards[e]]
    where = paths[0][0]
    if not all("distributed_optimizer" in s for s in every):
        raise CheckpointError(f"{where}: an expert-parallel checkpoint's optimizer files hold "
                              f"another optimizer's state than the distributed optimizer's, "
                              f"which cannot be read by parameter name; resume at the saved "
                              f"layout, or pass --no-load-optim")
    out = {}
    for e, state in by_ep_states.items():
        record = state.get("sharding") or {}
        shapes = {k: v.shape for k, v in state["model"].items()}
        dense, groups = from_slices(every, shapes, where, keep=lambda n: not is_expert(record, n))
        experts, _ = from_slices(shards[e], shapes, paths[e][0],
                                 keep=lambda n: is_expert(record, n))
        out[e] = ({**dense, **experts}, groups, {"ddp": every[0].get("grad_scaler")})
    return out

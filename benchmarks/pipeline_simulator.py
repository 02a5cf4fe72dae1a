"""Discrete-event simulation of pipeline schedules: bubble and activations in flight.

Runs the per-rank action lists of ``tds.pipe.schedules`` with given costs. A computation
takes its cost; a send / receive completes when both ends are posted, plus the p2p
latency (the runner's semantics: a rank posts one action at a time and waits for it, the
operations of an ``Exchange`` progress independently); data dependencies are honoured
through the matched receives, and a local hand-off (chunks c and c + 1 on one rank, ZB-V's
turn) through the rank's own order, at no cost. Costs are those of a whole pipeline stage
(all v chunks of a rank, so one chunk's pass costs 1/v of them), or measured per chunk
and kind (``Costs.from_chunks``). Reports the step time, per rank the bubble
(idle / step time) and the peak number of chunk-micro-batches forwarded but not yet
backwarded (weight pass, for the ZB schedules). As a library::

    from pipeline_simulator import Costs, simulate
    from tds.pipe.schedules import build_schedule
    actions, placement = build_schedule("zbv", 4, 2, 8)
    costs = Costs.from_chunks({c: {"F": 1.0, "B": 1.1, "W": 0.9} for c in range(8)}, p2p=0.01)
    result = simulate(actions, placement, costs)  # .step_time, .bubble, .peak_in_flight

    python benchmarks/pipeline_simulator.py                       # the table
    python benchmarks/pipeline_simulator.py --zb                  # ZB-V / ZB-H1 / 1F1B
    python benchmarks/pipeline_simulator.py --schedule zbv --pp 4 --micro-batches 9
"""
import argparse
import os
import platform
import sys
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from tds.pipe.schedule_check import match_messages  # noqa: E402
from tds.pipe.schedules import (COMPUTE, SCHEDULES, Backward, BackwardInput,  # noqa: E402
                                BackwardWeight, Forward, Placement,
                                interleaved_1f1b, one_f_one_b, p2p_ops, peak_bound, zb_h1,
                                zbv)


@dataclass(frozen=True)
class ChunkCost:
    """Measured seconds of one chunk's passes: forward, input gradient, weight gradient,
    and the fused backward (default: input + weight)."""
    forward: float
    backward_input: float
    backward_weight: float
    backward: Optional[float] = None

    @property
    def fused(self) -> float:
        return self.backward_input + self.backward_weight if self.backward is None \
            else self.backward


@dataclass(frozen=True)
class Costs:
    """Seconds (or units) per pass of a whole stage; p2p is per message.

    ``backward`` is the fused pass; the ZB schedules use ``backward_input`` and
    ``backward_weight``. With ``chunks`` (global chunk -> ``ChunkCost``, see
    ``from_chunks``) each chunk's pass costs what is given for it instead, undivided.
    """
    forward: float = 1.0
    backward: float = 2.0
    backward_input: float = 1.0
    backward_weight: float = 1.0
    p2p: float = 0.0
    chunks: Optional[Tuple[Tuple[int, ChunkCost], ...]] = None

    @classmethod
    def from_chunks(cls, per_chunk: Mapping[int, Union[ChunkCost, Mapping[str, float]]],
                    p2p: float = 0.0) -> "Costs":
        """Costs measured per chunk and kind.

        Args:
            per_chunk: global chunk -> ``ChunkCost``, or a dict with "F", "B" (input
                gradient) and "W" (weight gradient), optionally "BW" (the fused backward
                when measured; default B + W).
            p2p: seconds per message.
        """
        table = []
        for chunk, cost in sorted(per_chunk.items()):
            if not isinstance(cost, ChunkCost):
                missing = {"F", "B", "W"} - set(cost)
                if missing:
                    raise ValueError(f"pipeline simulator: chunk {chunk}'s costs lack "
                                     f"{', '.join(sorted(missing))}; give F, B and W")
                cost = ChunkCost(cost["F"], cost["B"], cost["W"], cost.get("BW"))
            table.append((chunk, cost))
        return cls(p2p=p2p, chunks=tuple(table))

    def of(self, action, vpp_size: int) -> float:
        if self.chunks is not None:
            cost = dict(self.chunks).get(action.chunk)
            if cost is None:
                raise ValueError(f"pipeline simulator: no costs for chunk {action.chunk}")
            return {Forward: cost.forward, Backward: cost.fused,
                    BackwardInput: cost.backward_input,
                    BackwardWeight: cost.backward_weight}[type(action)]
        cost = {Forward: self.forward, Backward: self.backward,
                BackwardInput: self.backward_input,
                BackwardWeight: self.backward_weight}[type(action)]
        return cost / vpp_size


@dataclass
class SimResult:
    step_time: float
    busy: List[float]          # per rank
    peak_in_flight: List[int]  # per rank, chunk-micro-batches

    @property
    def bubble(self) -> List[float]:
        return [1.0 - b / self.step_time for b in self.busy]

    @property
    def overall_bubble(self) -> float:
        return 1.0 - sum(self.busy) / (len(self.busy) * self.step_time)


Result = SimResult


def peak_in_flight(actions: Sequence) -> int:
    """Most chunk-micro-batches forwarded and not yet backwarded (weight pass done)."""
    current = peak = 0
    for action in actions:
        current += isinstance(action, Forward) - isinstance(action, (Backward, BackwardWeight))
        peak = max(peak, current)
    return peak


def _check_placement(per_rank_actions: Sequence[Sequence], placement: Placement):
    if len(per_rank_actions) != placement.pp_size:
        raise ValueError(f"pipeline simulator: {len(per_rank_actions)} action lists for "
                         f"{placement}")
    for rank, actions in enumerate(per_rank_actions):
        for index, action in enumerate(actions):
            if isinstance(action, COMPUTE) and placement.owner(action.chunk) != rank:
                raise ValueError(f"pipeline simulator: rank {rank} action {index} {action}: "
                                 f"chunk {action.chunk} lives on rank "
                                 f"{placement.owner(action.chunk)} ({placement.kind} "
                                 f"placement)")


def simulate(per_rank_actions: Sequence[Sequence], placement: Union[int, Placement],
             costs: Costs = Costs()) -> SimResult:
    """Run the action lists; every rank starts at time 0.

    Args:
        per_rank_actions: one action list per pipeline rank (``build_schedule``'s).
        placement: the schedule's ``Placement``, or (old form) its chunks per rank v.
        costs: stage costs (a chunk's pass costs 1/v) or measured per-chunk costs.

    Raises:
        ValueError: a computation on a rank the placement does not give its chunk.
        RuntimeError: the lists never finish (use ``check_schedule`` for the reason).
    """
    if isinstance(placement, Placement):
        _check_placement(per_rank_actions, placement)
        vpp_size = placement.vpp_size
    else:
        vpp_size = placement
    partner = match_messages(per_rank_actions)
    p = len(per_rank_actions)
    pcs, clock, busy = [0] * p, [0.0] * p, [0.0] * p
    posted: Dict = {}  # (rank, action index) -> time the rank reached that action
    progressed = True
    while progressed:
        progressed = False
        for rank, actions in enumerate(per_rank_actions):
            while pcs[rank] < len(actions):
                action = actions[pcs[rank]]
                if isinstance(action, COMPUTE):
                    cost = costs.of(action, vpp_size)
                    clock[rank] += cost
                    busy[rank] += cost
                else:
                    here = (rank, pcs[rank])
                    posted.setdefault(here, clock[rank])
                    peers = [partner[(rank, pcs[rank], pos)][:2]
                             for pos in range(len(p2p_ops(action)))]
                    if any(peer not in posted for peer in peers):
                        break
                    clock[rank] = max(max(posted[here], posted[peer]) + costs.p2p
                                      for peer in peers)
                pcs[rank] += 1
                progressed = True
    if any(pc < len(actions) for pc, actions in zip(pcs, per_rank_actions)):
        raise RuntimeError(f"schedule does not finish; ranks stop at actions {pcs}")
    return SimResult(max(clock), busy, [peak_in_flight(a) for a in per_rank_actions])


def build(name: str, pp_size: int, vpp_size: int, micro_batches: int):
    """Action lists of schedule ``name`` (``SCHEDULES``); v is used by 'interleaved' only."""
    if name == "1f1b":
        return one_f_one_b(pp_size, micro_batches)
    if name == "interleaved":
        return interleaved_1f1b(pp_size, vpp_size, micro_batches)
    if name == "zb-h1":
        return zb_h1(pp_size, micro_batches)
    if name == "zbv":
        return zbv(pp_size, micro_batches)
    raise ValueError(f"unknown schedule {name!r}; use one of {', '.join(SCHEDULES)}")


def chunks_per_rank(name: str, vpp_size: int) -> int:
    """The v a schedule runs with in the table: its own (1 or 2) but for 'interleaved'."""
    return {"1f1b": 1, "zb-h1": 1, "zbv": 2}.get(name, vpp_size)


def run_schedule(name: str, p: int, v: int, m: int, costs: Costs = Costs()) -> SimResult:
    """``simulate`` of schedule ``name`` with ``chunks_per_rank(name, v)`` chunks per rank
    (through ``build``: the table's interleaved v = 1, which ``build_schedule`` refuses)."""
    v = chunks_per_rank(name, v)
    placement = Placement.v_shape(p) if name == "zbv" else Placement.loop(p, v)
    return simulate(build(name, p, v, m), placement, costs)


def formula(name: str, p: int, v: int, m: int) -> float:
    """Textbook bubble: 1F1B (p-1)/(m+p-1), interleaved (p-1)/(vm+p-1), ZB-H1 (p-1)/(3m+p-1);
    ZB-V (p-1)/(6m+p-1), the least any order reaches with equal F, B, W (rank p - 1 cannot
    start before p - 1 chunk forwards of half a stage)."""
    return {"1f1b": (p - 1) / (m + p - 1), "interleaved": (p - 1) / (v * m + p - 1),
            "zb-h1": (p - 1) / (3 * m + p - 1), "zbv": (p - 1) / (6 * m + p - 1)}[name]


def table(pps=(2, 4, 8), vpps=(1, 2, 4), mbs=(4, 8, 16), costs: Costs = Costs()) -> List[str]:
    """Rows ``p v m | 1F1B sim / formula | interleaved | ZB-H1 | ZB-V | peaks on rank 0``."""
    names = ("1f1b", "interleaved", "zb-h1", "zbv")
    rows = [f"{'p':>2} {'v':>2} {'m':>3} | {'1F1B':>6} {'(p-1)/(m+p-1)':>13} | "
            f"{'interl.':>7} {'(p-1)/(vm+p-1)':>14} | {'ZB-H1':>6} {'(p-1)/(3m+p-1)':>14} | "
            f"{'ZB-V':>6} {'(p-1)/(6m+p-1)':>14} | {'peak r0 1F1B/int./ZB-H1/ZB-V':>28}"]
    for p in pps:
        for v in vpps:
            for m in mbs:
                sims = {name: run_schedule(name, p, v, m, costs) for name in names}
                peaks = "/".join(str(sims[n].peak_in_flight[0]) for n in names)
                rows.append(
                    f"{p:>2} {v:>2} {m:>3} | {sims['1f1b'].overall_bubble:>6.3f} "
                    f"{formula('1f1b', p, v, m):>13.3f} | "
                    f"{sims['interleaved'].overall_bubble:>7.3f} "
                    f"{formula('interleaved', p, v, m):>14.3f} | "
                    f"{sims['zb-h1'].overall_bubble:>6.3f} {formula('zb-h1', p, v, m):>14.3f} | "
                    f"{sims['zbv'].overall_bubble:>6.3f} {formula('zbv', p, v, m):>14.3f} | "
                    f"{peaks:>28}")
    return rows


def zb_table(pps=(2, 4, 8), factors=(1, 2, 4), costs: Costs = Costs()) -> List[str]:
    """ZB-V against ZB-H1 and 1F1B at m = factor * p: bubble, step time relative to 1F1B,
    and the largest per-rank peak in stage activations (chunk-micro-batches / v)."""
    names = ("1f1b", "zb-h1", "zbv")
    rows = [f"{'p':>2} {'m':>3} | {'bubble 1F1B':>11} {'ZB-H1':>6} {'ZB-V':>6} | "
            f"{'step/1F1B ZB-H1':>15} {'ZB-V':>6} | {'max peak (stages) 1F1B':>22} "
            f"{'ZB-H1':>5} {'ZB-V':>5}"]
    for p in pps:
        for m in (f * p for f in factors):
            sims = {n: run_schedule(n, p, 1, m, costs) for n in names}
            peaks = {n: max(sims[n].peak_in_flight) / chunks_per_rank(n, 1) for n in names}
            base = sims["1f1b"].step_time
            rows.append(
                f"{p:>2} {m:>3} | {sims['1f1b'].overall_bubble:>11.3f} "
                f"{sims['zb-h1'].overall_bubble:>6.3f} {sims['zbv'].overall_bubble:>6.3f} | "
                f"{sims['zb-h1'].step_time / base:>15.3f} {sims['zbv'].step_time / base:>6.3f} | "
                f"{peaks['1f1b']:>22g} {peaks['zb-h1']:>5g} {peaks['zbv']:>5g}")
    return rows


def detail(name: str, p: int, v: int, m: int, costs: Costs) -> List[str]:
    v = chunks_per_rank(name, v)
    result = run_schedule(name, p, v, m, costs)
    lines = [f"{name} p={p} v={v} m={m}: step {result.step_time:.3f}, overall bubble "
             f"{result.overall_bubble:.4f} (formula {formula(name, p, v, m):.4f})"]
    for rank in range(p):
        lines.append(f"  rank {rank}: bubble {result.bubble[rank]:.4f}, peak activations in "
                     f"flight {result.peak_in_flight[rank]} (bound "
                     f"{peak_bound(name, p, v, m, rank)} chunk-micro-batches)")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, nargs="+", default=None)
    parser.add_argument("--vpp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--forward", type=float, default=1.0)
    parser.add_argument("--backward", type=float, default=2.0)
    parser.add_argument("--backward-input", type=float, default=1.0)
    parser.add_argument("--backward-weight", type=float, default=1.0)
    parser.add_argument("--p2p", type=float, default=0.0)
    parser.add_argument("--schedule", nargs="+", choices=SCHEDULES, default=None,
                        help="per-rank bubble and peak of these schedules for every (p, v, m)")
    parser.add_argument("--detail", action="store_true", help="--schedule with all four")
    parser.add_argument("--zb", action="store_true",
                        help="ZB-V / ZB-H1 / 1F1B at m = p, 2p, 4p (p from --pp)")
    args = parser.parse_args()
    costs = Costs(args.forward, args.backward, args.backward_input, args.backward_weight,
                  args.p2p)
    pps = args.pp or [2, 4, 8]
    print(f"command: python {' '.join(sys.argv)}")
    print(f"machine: {platform.machine()} (simulation; costs per stage pass: {costs})")
    names = SCHEDULES if args.detail else args.schedule
    if names:
        for p in pps:
            for v in args.vpp:
                for m in args.micro_batches:
                    for name in names:
                        if name == "interleaved" or v == args.vpp[0]:
                            print("\n".join(detail(name, p, v, m, costs)))
        return
    if args.zb:
        print("\n".join(zb_table(pps, costs=costs)))
        return
    print("\n".join(table(pps, args.vpp, args.micro_batches, costs)))


if __name__ == "__main__":
    main()

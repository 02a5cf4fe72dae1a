"""Discrete-event simulation of pipeline schedules: bubble and activations in flight.

Runs the per-rank action lists of ``tds.pipe.schedules`` with given costs. A computation
takes its cost; a send / receive completes when both ends are posted, plus the p2p
latency (the runner's semantics: a rank posts one action at a time and waits for it, the
operations of an ``Exchange`` progress independently); data dependencies are honoured
through the matched receives. Costs are those of a whole pipeline stage (all v chunks of
a rank), so one chunk's pass costs 1/v of them. Prints, for any p, v, m, the bubble
(idle / step time) per rank and overall, and the peak number of chunk-micro-batches
forwarded but not yet backwarded (weight pass, for ZB-H1) per rank.

    python benchmarks/pipeline_simulator.py                       # the table
    python benchmarks/pipeline_simulator.py --pp 4 --vpp 2 --micro-batches 9 --detail
"""
import argparse
import os
import platform
import sys
from dataclasses import dataclass
from typing import Dict, List, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from tds.pipe.schedule_check import match_messages  # noqa: E402
from tds.pipe.schedules import (COMPUTE, Backward, BackwardInput, BackwardWeight,  # noqa: E402
                                Forward, interleaved_1f1b, one_f_one_b, p2p_ops, zb_h1)


@dataclass(frozen=True)
class Costs:
    """Seconds (or units) per pass of a whole stage; p2p is per message.

    ``backward`` is the fused pass; ZB-H1 uses ``backward_input`` and ``backward_weight``.
    """
    forward: float = 1.0
    backward: float = 2.0
    backward_input: float = 1.0
    backward_weight: float = 1.0
    p2p: float = 0.0

    def of(self, action, vpp_size: int) -> float:
        cost = {Forward: self.forward, Backward: self.backward,
                BackwardInput: self.backward_input,
                BackwardWeight: self.backward_weight}[type(action)]
        return cost / vpp_size


@dataclass
class SimResult:
    step_time: float
    busy: List[float]          # per rank
    peak_in_flight: List[int]  # per rank

    @property
    def bubble(self) -> List[float]:
        return [1.0 - b / self.step_time for b in self.busy]

    @property
    def overall_bubble(self) -> float:
        return 1.0 - sum(self.busy) / (len(self.busy) * self.step_time)


def peak_in_flight(actions: Sequence) -> int:
    """Most chunk-micro-batches forwarded and not yet backwarded (weight pass done)."""
    current = peak = 0
    for action in actions:
        current += isinstance(action, Forward) - isinstance(action, (Backward, BackwardWeight))
        peak = max(peak, current)
    return peak


def simulate(per_rank_actions: Sequence[Sequence], vpp_size: int, costs: Costs) -> SimResult:
    """Run the action lists; every rank starts at time 0.

    Raises:
        RuntimeError: the lists never finish (use ``check_schedule`` for the reason).
    """
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
    """Action lists of schedule ``name``: '1f1b', 'interleaved' or 'zb-h1'."""
    if name == "1f1b":
        return one_f_one_b(pp_size, micro_batches)
    if name == "interleaved":
        return interleaved_1f1b(pp_size, vpp_size, micro_batches)
    if name == "zb-h1":
        return zb_h1(pp_size, micro_batches)
    raise ValueError(f"unknown schedule {name!r}; use 1f1b, interleaved or zb-h1")


def formula(name: str, p: int, v: int, m: int) -> float:
    """Textbook bubble: 1F1B (p-1)/(m+p-1), interleaved (p-1)/(vm+p-1), ZB-H1 (p-1)/(3m+p-1)."""
    return {"1f1b": (p - 1) / (m + p - 1), "interleaved": (p - 1) / (v * m + p - 1),
            "zb-h1": (p - 1) / (3 * m + p - 1)}[name]


def table(pps=(2, 4, 8), vpps=(1, 2, 4), mbs=(4, 8, 16), costs: Costs = Costs()) -> List[str]:
    """Rows ``p v m | 1F1B sim / formula | interleaved sim / formula | ZB-H1 | peaks``."""
    rows = [f"{'p':>2} {'v':>2} {'m':>3} | {'1F1B':>6} {'(p-1)/(m+p-1)':>13} | "
            f"{'interl.':>7} {'(p-1)/(vm+p-1)':>14} | {'ZB-H1':>6} {'(p-1)/(3m+p-1)':>14} | "
            f"{'peak r0 1F1B/int./ZB':>20}"]
    for p in pps:
        for v in vpps:
            for m in mbs:
                sims = {name: simulate(build(name, p, v, m), v if name == "interleaved" else 1,
                                       costs) for name in ("1f1b", "interleaved", "zb-h1")}
                peaks = "/".join(str(sims[n].peak_in_flight[0])
                                 for n in ("1f1b", "interleaved", "zb-h1"))
                rows.append(
                    f"{p:>2} {v:>2} {m:>3} | {sims['1f1b'].overall_bubble:>6.3f} "
                    f"{formula('1f1b', p, v, m):>13.3f} | "
                    f"{sims['interleaved'].overall_bubble:>7.3f} "
                    f"{formula('interleaved', p, v, m):>14.3f} | "
                    f"{sims['zb-h1'].overall_bubble:>6.3f} {formula('zb-h1', p, v, m):>14.3f} | "
                    f"{peaks:>20}")
    return rows


def detail(name: str, p: int, v: int, m: int, costs: Costs) -> List[str]:
    v = v if name == "interleaved" else 1
    result = simulate(build(name, p, v, m), v, costs)
    lines = [f"{name} p={p} v={v} m={m}: step {result.step_time:.3f}, overall bubble "
             f"{result.overall_bubble:.4f} (formula {formula(name, p, v, m):.4f})"]
    for rank in range(p):
        lines.append(f"  rank {rank}: bubble {result.bubble[rank]:.4f}, peak activations in "
                     f"flight {result.peak_in_flight[rank]}")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--vpp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--forward", type=float, default=1.0)
    parser.add_argument("--backward", type=float, default=2.0)
    parser.add_argument("--backward-input", type=float, default=1.0)
    parser.add_argument("--backward-weight", type=float, default=1.0)
    parser.add_argument("--p2p", type=float, default=0.0)
    parser.add_argument("--detail", action="store_true",
                        help="per-rank bubble and peak for every schedule and (p, v, m)")
    args = parser.parse_args()
    costs = Costs(args.forward, args.backward, args.backward_input, args.backward_weight,
                  args.p2p)
    print(f"command: python {' '.join(sys.argv)}")
    print(f"machine: {platform.machine()} (simulation; costs per stage pass: {costs})")
    if args.detail:
        for p in args.pp:
            for v in args.vpp:
                for m in args.micro_batches:
                    for name in ("1f1b", "zb-h1") if v == args.vpp[0] else ():
                        print("\n".join(detail(name, p, v, m, costs)))
                    print("\n".join(detail("interleaved", p, v, m, costs)))
        return
    print("\n".join(table(args.pp, args.vpp, args.micro_batches, costs)))


if __name__ == "__main__":
    main()

"""Stop cleanly when the cluster or the user asks: SIGTERM, SIGUSR1 or Ctrl-C (SIGINT) -> save
at a step boundary, exit 0.

Slurm sends SIGUSR1 ahead of a preemption or the time limit (``--signal=USR1@120``) and
SIGTERM when it cancels; the run scripts' torchrun (:mod:`megatron.launch.torchrun`) passes
the Ctrl-C or SIGTERM it receives to its workers. A second SIGINT after the first ends the
process at once (the user means it), without a save. A signal reaches any subset
of the ranks at any moment, so the handler only records it; at a step boundary every rank
contributes its record to one all-reduce on a host (gloo) group, and all of them agree to
stop at the same iteration, save and return from ``pretrain()`` (the entry script exits 0).

Before the first step has ended (start-up: building, loading, the first step), a stop signal
acts as it would without the handler (the process ends): there is nothing new to save, and a
process that defers the signal there could not be stopped at all while it starts, e.g. by
torchrun's agent restarting the job on more nodes.

The check costs one all-reduce of one int64 in host memory every ``--exit-signal-check-interval``
steps (default 1, as Megatron-LM's ``--exit-signal-handler``); it reads no device value, so it
adds no host-device sync to the step (docs/measurements/fault_tolerance.md has the measured cost).
"""
import os
import signal
import threading
from typing import Optional

import torch
import torch.distributed as dist

from .host_group import new_host_group

#: The signals a run stops on (Slurm's warning signal, the cancel / torchrun signal, Ctrl-C).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

#: Written to the ``--save`` folder by a run that stopped on a signal from the cluster
#: (examples/slurm requeue the job when they find it): ``iteration <n> signal <name> rank
#: <r>``. Not after Ctrl-C: a user who stopped the run does not want it requeued.
PREEMPTED_FILENAME = "preempted.txt"


class PreemptionHandler:
    """Records stop signals and turns them into one decision all ranks share.

    Args:
        check_interval: agree every this many steps (1: every step).
    """

    def __init__(self, check_interval: int = 1):
        self.check_interval = check_interval
        self.received = 0  # the signal number this rank got (0: none)
        self.armed = False  # set once the first step has ended
        self.stopped_by: Optional[tuple] = None  # (signal name, rank) once agreed
        self._previous = {}
        self._group = new_host_group()

    def install(self) -> "PreemptionHandler":
        """Take over :data:`STOP_SIGNALS` (main thread only: Python's rule for handlers)."""
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def uninstall(self) -> None:
        """Give the signals back to their previous handlers."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}

    def _on_signal(self, signum, frame):
        again = signum == signal.SIGINT and self.received != 0  # Ctrl-C after a stop signal
        if not self.armed or again:  # start-up, or a second Ctrl-C: the signal's own action
            previous = self._previous.get(signum, signal.SIG_DFL)
            if again:  # at once: no KeyboardInterrupt unwinding through a collective
                previous = signal.SIG_DFL
            signal.signal(signum, previous)
            os.kill(os.getpid(), signum)
            return
        # Only a record: the save happens at the next step boundary, on every rank at once.
        self.received = self.received or signum

    def should_stop(self, iteration: int) -> bool:
        """Collective every ``check_interval`` steps: whether any rank got a stop signal.

        Args:
            iteration: steps completed (all ranks pass the same, so they check together).
        """
        self.armed = True
        if self.check_interval < 1 or iteration % self.check_interval:
            return False
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        # One int64 carries both facts: the largest signal number wins, and among the ranks
        # that got it the lowest rank (world - 1 - rank is largest for it).
        code = (self.received << 32) | (world - 1 - rank) if self.received else 0
        flag = torch.tensor([code], dtype=torch.int64)
        if self._group is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        code = int(flag[0])
        if code == 0:
            return False
        self.stopped_by = (signal.Signals(code >> 32).name, world - 1 - (code & 0xFFFFFFFF))
        return True

    def message(self, iteration: int, save: Optional[str]) -> str:
        """The one line printed when the run stops on a signal."""
        name, rank = self.stopped_by
        where = (f"checkpoint saved to {save}; resume with --load {save}" if save
                 else "no checkpoint (no --save)")
        return (f"> preempted: {name} received by rank {rank}; stopped at iteration "
                f"{iteration}, {where}")

    def write_marker(self, iteration: int, save: Optional[str]) -> None:
        """Rank 0 leaves :data:`PREEMPTED_FILENAME` in ``save`` for the job script."""
        if not save or (dist.is_initialized() and dist.get_rank() != 0):
            return
        name, rank = self.stopped_by
        if name == "SIGINT":
            return
        with open(os.path.join(save, PREEMPTED_FILENAME), "w") as handle:
            handle.write(f"iteration {iteration} signal {name} rank {rank}\n")


def clear_marker(save: Optional[str]) -> None:
    """Rank 0 removes a previous stop's marker when a run starts (it has been acted on)."""
    if save and (not dist.is_initialized() or dist.get_rank() == 0):
        try:
            os.remove(os.path.join(save, PREEMPTED_FILENAME))
        except FileNotFoundError:
            pass

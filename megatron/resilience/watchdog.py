"""``--step-timeout``: end a rank that makes no progress, saying which rank and where.

A rank can stop answering (a stopped or swapped-out process, a dead NIC, a deadlock); the
others then wait inside a collective until its timeout (NCCL's default is long) and nobody
says which rank it was. Here a daemon thread on every rank watches the training thread's
progress per phase (``startup``, ``step``, ``save``, ``evaluation``). When a phase outlasts
its limit, it prints the phase, the iteration and every thread's stack (faulthandler), names
the ranks it has not heard from (each watchdog publishes a heartbeat to the job's rendezvous
store; a stopped rank's heartbeat goes stale), and ends the process with status
:data:`WATCHDOG_EXIT`, so torchrun's agent sees a failed worker and restarts the job.

A silent rank on this host is frozen whole (its own watchdog thread cannot beat: SIGSTOP, a
debugger): it cannot act on the agent's SIGTERM, which torchrun follows with SIGKILL only 30 s
later. The watchdog ends such a rank (SIGKILL, after naming it) so that the job ends within
the timeout; a frozen rank on another host is ended by its own node's agent.

Ending the process is ``os._exit``: the training thread is stuck inside a collective or a
kernel and cannot be interrupted by an exception; it is the watchdog's last resort, taken
only after the report is printed and flushed.
"""
import faulthandler
import os
import signal
import socket
import sys
import threading
import time
from typing import Dict, List, Optional

import torch.distributed as dist

from .startup_allowance import STARTUP_FLOOR_S, STARTUP_STEPS

#: Exit status of a rank the watchdog ended.
WATCHDOG_EXIT = 4

_HEARTBEAT_PREFIX = "megatron_tds_watchdog/"


def _default_store():
    """The job's rendezvous store, or None (private in torch; only read for a diagnosis)."""
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    except Exception:
        return None


class Watchdog:
    """Per-phase progress deadlines for this rank.

    Args:
        timeouts: seconds allowed per phase name.
        rank: this process's global rank (for the report).
        world: number of ranks (to read every rank's heartbeat).
    """

    def __init__(self, timeouts: Dict[str, float], rank: int = 0, world: int = 1):
        self.timeouts, self.rank, self.world = dict(timeouts), rank, world
        # (phase, its start, iteration): one attribute, replaced whole, so the watching
        # thread never pairs a new phase with the previous phase's start
        self._state = ("startup", time.monotonic(), 0)
        self._stop = threading.Event()
        self._store = _default_store() if world > 1 else None
        self._thread = threading.Thread(target=self._watch, name="megatron-watchdog",
                                        daemon=True)

    def start(self) -> "Watchdog":
        """Start watching (the ``startup`` phase's clock runs from construction)."""
        self._thread.start()
        return self

    def enter(self, phase: str, iteration: Optional[int] = None) -> None:
        """The training thread starts ``phase`` (its clock starts now).

        Args:
            phase: ``startup``, ``step``, ``save`` or ``evaluation`` (a key of the timeouts).
            iteration: steps completed (for the report; default: unchanged).
        """
        self._state = (phase, time.monotonic(),
                       self._state[2] if iteration is None else iteration)

    def stop(self) -> None:
        """Stop watching (the end of the run, or an error on the training thread)."""
        self._stop.set()
        self._thread.join(timeout=5)

    def _watch(self):
        poll = max(0.05, min(1.0, min(self.timeouts.values()) / 10))
        self._heartbeat()  # at once: a rank that freezes before the first poll is still found
        while not self._stop.wait(poll):
            self._heartbeat()
            phase, since, iteration = self._state
            limit = self.timeouts.get(phase)
            if limit is not None and time.monotonic() - since > limit:
                self._fire(phase, iteration, time.monotonic() - since, limit)

    def _heartbeat(self):
        if self._store is None:
            return
        try:  # seconds since the epoch: comparable across the hosts of a job (NTP)
            self._store.set(f"{_HEARTBEAT_PREFIX}{self.rank}",
                            f"{time.time():.3f} {os.getpid()} {socket.gethostname()}")
        except Exception:
            self._store = None  # the store is gone (the job is ending): stop publishing

    def silent_ranks(self, older_than: float) -> List[tuple]:
        """``(rank, pid, host)`` of the ranks whose heartbeat is older than ``older_than``
        seconds (pid and host None when it never came).

        Read on a helper thread with a bound, so a store on a stuck host cannot hold the
        report back."""
        found: List[tuple] = []

        def read():
            now = time.time()
            for r in range(self.world):
                key = f"{_HEARTBEAT_PREFIX}{r}"
                if not self._store.check([key]):
                    found.append((r, None, None))
                    continue
                beat, pid, host = self._store.get(key).decode().split(" ", 2)
                if now - float(beat) > older_than:
                    found.append((r, int(pid), host))

        if self._store is None:
            return []
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(timeout=5)
        return found if not reader.is_alive() else []

    def _fire(self, phase, iteration, waited, limit):
        prefix = f"[rank {self.rank}] "
        silent = [s for s in self.silent_ranks(older_than=max(3.0, limit / 2))
                  if s[0] != self.rank]
        who = (f"; rank(s) {[s[0] for s in silent]} stopped answering (no heartbeat for over "
               f"{max(3.0, limit / 2):.0f} s): the stuck rank is there" if silent else "")
        print(f"{prefix}error: watchdog: no progress in phase '{phase}' (iteration "
              f"{iteration}) for {waited:.0f} s, over its limit of {limit:.0f} s{who}; "
              f"this rank's stacks follow, then it exits with status {WATCHDOG_EXIT}",
              file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        self._end_frozen_local(silent)
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(WATCHDOG_EXIT)  # see the module docstring: the training thread is stuck


    def _end_frozen_local(self, silent):
        """SIGKILL the silent ranks of this host (see the module docstring)."""
        host = socket.gethostname()
        for rank, pid, where in silent:
            if pid is None or where != host or pid == os.getpid():
                continue
            try:
                os.kill(pid, signal.SIGKILL)
                print(f"[rank {self.rank}] watchdog: ended frozen rank {rank} (pid {pid}) on "
                      f"this host", file=sys.stderr, flush=True)
            except OSError:
                pass


def start_watchdog(faults, startup: Optional[float] = None) -> Optional[Watchdog]:
    """A started :class:`Watchdog` for ``cfg.faults`` (None without ``--step-timeout``).

    Args:
        faults: ``cfg.faults``.
        startup: seconds of the ``startup`` phase (default: ``faults.startup_timeout``, else
            the base allowance; :func:`~.startup_allowance.startup_timeout` computes the
            run's, with its checkpoint and ``--compile``).
    """
    if faults.step_timeout is None:
        return None
    if startup is None:
        startup = faults.startup_timeout or \
            max(STARTUP_STEPS * faults.step_timeout, STARTUP_FLOOR_S)
    timeouts = {"startup": startup, "step": faults.step_timeout,
                "save": faults.save_timeout, "evaluation": faults.save_timeout}
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    return Watchdog(timeouts, rank, world).start()

"""The loop's hooks for surviving the cluster (docs/fault_tolerance.md), in one object.

``pretrain()`` builds a :class:`RunGuard` after initialisation and calls it at the step
boundary, around saves and evaluations, and at the end; it owns the three mechanisms, each in
its own module: the signal stop (:mod:`.preemption`), the background checkpoint writer
(:mod:`.async_save`) and the hang watchdog (:mod:`.watchdog`). With none of their flags
given, every hook is a no-op that adds no collective.
"""
from contextlib import contextmanager
from typing import Optional

from ..common.utils import print_rank_0
from ..config.run_config import RunConfig
from ..training import checkpointing
from .preemption import PreemptionHandler, clear_marker
from .startup_allowance import startup_timeout
from .watchdog import start_watchdog


class RunGuard:
    """Signal stops, background saves and the watchdog of one run (collective to build).

    Args:
        cfg: the run configuration (``cfg.faults``, ``cfg.checkpoint``).
    """

    def __init__(self, cfg: RunConfig):
        faults = cfg.faults
        self.save_dir = cfg.checkpoint.save
        # start-up runs until the first step ends; its allowance follows the checkpoint
        self.watchdog = start_watchdog(faults, startup_timeout(cfg))
        self.preemption: Optional[PreemptionHandler] = None
        if faults.exit_signal_handler:
            self.preemption = PreemptionHandler(faults.exit_signal_check_interval).install()
            clear_marker(self.save_dir)  # a previous stop's marker has been acted on
        self.writer = checkpointing.new_async_writer() if faults.async_save else None
        self.stopped_at: Optional[int] = None

    @classmethod
    def inactive(cls, cfg: RunConfig) -> "RunGuard":
        """A guard that does nothing (for :func:`~.loop.train` called without one)."""
        guard = cls.__new__(cls)
        guard.save_dir, guard.watchdog, guard.preemption = cfg.checkpoint.save, None, None
        guard.writer, guard.stopped_at = None, None
        return guard

    def _enter(self, phase: str, iteration: Optional[int] = None) -> None:
        if self.watchdog is not None:
            self.watchdog.enter(phase, iteration)

    def step_done(self, iteration: int) -> bool:
        """A step ended: restart the step clock; take a finished background write's outcome
        (raises on every rank if it failed; collective while one is in flight); True when
        the ranks agree to stop on a signal (collective every
        ``--exit-signal-check-interval`` steps)."""
        self._enter("step", iteration)
        if self.writer is not None:
            self.writer.poll()
        if self.preemption is None or not self.preemption.should_stop(iteration):
            return False
        self.stopped_at = iteration
        return True

    def save(self, iteration: int, backend, cfg: RunConfig, train_state) -> None:
        """Save a checkpoint (in the background with ``--async-save``), under the save clock."""
        self._enter("save", iteration)
        checkpointing.save_checkpoint(iteration, backend, cfg, train_state, writer=self.writer)
        self._enter("step", iteration)

    @contextmanager
    def evaluating(self, iteration: int):
        """Validation and test runs go under the evaluation clock."""
        self._enter("evaluation", iteration)
        yield
        self._enter("step", iteration)

    def finish(self) -> None:
        """End of training: wait for a background write (raises if it failed); after a
        signal stop, print the one line saying so and leave the marker for the job script."""
        if self.writer is not None and self.writer.busy:
            self._enter("save")
            self.writer.wait()
        if self.stopped_at is not None:
            self.preemption.write_marker(self.stopped_at, self.save_dir)
            print_rank_0(self.preemption.message(self.stopped_at, self.save_dir))

    def close(self) -> None:
        """Stop the watchdog and give the signals back (also on an error)."""
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.preemption is not None:
            self.preemption.uninstall()

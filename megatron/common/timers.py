"""Named wall-clock timers. The device is synchronised only when a figure is read."""
import time

import torch


def synchronize_device():
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class Timer:
    """Accumulates the time between ``start()`` and ``stop()`` calls."""

    def __init__(self, name):
        self.name = name
        self._elapsed = 0.0
        self._started_at = None

    def start(self):
        if self._started_at is not None:
            raise RuntimeError(f"timer {self.name!r} is already running")
        self._started_at = time.perf_counter()

    def stop(self):
        if self._started_at is None:
            raise RuntimeError(f"timer {self.name!r} is not running")
        self._elapsed += time.perf_counter() - self._started_at
        self._started_at = None

    def elapsed(self, reset=True):
        """Seconds accumulated (including a running interval); optionally restart from 0."""
        synchronize_device()
        running = self._started_at is not None
        if running:
            self.stop()
        value = self._elapsed
        if reset:
            self._elapsed = 0.0
        if running:
            self.start()
        return value


class Timers:
    """``timers("forward").start()`` ... ``.stop()``; ``timers.log([...])`` for a summary."""

    def __init__(self):
        self._timers = {}

    def __call__(self, name):
        if name not in self._timers:
            self._timers[name] = Timer(name)
        return self._timers[name]

    def summary(self, names, normalizer=1.0, reset=True):
        """``"name: ms | name: ms"`` for the timers that exist, per ``normalizer`` steps."""
        parts = [f"{n}: {self._timers[n].elapsed(reset) * 1000.0 / normalizer:.2f}"
                 for n in names if n in self._timers]
        return " | ".join(parts)

"""``--compile``'s compile time: measured apart from the steps, and said while it runs.

A first step under ``torch.compile`` can take minutes, all of it compiling (dynamo, the
backward graph on its first call, Inductor's kernels). :func:`install` (called by
:func:`megatron.model.compile.prepare_for_compile`) registers torch's compile callbacks
(``torch._dynamo.callback_handler``: a start when the first of nested compiles begins, an
end when the last one ends, the lazily compiled backward included) and:

- counts this process's wall time inside compiles (:func:`seconds`) and keeps their spans
  on the wall clock (:func:`take_spans`), so the training log takes the time some rank
  compiled (the union of every rank's spans: a pipeline's stages compile one after another,
  each waiting for the last) out of the interval it fell in (step time, tokens/s and MFU
  are the steps') and says it apart, and the start-up line gives the first step's share;
- from a thread, prints ``> compiling: 12 graphs so far, 40 s`` on each node's first
  process every ``MEGATRON_COMPILE_PROGRESS_INTERVAL`` seconds (default 20) that a compile
  has been running, or that a first step which compiled has not ended (a pipeline stage
  waits for the others' compiles: said so), so a long first step is not silence.
"""
import os
import sys
import threading
import time
from typing import List, Optional, Tuple

#: Seconds between progress lines while a compile runs.
DEFAULT_INTERVAL_S = 20.0


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class CompileWatch:
    """The compile callbacks' clock and the progress thread (one per process)."""

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._done = 0.0  # seconds of finished compiles
        self._since: Optional[float] = None  # start of the compile running now
        self._since_wall = 0.0  # the same on the wall clock (comparable across processes)
        self._spans: List[Tuple[float, float]] = []  # wall-clock spans since take_spans()
        self._mark = 0.0  # seconds() at the last mark()
        self._first_step = True  # until the run's first step ends (first_step_done)
        self._wake = threading.Event()

    def start(self, _args=None) -> None:
        with self._lock:
            self._since, self._since_wall = time.monotonic(), time.time()
        self._wake.set()

    def end(self, _args=None) -> None:
        with self._lock:
            if self._since is not None:
                self._done += time.monotonic() - self._since
                self._spans.append((self._since_wall, time.time()))
                self._since = None

    def seconds(self) -> float:
        """Wall seconds spent compiling so far (a compile running now counted to now)."""
        with self._lock:
            running = time.monotonic() - self._since if self._since is not None else 0.0
            return self._done + running

    def take_spans(self) -> List[Tuple[float, float]]:
        """``[(start, end)]`` on the wall clock of this process's compiles since the last
        call (or :meth:`mark`); a compile running now counts to now, the rest next time."""
        with self._lock:
            spans, self._spans = self._spans, []
            if self._since is not None:
                now = time.time()
                spans.append((self._since_wall, now))
                self._since_wall = now
            return spans

    def mark(self) -> None:
        """Start counting :meth:`take_spans` and :meth:`run_seconds` from now (a new run in
        this process, its first step to come)."""
        self.take_spans()
        self._mark = self.seconds()
        self._first_step = True

    def first_step_done(self) -> None:
        """The first step ended: lines only while a compile runs from now on."""
        self._first_step = False

    def run_seconds(self) -> float:
        """Compile seconds since the last :meth:`mark`."""
        return self.seconds() - self._mark

    def compiling(self) -> bool:
        with self._lock:
            return self._since is not None

    def _busy(self) -> bool:
        """A compile runs, or the first step that compiled is not over (this rank may wait
        for another's compile in the pipeline: still the first step's compiling)."""
        return self.compiling() or self._first_step

    def run(self) -> None:
        """The progress thread: a line each ``interval_s`` of a compile, or of a first step
        that compiled (daemon)."""
        while True:
            self._wake.wait()
            self._wake.clear()
            last = time.monotonic()
            while self._busy():
                time.sleep(min(1.0, self.interval_s / 4))
                if self._busy() and time.monotonic() - last >= self.interval_s:
                    last = time.monotonic()
                    waiting = "" if self.compiling() else \
                        "; this process's are done, the first step goes on (other ranks " \
                        "may still compile)"
                    print(f"> compiling: {_graphs()} graphs so far, {self.seconds():.0f} s"
                          f"{waiting}", file=sys.stdout, flush=True)


_WATCH: Optional[CompileWatch] = None


def install() -> CompileWatch:
    """Register the callbacks and start the progress thread (once per process); each call
    starts a new run's count (:func:`take`)."""
    global _WATCH
    if _WATCH is not None:
        _WATCH.mark()
        return _WATCH
    import torch._dynamo

    interval = float(os.environ.get("MEGATRON_COMPILE_PROGRESS_INTERVAL", DEFAULT_INTERVAL_S))
    watch = CompileWatch(interval)
    torch._dynamo.callback_handler.register_start_callback(watch.start)
    torch._dynamo.callback_handler.register_end_callback(watch.end)
    if os.environ.get("LOCAL_RANK", "0") == "0":  # each node's first process says it
        threading.Thread(target=watch.run, name="compile-progress", daemon=True).start()
    _WATCH = watch
    return watch


def seconds() -> float:
    """This process's compile wall time so far (0 when nothing was installed)."""
    return _WATCH.seconds() if _WATCH is not None else 0.0


def first_step_done() -> None:
    """The run's first step ended (the training loop says so)."""
    if _WATCH is not None:
        _WATCH.first_step_done()


def run_seconds() -> float:
    """This run's compile seconds so far (since its :func:`install`; 0 when none was)."""
    return _WATCH.run_seconds() if _WATCH is not None else 0.0


def take_spans() -> List[Tuple[float, float]]:
    """This process's compile spans (wall clock) since the last call or this run's
    :func:`install` (none when nothing was installed)."""
    return _WATCH.take_spans() if _WATCH is not None else []


def union_seconds(spans: List[Tuple[float, float]]) -> float:
    """Seconds of wall time inside at least one of ``spans`` (several processes' compiles:
    the time some rank compiled, when a pipeline's stages wait on one another's).

    Args:
        spans: ``[(start, end)]``.
    """
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total

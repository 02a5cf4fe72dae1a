"""Progress of the long tools: a tqdm bar on a terminal, plain periodic lines otherwise.

A bar redraws one line with ``\\r``, which is right for a person watching a terminal and
wrong for a CI log or a Slurm output file (thousands of partial lines). So :func:`progress`
looks at the stream: a terminal gets ``tqdm`` (rate, time left), anything else gets
:class:`PlainProgress`, which prints a complete line every ``every`` items or every
``interval_s`` seconds, and a last line when done (if it printed before, or counts by
items: a short phase stays silent). ``MEGATRON_PROGRESS=bar|plain`` forces one.
The training log does not use this: it stays one line per ``--log-interval``.
"""
import os
import sys
import time

#: Seconds between plain lines when no item count is given.
DEFAULT_INTERVAL_S = 30.0


def _wants_bar(stream):
    mode = os.environ.get("MEGATRON_PROGRESS", "auto")
    if mode in ("bar", "plain"):
        return mode == "bar"
    isatty = getattr(stream, "isatty", None)
    if not (isatty and isatty()):
        return False
    try:  # a terminal without a size (some CI pseudo-terminals) would get an empty bar
        return os.get_terminal_size(stream.fileno()).columns > 0
    except (OSError, ValueError, AttributeError):
        return False


def progress(iterable=None, *, total=None, desc="", unit="it", stream=None, every=None,
             interval_s=None, unit_scale=False):
    """A tqdm bar or a :class:`PlainProgress`, both with ``update``/``set_postfix_str``/``close``.

    Args:
        iterable: wrap it (iterate the result), or None and call ``update(n)``.
        total: number of items, when known (gives a percentage and the time left).
        desc: what is being done, at the start of each line.
        unit: name of one item ("docs", "B", "files").
        stream: where to write (default ``sys.stderr``, as tqdm).
        every: plain mode: a line every this many items (else by time).
        interval_s: plain mode: a line at most every this many seconds
            (default ``MEGATRON_PROGRESS_INTERVAL`` or 30).
        unit_scale: show large counts as k/M/G (bytes).
    """
    stream = stream if stream is not None else sys.stderr
    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)
    if _wants_bar(stream):
        try:
            from tqdm import tqdm
        except ImportError:  # tqdm is a dependency; a broken install still gets lines
            pass
        else:
            return tqdm(iterable, total=total, desc=desc, unit=unit, file=stream,
                        unit_scale=unit_scale, dynamic_ncols=True)
    if interval_s is None:
        interval_s = float(os.environ.get("MEGATRON_PROGRESS_INTERVAL", DEFAULT_INTERVAL_S))
    return PlainProgress(iterable, total, desc, unit, stream, every, interval_s)


def _hms(seconds):
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class PlainProgress:
    """Complete progress lines for logs: ``desc: n/total unit (p%) | rate | elapsed | left``.

    Args: as :func:`progress` (``every`` items or ``interval_s`` seconds between lines).
    """

    def __init__(self, iterable, total, desc, unit, stream, every, interval_s):
        self.iterable, self.total, self.desc, self.unit = iterable, total, desc, unit
        self.stream, self.every, self.interval_s = stream, every, interval_s
        self.n, self.postfix, self.closed, self.printed = 0, "", False, False
        self.start = self.last_print = time.monotonic()
        self.next_count = every

    def __iter__(self):
        for item in self.iterable:
            yield item
            self.update(1)
        self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def update(self, n=1):
        """Count ``n`` more items; print a line when one is due."""
        self.n += n
        now = time.monotonic()
        if self.every:
            if self.n < self.next_count:
                return
            self.next_count = (self.n // self.every + 1) * self.every
        elif now - self.last_print < self.interval_s:
            return
        self.last_print = now
        self._print()

    def set_postfix_str(self, text):
        """Text appended to the next lines (tqdm's API), e.g. a byte rate."""
        self.postfix = text

    def close(self):
        """Print the final line once: with ``every``, or when a periodic line was printed
        (a task shorter than ``interval_s`` stays silent, not a line per short phase)."""
        if not self.closed:
            self.closed = True
            if self.every or self.printed:
                self._print(done=True)

    def _print(self, done=False):
        elapsed = max(time.monotonic() - self.start, 1e-9)
        rate = self.n / elapsed
        count = f"{self.n}/{self.total}" if self.total else f"{self.n}"
        parts = [f"{self.desc}: {count} {self.unit}"]
        if self.total:
            parts[0] += f" ({100.0 * self.n / self.total:.0f}%)"
        parts += [f"{rate:.1f} {self.unit}/s", f"elapsed {_hms(elapsed)}"]
        if self.total and not done and rate > 0:
            parts.append(f"left {_hms((self.total - self.n) / rate)}")
        if self.postfix:
            parts.append(self.postfix)
        if done:
            parts.append("done")
        print(" | ".join(parts), file=self.stream, flush=True)
        self.printed = True

"""How long a run's start-up took, phase by phase.

``initialize_megatron`` creates a :class:`StartupTimes` (kept with the run's globals); the
phases that can take long are timed as they run (the fused-kernel build, the model, the
checkpoint, the datasets and their index, the first step with ``torch.compile``), and the
training loop prints one line when the first step ends:

    > start-up: 95.1 s from process start to the end of the first step: fused kernels 76.6 s,
      model 1.2 s, checkpoint 0.1 s, datasets 0.8 s, first step 2.1 s, the rest 14.4 s
      (imports, settings, torch.distributed)
"""
import time
from contextlib import contextmanager
from typing import List, Optional, Tuple


def process_age() -> Optional[float]:
    """Seconds since this process started (its imports included), or None when unknown."""
    try:
        import psutil

        return max(0.0, time.time() - psutil.Process().create_time())
    except Exception:  # no psutil, or no process table: count from the clock's creation
        return None


class StartupTimes:
    """The start-up phases of one run and their wall times (seconds)."""

    def __init__(self):
        self.created = time.monotonic()
        self.age_at_creation = process_age()
        self.phases: List[Tuple[str, float]] = []

    @contextmanager
    def phase(self, label: str):
        """Time the block as phase ``label``."""
        start = time.monotonic()
        try:
            yield
        finally:
            self.phases.append((label, time.monotonic() - start))

    def seconds(self, label: str) -> Optional[float]:
        """The last time recorded for ``label``, or None."""
        found = [s for name, s in self.phases if name == label]
        return found[-1] if found else None

    def summary(self) -> str:
        """The start-up line (call at the end of the first step, the last phase)."""
        elapsed = time.monotonic() - self.created
        known = self.age_at_creation is not None
        total = elapsed + (self.age_at_creation or 0.0)
        parts = [f"{label} {seconds:.1f} s" for label, seconds in self.phases]
        rest = total - sum(seconds for _, seconds in self.phases)
        what = "imports, settings, torch.distributed" if known else \
            "settings, torch.distributed"
        parts.append(f"the rest {rest:.1f} s ({what})")
        since = "process start" if known else "initialization"
        return (f"> start-up: {total:.1f} s from {since} to the end of the first step: "
                + ", ".join(parts))

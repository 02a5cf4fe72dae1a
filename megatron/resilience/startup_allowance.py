"""How long the watchdog's ``startup`` phase may last (``--step-timeout``; docs/fault_tolerance.md).

Start-up runs from the watchdog's start to the end of the first step: model build, the
checkpoint load, the data index, the first (compiling) step. A fixed allowance kills a large
resume as hung, and the restarted job then runs into the same kill. Unless
``--startup-timeout`` sets it, the allowance is the sum of

- a base: ten steps' worth (``--step-timeout``), at least :data:`STARTUP_FLOOR_S`;
- the checkpoint at ``--load``'s tracker iteration, read at :data:`READ_BYTES_PER_S` by this
  rank (see :func:`checkpoint_read_bytes` for which bytes a rank counts);
- :data:`COMPILE_S` with ``--compile`` (the first step compiles every layer's graphs).

Each rank computes its own from the files it sees (no collective: the checkpoint is the same
folder for all, and a rank whose watchdog fires later only reports later).
"""
import os
from dataclasses import dataclass
from typing import Optional, Tuple

from ..checkpoint.format import iteration_dir, rank_files, read_tracker
from ..common.errors import CheckpointError
from ..common.utils import print_rank_0
from ..config.run_config import RunConfig

#: Least start-up allowance, seconds (model build and data index of a small run).
STARTUP_FLOOR_S = 300.0
#: The base allowance in steps of ``--step-timeout``.
STARTUP_STEPS = 10
#: Read bandwidth one rank is assumed to get from the checkpoint's file system, bytes/s:
#: 100 MB/s, a conservative share of a parallel file system (Lustre, GPFS) under a whole
#: job's simultaneous resume, and below a single local NVMe or network disk.
READ_BYTES_PER_S = 100e6
#: Extra seconds for ``--compile`` (torch.compile of every layer in the first step).
COMPILE_S = 600.0


@dataclass(frozen=True)
class StartupAllowance:
    """The ``startup`` phase's limit and what it is made of (seconds unless named bytes)."""

    base: float
    checkpoint_bytes: int
    checkpoint: Optional[str]
    compile: float

    @property
    def checkpoint_s(self) -> float:
        return self.checkpoint_bytes / READ_BYTES_PER_S

    @property
    def seconds(self) -> float:
        return self.base + self.checkpoint_s + self.compile

    def describe(self) -> str:
        """One line for the log: the total and its parts."""
        parts = [f"{self.base:.0f} s base"]
        if self.checkpoint_bytes:
            parts.append(f"{self.checkpoint_s:.0f} s to read {self.checkpoint_bytes / 1e6:.1f} "
                         f"MB of {self.checkpoint} at {READ_BYTES_PER_S / 1e6:.0f} MB/s")
        if self.compile:
            parts.append(f"{self.compile:.0f} s for --compile")
        return (f"> watchdog: start-up allowance {self.seconds:.0f} s ({' + '.join(parts)}); "
                f"--startup-timeout sets it")


def _folder_bytes(folder: str) -> int:
    total = 0
    for root, _, names in os.walk(folder):
        for name in names:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:  # removed while we looked (a concurrent cleanup): not read
                pass
    return total


def checkpoint_read_bytes(load: Optional[str], tp: int, pp: int) -> Tuple[int, Optional[str]]:
    """Bytes one rank may read to resume from ``load`` at its tracker's iteration.

    At the saved layout (as many ``mp_rank_*`` folders as ``tp * pp``) a rank reads its own
    folder (its model file and, for DeepSpeed engines, every optimizer shard of it), so the
    largest folder counts, plus any file outside the rank folders. At another layout, or in
    a layout this does not know, a rank may read every shard: the whole iteration folder.

    Args:
        load: the ``--load`` folder (None: nothing to read).
        tp, pp: this run's tensor- and pipeline-parallel sizes.

    Returns:
        ``(bytes, iteration folder)``; ``(0, None)`` when there is nothing to resume from
        (no ``--load``, no tracker, a tracker the load itself will refuse).
    """
    if not load or not os.path.isdir(load):
        return 0, None
    try:
        iteration = read_tracker(load)
    except (CheckpointError, OSError):  # the agreed read in load_checkpoint raises it on
        return 0, None                   # every rank moments later (one rank alone: not here)
    folder = iteration_dir(load, iteration) if iteration is not None else None
    if folder is None or not os.path.isdir(folder):
        return 0, None
    total = _folder_bytes(folder)
    rank_dirs = {os.path.dirname(path) for path in rank_files(folder).values()}
    if not rank_dirs or len(rank_dirs) != tp * pp:
        return total, folder
    sizes = [_folder_bytes(d) for d in rank_dirs]
    return total - sum(sizes) + max(sizes), folder


def startup_allowance(cfg: RunConfig) -> StartupAllowance:
    """The computed allowance of a run with ``--step-timeout`` (ignores ``--startup-timeout``).

    Args:
        cfg: the run configuration (``faults``, ``checkpoint.load``, ``parallel``,
            ``kernels.compile``).
    """
    base = max(STARTUP_STEPS * cfg.faults.step_timeout, STARTUP_FLOOR_S)
    nbytes, folder = checkpoint_read_bytes(cfg.checkpoint.load, cfg.parallel.tp,
                                           max(cfg.parallel.pp, 1))
    return StartupAllowance(base, nbytes, folder, COMPILE_S if cfg.kernels.compile else 0.0)


def startup_timeout(cfg: RunConfig) -> Optional[float]:
    """Seconds the ``startup`` phase may last: ``--startup-timeout`` when given, else
    :func:`startup_allowance` (logged on rank 0); None without ``--step-timeout``."""
    faults = cfg.faults
    if faults.step_timeout is None:
        return None
    if faults.startup_timeout is not None:
        return faults.startup_timeout
    allowance = startup_allowance(cfg)
    print_rank_0(allowance.describe())
    return allowance.seconds

"""Verify a checkpoint on disk against its manifests (``tools/verify_checkpoint.py``).

A ``--save`` folder is checked at its tracker's iteration (or the one asked for, or every
published one); an ``iter_*`` folder is checked as it is. Every file's bytes are hashed and
compared with the manifest (:func:`.manifest.verify_folder`); nothing is loaded, so a copy
can be checked on a machine without the model's dependencies' GPUs or memory.
"""
import os
from dataclasses import dataclass
from typing import List, Optional

from ..common.errors import CheckpointError
from .format import TRACKER_FILENAME, iteration_dir, published_iterations, read_tracker
from .manifest import MANIFEST_FILENAME, verify_folder


@dataclass
class FolderReport:
    """The outcome for one iteration folder.

    Attributes:
        folder: the iteration folder.
        files: files verified (0 when the manifest could not be read).
        size: their bytes.
        algorithm: the manifest's hash, or None.
        problems: one line per damaged, missing or unlisted file or damaged manifest.
    """

    folder: str
    files: int
    size: int
    algorithm: Optional[str]
    problems: List[str]

    @property
    def ok(self) -> bool:
        return not self.problems

    def lines(self) -> List[str]:
        """What the tool prints for it."""
        if self.ok:
            return [f"ok: {self.folder}: {self.files} file(s), {self.size / 1e6:.1f} MB "
                    f"verified ({self.algorithm})"]
        return [f"DAMAGED: {self.folder}: {len(self.problems)} problem(s)"] + \
            [f"  - {problem}" for problem in self.problems]


def folders_to_verify(path: str, iteration: Optional[int] = None,
                      every: bool = False) -> List[str]:
    """The iteration folders ``path`` stands for.

    Args:
        path: a ``--save`` folder (with a tracker or ``iter_*`` folders) or an ``iter_*``
            folder.
        iteration: check this iteration of a ``--save`` folder instead of the tracker's.
        every: check every published iteration of a ``--save`` folder.

    Raises:
        CheckpointError: ``path`` is not a checkpoint folder, or holds no such iteration.
    """
    if not os.path.isdir(path):
        raise CheckpointError(f"{path} is not a folder")
    is_iteration = os.path.isfile(os.path.join(path, MANIFEST_FILENAME)) or any(
        name.startswith("mp_rank_") for name in os.listdir(path))
    if is_iteration:
        if iteration is not None or every:
            raise CheckpointError(f"{path} is one iteration's folder: --iteration and --all "
                                  f"apply to a --save folder")
        return [path]
    if every:
        found = published_iterations(path)
        if not found:
            raise CheckpointError(f"{path} holds no iter_* folder")
        return [iteration_dir(path, it) for it in found]
    if iteration is None:
        iteration = read_tracker(path)
        if iteration is None:
            raise CheckpointError(f"{path} has no {TRACKER_FILENAME} and is not an iter_* "
                                  f"folder; pass --iteration N or --all, or an iter_* folder")
    folder = iteration_dir(path, iteration)
    if not os.path.isdir(folder):
        raise CheckpointError(f"{folder} does not exist")
    return [folder]


def verify(path: str, iteration: Optional[int] = None, every: bool = False
           ) -> List[FolderReport]:
    """Verify every file of the iteration folders ``path`` stands for
    (:func:`folders_to_verify`, whose errors it raises)."""
    reports = []
    for folder in folders_to_verify(path, iteration, every):
        manifest, problems = verify_folder(folder)
        files = manifest.files if manifest is not None else {}
        reports.append(FolderReport(folder, len(files), sum(f.size for f in files.values()),
                                    manifest.algorithm if manifest else None, problems))
    return reports

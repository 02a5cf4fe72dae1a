"""Durable publication: what a rename promises after a node crash, not only after a kill.

A rename (``os.replace``) is atomic for the processes of one machine: a killed writer leaves
either the old name or the new one. It says nothing about a power loss or a node crash:
the kernel (and a parallel file system's client: Lustre, GPFS, NFS) may write the renamed
directory entry to disk before the data the file holds, and the disk then has a tracker
naming a checkpoint whose files are empty. The rule here, as in torch's DCP writer (its
``sync_files``) and in every database:

1. each file's data is flushed (``fsync``) before the file is renamed into place;
2. the directory holding a new name is flushed after the rename, so the name survives;
3. a publication (a checkpoint folder, then the tracker that names it) happens only after
   everything it names has gone through 1 and 2.

``MEGATRON_TDS_FSYNC=0`` turns the flushes off (a file system where they are known to be
slow and a crash is not a concern); the renames stay atomic.
"""
import os
from typing import Callable

ENV_OFF = "MEGATRON_TDS_FSYNC"


def enabled() -> bool:
    """Whether flushes are on (the default; ``MEGATRON_TDS_FSYNC=0`` turns them off)."""
    return os.environ.get(ENV_OFF, "1").strip().lower() not in ("0", "false", "no", "off")


def fsync_path(path: str) -> None:
    """Flush ``path`` (a file's data, or a directory's entries) to stable storage.

    Args:
        path: a file or a directory.
    """
    if not enabled():
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str) -> None:
    """Flush every directory under ``root``, deepest first, then ``root`` itself (their
    entries: the names of files already flushed by their writers)."""
    if not enabled():
        return
    for folder, _, _ in sorted(os.walk(root), key=lambda entry: -entry[0].count(os.sep)):
        fsync_path(folder)


def replace(tmp: str, path: str) -> None:
    """Rename the flushed ``tmp`` to ``path`` and flush the directory holding the new name.

    Args:
        tmp: a complete file or folder (its data already flushed, see :func:`fsync_path`).
        path: the final name.
    """
    os.replace(tmp, path)
    fsync_path(os.path.dirname(os.path.abspath(path)))


def write_file(path: str, write: Callable[[str], None]) -> None:
    """``write(path)``, then flush the file's data (no rename: ``path`` is inside a folder
    that is published whole later)."""
    write(path)
    fsync_path(path)

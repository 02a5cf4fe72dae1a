"""The collective side of checkpoint digests (megatron/checkpoint/manifest.py): at a save,
rank 0 learns every writer's digests for the manifest; at a resume, every rank takes the
same decision about a checkpoint that fails verification on any rank.

Save (synchronous and ``--async-save`` alike): each rank writes its files through
:func:`~megatron.checkpoint.format.write_checkpoint_file`, which returns their digests;
:func:`gather_digests` (one ``all_gather_object`` of a few names and hex strings, on the
group the save agrees on) hands them all to rank 0, whose publication writes the manifest.

Resume: each rank verifies the files it reads (:func:`~megatron.checkpoint.manifest.
check_file`); :func:`damaged_or_none` gathers every rank's verdict
(:func:`megatron.resilience.agreement.gather_failures`), so every rank sees the same list of damaged
files. Then, when ``--load`` is the ``--save`` folder (a resumed run, e.g. a restarted job),
every rank falls back to the newest older checkpoint and tries it; once one verifies,
rank 0 moves the damaged folders aside (``iter_N.damaged``: renamed, never deleted) and
points the tracker at the one taken (:func:`set_aside_damaged`). Elsewhere (``--load`` a
folder the run does not own) every rank raises the same :class:`CheckpointDigestError`.
"""
import os
from typing import Any, Dict, List, Optional, Tuple

import torch.distributed as dist

from .agreement import agree_on_call, agree_on_value, gather_failures, summary
from ..checkpoint.digest import FileDigest
from ..checkpoint.format import (iteration_dir, published_iterations, set_aside,
                                 write_tracker)
from ..checkpoint.manifest import relative_name
from ..common.errors import CheckpointDigestError, CheckpointError
from ..common.utils import print_rank_0, warn_rank_0
from ..config.run_config import RunConfig

#: ``(iteration, [(rank, cause), ...])`` for each checkpoint that failed verification.
Damage = Tuple[int, List[Tuple[int, str]]]

SKIP_HINT = "pass --no-verify-checkpoint to load it as it is"


def gather_digests(written: List[Tuple[str, FileDigest]], folder: str,
                   group=None) -> Dict[str, FileDigest]:
    """Collective over ``group``: every rank's written files' digests, by name inside the
    iteration ``folder`` (the manifest's keys), the same on every rank.

    Args:
        written: this rank's ``(path, digest)`` pairs (none on a rank that wrote nothing).
        folder: the (temporary) iteration folder the files are in.
        group: the process group the save agrees on (default: the world).
    """
    mine = [(relative_name(path, folder), digest) for path, digest in written]
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        every = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, mine, group=group)
    else:
        every = [mine]
    merged: Dict[str, FileDigest] = {}
    for entries in every:
        for name, digest in entries:
            if merged.setdefault(name, digest) != digest:
                raise CheckpointError(f"two ranks wrote {os.path.join(folder, name)} with "
                                      f"different contents")
    return merged


def _same_folder(a: Optional[str], b: Optional[str]) -> bool:
    return bool(a and b) and os.path.realpath(a) == os.path.realpath(b)


def damaged_or_none(cfg: RunConfig, iteration: int, error: Optional[CheckpointDigestError],
                    damaged: List[Damage]) -> Optional[int]:
    """Collective: every rank's verification of ``iteration``, agreed. Returns None when
    every rank verified what it read; else (every rank alike) the older iteration to try,
    after adding this one to ``damaged``.

    Args:
        cfg: the run configuration (``--load``, ``--save``).
        iteration: the checkpoint just read.
        error: this rank's verification failure, or None.
        damaged: the checkpoints found damaged so far in this resume (appended to).

    Raises:
        CheckpointDigestError: on every rank, naming every rank's damaged file and both
            digests, when ``--load`` is not ``--save`` or no older checkpoint is left.
    """
    failures = gather_failures(error)
    if not failures:
        return None
    root = cfg.checkpoint.load
    damaged.append((iteration, failures))
    what = summary(f"verifying the checkpoint of iteration {iteration} in {root}", failures)
    if not _same_folder(root, cfg.checkpoint.save):
        raise CheckpointDigestError(
            f"{what}; point --load at an intact copy (tools/verify_checkpoint.py DIR checks "
            f"one), or resume with --load and --save naming the same folder to fall back to "
            f"its newest checkpoint that verifies, or {SKIP_HINT}")
    older = [it for it in published_iterations(root) if it < iteration]
    older = agree_on_value(older[-1] if older else None, None, f"listing {root}",
                           error_type=CheckpointError,
                           hint="every rank must see the same --load folder")
    if older is None:
        earlier = [summary(f"verifying the checkpoint of iteration {it} in {root}", causes)
                   for it, causes in damaged[:-1]]
        raise CheckpointDigestError(
            "; ".join(earlier + [what]) + f"; no older checkpoint in {root} verifies, so "
            f"nothing was moved; restore an intact copy, or {SKIP_HINT}")
    warn_rank_0(f"{what}; falling back to iteration {older}")
    return older


def set_aside_damaged(cfg: RunConfig, damaged: List[Damage], iteration: int) -> None:
    """Collective, after ``iteration`` loaded and verified: rank 0 renames the damaged
    folders aside and points the tracker at ``iteration``; every rank agrees on it."""
    if not damaged:
        return
    root = cfg.checkpoint.load

    def move():
        if dist.is_initialized() and dist.get_rank() != 0:
            return []
        moved = [set_aside(root, it) for it, _ in damaged]
        write_tracker(root, iteration)
        return moved

    moved = agree_on_call(f"moving the damaged checkpoint(s) in {root} aside", move,
                          error_type=CheckpointError)
    warn_rank_0(f"resumed from iteration {iteration}, the newest checkpoint in {root} that "
                f"verifies; the tracker now names it, and the damaged checkpoint(s) were "
                f"moved aside (kept, not deleted): {', '.join(moved)}")


def report(cfg: RunConfig, iteration: int, scope: Any) -> None:
    """Rank 0's line on what the load verified (``scope``: its
    :class:`~megatron.checkpoint.manifest.Verification`)."""
    folder = iteration_dir(cfg.checkpoint.load, iteration)
    if not scope.enabled:
        warn_rank_0(f"--no-verify-checkpoint: the files of {folder} were loaded without "
                    f"checking them against its manifest")
    elif scope.unverified:
        warn_rank_0(f"{folder} has no manifest (saved before checkpoints carried digests, or "
                    f"by a tool that writes none): its files were loaded unverified")
    else:
        algorithms = sorted({m.algorithm for m in scope.manifests.values() if m is not None})
        print_rank_0(f"> verified the {len(scope.checked)} checkpoint file(s) rank 0 read "
                     f"against {folder}'s manifest ({', '.join(algorithms)})")

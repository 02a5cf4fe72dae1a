"""The manifest a checkpoint carries: every file's size and digest, and their verification.

``<root>/iter_N/manifest.json`` lists each file of the iteration folder by its path inside
it, with the digest its writer computed while writing it (:mod:`.digest`)::

    {"manifest": "megatron-tds-manifest/1", "iteration": 6, "algorithm": "xxh3_128",
     "files": {"mp_rank_00_000/model_optim_rng.pt": {"size": 148434, "digest": "9f0c..."}}}

Rank 0 writes it into the temporary iteration folder once every rank's files are complete
(:func:`write_manifest`, called by :func:`.format.publish_iteration`): it is flushed with the
folder's other files, renamed into place with them, and the tracker naming the folder comes
after it, so a published checkpoint always has its manifest. Writing it also checks that every
file of the folder has a digest, so a file written around the common write path
(:func:`.format.write_checkpoint_file`) fails the save rather than going unverified.

Reading: every reader of a native checkpoint file (:func:`.format.load_rank_file`,
:func:`.zero_state.load_engine_optimizer_file`, the training resume) calls :func:`check_file`
first, which hashes the file and compares it with its manifest entry, raising
:class:`~megatron.common.errors.CheckpointDigestError` on any difference. A folder without a manifest
(written before checkpoints carried digests) is read unverified and noted. The resume scopes
its reads in :func:`verification` (``--no-verify-checkpoint`` turns the checks off, and the
scope reports what was checked); a tool's reads outside any scope are checked all the same.
"""
import contextlib
import contextvars
import json
import os
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Set, Tuple

from ..resilience import durable
from ..common.errors import CheckpointDigestError, CheckpointError
from .digest import ALGORITHMS, DEFAULT_ALGORITHM, FileDigest, file_digest

MANIFEST_FILENAME = "manifest.json"
MANIFEST_FORMAT = "megatron-tds-manifest/1"


@dataclass
class Manifest:
    """A parsed manifest.

    Attributes:
        path: the manifest file.
        iteration: the iteration it was written for.
        algorithm: the hash its digests use.
        files: ``{path inside the iteration folder ("/"-separated): FileDigest}``.
    """

    path: str
    iteration: int
    algorithm: str
    files: Dict[str, FileDigest]


# ---------------------------------------------------------------- names
def relative_name(path: str, folder: str) -> str:
    """``path``'s name inside the iteration ``folder``, as a manifest keys it."""
    rel = os.path.relpath(os.path.abspath(path), os.path.abspath(folder))
    if rel.startswith(os.pardir + os.sep) or rel == os.pardir or os.path.isabs(rel):
        raise CheckpointError(f"{path} is not inside the checkpoint folder {folder}")
    return rel.replace(os.sep, "/")


def _listing(folder: str) -> Set[str]:
    """Every file under ``folder`` (its manifest aside), by relative name."""
    names = set()
    for current, _, files in os.walk(folder):
        for name in files:
            names.add(relative_name(os.path.join(current, name), folder))
    names.discard(MANIFEST_FILENAME)
    return names


# ---------------------------------------------------------------- write
def write_manifest(folder: str, iteration: int, digests: Dict[str, FileDigest]) -> str:
    """Write ``folder``'s manifest (flushed; the folder is published whole later).

    Args:
        folder: the complete (temporary) iteration folder.
        iteration: its iteration.
        digests: ``{relative name: FileDigest}`` of every file in it, from their writers.

    Returns:
        The manifest's path.

    Raises:
        CheckpointError: a file of the folder has no digest, a digest names a file that is
            not there or has another size, or the digests use several hashes.
    """
    present = _listing(folder)
    unrecorded, absent = sorted(present - set(digests)), sorted(set(digests) - present)
    if unrecorded:
        raise CheckpointError(f"checkpoint file {os.path.join(folder, unrecorded[0])} was "
                              f"written without a digest (every checkpoint file must go "
                              f"through megatron.checkpoint.format.write_checkpoint_file)")
    if absent:
        raise CheckpointError(f"checkpoint file {os.path.join(folder, absent[0])} has a digest "
                              f"but is not in {folder}")
    for name, entry in digests.items():
        size = os.path.getsize(os.path.join(folder, name))
        if size != entry.size:
            raise CheckpointError(f"checkpoint file {os.path.join(folder, name)} has {size} "
                                  f"bytes, its writer wrote {entry.size}")
    algorithms = {entry.algorithm for entry in digests.values()}
    if len(algorithms) > 1:
        raise CheckpointError(f"the files of {folder} were hashed with {sorted(algorithms)}: "
                              f"one algorithm per checkpoint")
    algorithm = algorithms.pop() if algorithms else DEFAULT_ALGORITHM
    body = {"manifest": MANIFEST_FORMAT, "iteration": iteration, "algorithm": algorithm,
            "files": {name: {"size": digests[name].size, "digest": digests[name].digest}
                      for name in sorted(digests)}}
    path = os.path.join(folder, MANIFEST_FILENAME)

    def write(target):
        with open(target, "w", encoding="utf-8") as handle:
            json.dump(body, handle, indent=1)
            handle.write("\n")

    durable.write_file(path, write)
    return path


# ---------------------------------------------------------------- read
def _malformed(path: str, why: str) -> CheckpointDigestError:
    return CheckpointDigestError(f"checkpoint manifest {path} is damaged ({why}): the files it "
                                 f"lists cannot be verified")


def read_manifest(folder: str) -> Optional[Manifest]:
    """``folder``'s manifest, or None when it has none.

    Raises:
        CheckpointDigestError: the manifest is truncated, not JSON, or not a manifest.
    """
    path = os.path.join(folder, MANIFEST_FILENAME)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as handle:
            body = json.loads(handle.read().decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise _malformed(path, f"not JSON: {exc}") from None
    if not isinstance(body, dict) or body.get("manifest") != MANIFEST_FORMAT:
        raise _malformed(path, f"no {MANIFEST_FORMAT!r} header")
    algorithm, files, iteration = body.get("algorithm"), body.get("files"), body.get("iteration")
    if algorithm not in ALGORITHMS:
        raise _malformed(path, f"unknown algorithm {algorithm!r}")
    if not isinstance(files, dict) or not isinstance(iteration, int):
        raise _malformed(path, "no file list or iteration")
    entries = {}
    for name, entry in files.items():
        ok = isinstance(entry, dict) and isinstance(entry.get("size"), int) and \
            isinstance(entry.get("digest"), str)
        if not ok or name.startswith("/") or ".." in name.split("/"):
            raise _malformed(path, f"bad entry {name!r}")
        entries[name] = FileDigest(entry["size"], entry["digest"], algorithm)
    return Manifest(path, iteration, algorithm, entries)


def compare(path: str, expected: FileDigest, manifest_path: str) -> None:
    """Hash ``path`` and raise unless it matches ``expected``.

    Raises:
        CheckpointDigestError: naming the file and both digests (and sizes when they differ).
    """
    if not os.path.isfile(path):
        raise CheckpointDigestError(f"checkpoint file {path} is missing (listed in "
                                    f"{manifest_path})")
    found = file_digest(path, expected.algorithm)
    if found.digest == expected.digest and found.size == expected.size:
        return
    sizes = "" if found.size == expected.size else \
        f"; {found.size} bytes, {expected.size} expected"
    raise CheckpointDigestError(f"checkpoint file {path} is damaged: {expected.algorithm} "
                                f"digest {found.digest} found, {expected.digest} expected "
                                f"(from {manifest_path}){sizes}")


def verify_folder(folder: str) -> Tuple[Optional[Manifest], List[str]]:
    """Check every file of an iteration folder against its manifest (the verify tool).

    Returns:
        ``(manifest or None, problems)``: one line per damaged, missing or unlisted file, or
        for a damaged or missing manifest; no problems means every byte verified.
    """
    try:
        manifest = read_manifest(folder)
    except CheckpointDigestError as exc:
        return None, [str(exc)]
    if manifest is None:
        return None, [f"{folder} has no {MANIFEST_FILENAME}: its files cannot be verified "
                      f"(written before checkpoints carried digests, or not a checkpoint)"]
    problems = []
    for name in sorted(manifest.files):
        try:
            compare(os.path.join(folder, name), manifest.files[name], manifest.path)
        except CheckpointDigestError as exc:
            problems.append(str(exc))
    for name in sorted(_listing(folder) - set(manifest.files)):
        problems.append(f"checkpoint file {os.path.join(folder, name)} is not listed in "
                        f"{manifest.path}")
    return manifest, problems


# ---------------------------------------------------------------- verification on read
@dataclass
class Verification:
    """The checks of one load: which files were verified, which folders had no manifest.

    Attributes:
        enabled: False under ``--no-verify-checkpoint`` (nothing is checked).
        checked: the files verified, in order.
        unverified: iteration folders read without a manifest.
        manifests: the manifests read, by folder.
    """

    enabled: bool = True
    checked: List[str] = field(default_factory=list)
    unverified: Set[str] = field(default_factory=set)
    manifests: Dict[str, Optional[Manifest]] = field(default_factory=dict)
    _folders_listed: Set[str] = field(default_factory=set)

    def _manifest(self, folder):
        if folder not in self.manifests:
            self.manifests[folder] = read_manifest(folder)
        return self.manifests[folder]

    def check(self, path: str) -> None:
        """Verify one file before it is read (see :func:`check_file`)."""
        if not self.enabled:
            return
        folder = os.path.dirname(os.path.dirname(os.path.abspath(path)))
        manifest = self._manifest(folder)
        if manifest is None:
            self.unverified.add(folder)
            return
        name = relative_name(path, folder)
        if name not in manifest.files and not os.path.exists(path):
            return  # never written (another layout's name): the reader says it is missing
        if name not in manifest.files:
            raise CheckpointDigestError(f"checkpoint file {path} is not listed in "
                                        f"{manifest.path}: it does not belong to this "
                                        f"checkpoint")
        self._check_listed_present(folder, name, manifest)
        compare(path, manifest.files[name], manifest.path)
        self.checked.append(path)

    def _check_listed_present(self, folder, name, manifest):
        """Once per rank folder: every file the manifest lists there exists (a lost
        optimizer shard would otherwise make the folder look saved at a smaller size)."""
        sub = name.rsplit("/", 1)[0] if "/" in name else ""
        if sub in self._folders_listed:
            return
        self._folders_listed.add(sub)
        where = os.path.join(folder, sub)
        here = set(os.listdir(where)) if os.path.isdir(where) else set()
        for listed in sorted(manifest.files):
            parent, base = listed.rsplit("/", 1) if "/" in listed else ("", listed)
            if parent == sub and base not in here:
                raise CheckpointDigestError(f"checkpoint file {os.path.join(folder, listed)} "
                                            f"is missing (listed in {manifest.path})")


_SCOPE: contextvars.ContextVar = contextvars.ContextVar("checkpoint_verification",
                                                        default=None)


@contextlib.contextmanager
def verification(enabled: bool = True) -> Iterator[Verification]:
    """Scope the checkpoint reads of one load: each file read inside is verified (unless
    ``enabled`` is False) and recorded in the :class:`Verification` yielded.

    Args:
        enabled: verify the files (``--no-verify-checkpoint`` passes False).
    """
    scope = Verification(enabled)
    token = _SCOPE.set(scope)
    try:
        yield scope
    finally:
        _SCOPE.reset(token)


def check_file(path: str) -> None:
    """Verify the native checkpoint file ``path`` against its iteration folder's manifest
    (``<iter folder>/<rank folder>/<file>``) before it is read; a folder without a manifest
    is noted, not refused. Outside a :func:`verification` scope the check still runs.

    Raises:
        CheckpointDigestError: the file differs from its entry, is missing or unlisted, or
            the manifest is damaged.
    """
    scope = _SCOPE.get()
    (scope if scope is not None else Verification()).check(path)

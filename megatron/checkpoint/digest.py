"""Digests of checkpoint files, computed from the bytes as they are written.

``torch.save`` writes its archive sequentially through the file object it is given, so a
thin wrapper (:class:`DigestingWriter`) that feeds every chunk to a hash as it passes it on
yields the digest of the file's bytes without a second pass over them (the same bytes a
later read hashes: ``tests/test_checkpoint_digest.py`` checks it). A large chunk (a tensor's
storage) is hashed on a helper thread while the calling thread writes it: the hash and the
write both release the GIL, so where a core is free the hash can run during the write (that
it helps was not measurable on the shared 2-core dev machine: docs/benchmarks.md). Reading
one back (:func:`file_digest`) streams it through the same hash in fixed-size chunks.

The hash: XXH3-128 (the ``xxhash`` package). It exists to catch accidental damage (a bad disk,
a torn copy, a faulty transfer), not tampering, so a non-cryptographic hash with 128 bits
(a random corruption goes unnoticed with probability 2^-128) is enough, and it is the only
one of the candidates whose cost is small beside a save's: on the dev machine it
hashes a GB in 0.034 s, zlib's CRC-32 in 0.19 s or more and hashlib's BLAKE2b in 0.87 s or
more, against a save of 0.6 s or more (docs/benchmarks.md, ``benchmarks/checkpoint_digest.py``).
The other two stay available by name for the benchmark and for manifests that name them.
"""
import hashlib
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

import torch

from ..common.errors import CheckpointError

DEFAULT_ALGORITHM = "xxh3_128"

#: Bytes read at a time when a file is hashed back (one reused buffer).
READ_CHUNK = 16 << 20

#: Records at least this large are hashed on a helper thread while this one writes them
#: (both release the GIL), so the save takes the longer of the two, not their sum.
OVERLAP_BYTES = 1 << 20


class _Crc32:
    """zlib's CRC-32 behind hashlib's ``update`` / ``hexdigest``."""

    def __init__(self):
        self.value = 0

    def update(self, data) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


def _xxh3_128():
    try:
        import xxhash
    except ImportError:
        raise CheckpointError("checkpoint digests need the xxhash package (a dependency of "
                              "megatron-tds): pip install xxhash") from None
    return xxhash.xxh3_128()


#: Name (as a manifest records it) -> a fresh hash object with ``update`` / ``hexdigest``.
ALGORITHMS: Dict[str, Callable[[], Any]] = {
    "xxh3_128": _xxh3_128,
    "blake2b": hashlib.blake2b,
    "crc32": _Crc32,
}


@dataclass(frozen=True)
class FileDigest:
    """What a manifest records of one file.

    Attributes:
        size: its length in bytes.
        digest: the hex digest of its bytes.
        algorithm: the hash (a key of :data:`ALGORITHMS`).
    """

    size: int
    digest: str
    algorithm: str = DEFAULT_ALGORITHM


def new_hash(algorithm: str):
    """A fresh hash object for ``algorithm`` (raises CheckpointError when unknown)."""
    if algorithm not in ALGORITHMS:
        raise CheckpointError(f"unknown digest algorithm {algorithm!r}; known: "
                              f"{', '.join(sorted(ALGORITHMS))}")
    return ALGORITHMS[algorithm]()


class DigestingWriter:
    """A write-only file object that hashes every byte before writing it to ``raw``.

    Args:
        raw: a binary file opened for writing.
        algorithm: the hash (:data:`ALGORITHMS`).
        helper: a one-thread executor that hashes large records while they are written
            (None: hash them on the calling thread first).
    """

    def __init__(self, raw, algorithm: str = DEFAULT_ALGORITHM,
                 helper: Optional[ThreadPoolExecutor] = None):
        self.raw, self.algorithm, self._helper = raw, algorithm, helper
        self._hash = new_hash(algorithm)
        self.size = 0
        self.name = getattr(raw, "name", None)  # what a file object answers (fault tests)

    def write(self, data) -> int:
        view = memoryview(data)
        if self._helper is not None and view.nbytes >= OVERLAP_BYTES:
            # in order: each record's hash is complete before the next one starts, and
            # before torch.save may reuse the buffer behind the view
            hashed = self._helper.submit(self._hash.update, view)
            self.raw.write(view)
            hashed.result()
        else:
            self._hash.update(view)
            self.raw.write(view)
        self.size += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        self.raw.flush()

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False  # a hole skipped by a seek would not be in the digest

    def result(self) -> FileDigest:
        """The digest of everything written so far."""
        return FileDigest(self.size, self._hash.hexdigest(), self.algorithm)


def save_with_digest(obj: Any, path: str, algorithm: str = DEFAULT_ALGORITHM,
                     overlap: bool = True) -> FileDigest:
    """``torch.save(obj, path)``, hashing the bytes on their way to the file.

    Args:
        obj: what to save.
        path: the file to write (created or truncated; not flushed to disk here).
        algorithm: the hash.
        overlap: hash large records on a helper thread while they are written.

    Returns:
        The file's :class:`FileDigest`.
    """
    helper = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-digest") if overlap else None
    try:
        with open(path, "wb") as raw:
            writer = DigestingWriter(raw, algorithm, helper)
            torch.save(obj, writer)
            writer.flush()
    finally:
        if helper is not None:
            helper.shutdown()
    return writer.result()


def file_digest(path: str, algorithm: str = DEFAULT_ALGORITHM) -> FileDigest:
    """The digest of the file at ``path``, read in :data:`READ_CHUNK` pieces.

    Args:
        path: an existing file.
        algorithm: the hash.
    """
    digest = new_hash(algorithm)
    buffer = bytearray(READ_CHUNK)
    view = memoryview(buffer)
    size = 0
    with open(path, "rb", buffering=0) as handle:
        while True:
            count = handle.readinto(buffer)
            if not count:
                break
            digest.update(view[:count])
            size += count
    return FileDigest(size, digest.hexdigest(), algorithm)

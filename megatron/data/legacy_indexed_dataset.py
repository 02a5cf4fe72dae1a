"""Read-only reader for Megatron-LM's older ``lazy`` / ``cached`` indexed format (``TNTIDX``).

Megatron-LM (v1 to v2.x, ``--dataset-impl lazy`` or ``cached``) wrote both with the same
files; only its loader differed. Layout of the ``.idx`` (little endian)::

    8 bytes  magic b"TNTIDX\\x00\\x00"
    u64      version (1)
    u64 u64  dtype code, element size in bytes
    u64 u64  N items, S = number of size entries (one per item dimension)
    u64      D = number of document-index entries
    i64[N+1] dim_offsets: item i's shape is sizes[dim_offsets[i]:dim_offsets[i+1]]
    i64[N+1] data_offsets: item i is elements [data_offsets[i], data_offsets[i+1]) of .bin
    i64[S]   sizes
    i64[D]   doc_idx

The ``.bin`` is the items' elements back to back. Token datasets hold 1-D items; this reader
serves them with the interface of :class:`~megatron.data.indexed_dataset.MMapIndexedDataset`
(``sizes``, ``pointers``, ``doc_idx``, ``get``), through a memory map, so "lazy" and "cached"
files train exactly like mmap ones. Nothing here writes this format.
"""
import os
import struct

import numpy as np

from megatron.data.sequence_access import SequenceAccess
from megatron.common.errors import DataError

MAGIC = b"TNTIDX\x00\x00"
_HEADER = struct.Struct("<8sQQQQQQ")  # magic, version, code, element size, N, S, D


class LegacyIndexedDataset(SequenceAccess):
    """A ``TNTIDX`` (lazy/cached) dataset at ``path_prefix`` (``.idx`` + ``.bin``).

    Args:
        path_prefix: the files' common prefix (no extension).
        dtypes: the dtype-code table (``indexed_dataset.DTYPES``).
    """

    def __init__(self, path_prefix, dtypes):
        self.path_prefix = path_prefix
        idx_path, bin_path = path_prefix + ".idx", path_prefix + ".bin"
        with open(idx_path, "rb") as f:
            raw = f.read()
        if len(raw) < _HEADER.size or raw[:8] != MAGIC:
            raise DataError(f"{idx_path} is not a TNTIDX (lazy/cached) index")
        _, version, code, elem, n, s, d = _HEADER.unpack_from(raw)
        if version != 1 or code not in dtypes or np.dtype(dtypes[code]).itemsize != elem:
            raise DataError(f"{idx_path}: unsupported TNTIDX header (version {version}, dtype "
                            f"code {code}, element size {elem})")
        expected = _HEADER.size + 8 * (2 * (n + 1) + s + d)
        if len(raw) != expected:
            raise DataError(f"{idx_path}: {len(raw)} bytes, the header promises {expected}; the "
                            f"file is truncated or corrupt")
        longs = np.frombuffer(raw, np.int64, offset=_HEADER.size)
        dim_offsets, data_offsets = longs[:n + 1], longs[n + 1:2 * n + 2]
        sizes = longs[2 * n + 2:2 * n + 2 + s]
        if not np.array_equal(np.diff(dim_offsets), np.ones(n, np.int64)):
            raise DataError(f"{idx_path}: items with more than one dimension; token datasets "
                            f"are 1-D (re-run tools/preprocess_data.py)")
        self._dtype = np.dtype(dtypes[code])
        self._sizes = sizes.astype(np.int32)
        self._pointers = data_offsets[:-1] * elem  # bytes, like MMIDIDX pointers
        self._doc_idx = longs[2 * n + 2 + s:].copy()
        need = int(data_offsets[-1]) * elem
        have = os.path.getsize(bin_path)
        if have < need:
            raise DataError(f"{bin_path}: {have} bytes, the index needs {need}; the data file "
                            f"is truncated or belongs to another index")
        self._bin = np.memmap(bin_path, mode="r", dtype=np.uint8) if have else np.zeros(0, np.uint8)

    dtype = property(lambda self: self._dtype)
    sizes = property(lambda self: self._sizes)
    pointers = property(lambda self: self._pointers)
    doc_idx = property(lambda self: self._doc_idx)
    supports_prefetch = property(lambda self: False)


def is_legacy_index(path_prefix):
    """Whether ``{path_prefix}.idx`` starts with the TNTIDX magic."""
    try:
        with open(path_prefix + ".idx", "rb") as f:
            return f.read(8) == MAGIC
    except OSError:
        return False

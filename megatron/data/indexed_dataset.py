"""Megatron-LM's memory-mapped indexed dataset (``.bin`` + ``.idx``, magic ``MMIDIDX``).

Byte-compatible with Megatron-LM, so data preprocessed there loads here and vice versa.
The ``.idx`` file, all little-endian::

    9 bytes   magic  b"MMIDIDX\\x00\\x00"
    uint64    version (1)
    uint8     dtype code of the tokens in .bin (see DTYPES)
    uint64    number of sequences N
    uint64    number of doc_idx entries D
    int32[N]  sizes: tokens per sequence
    int64[N]  pointers: byte offset of each sequence in .bin
    int64[D]  doc_idx: sequence index where each document starts, then N at the end

The ``.bin`` file is the sequences' tokens back to back. Files are written under a temporary
name and renamed when complete, so a crash never leaves a half file under the final name.
"""
import os
import shutil
import struct

import numpy as np

from megatron.data.index_check import check_doc_idx, check_entries
from megatron.data.legacy_indexed_dataset import LegacyIndexedDataset, is_legacy_index
from megatron.data.sequence_access import SequenceAccess
from megatron.common.errors import ConfigError, DataError
from megatron.resilience.locks import remove_stale_tmps, tmp_name

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
# Megatron-core's codes (6 = float64, 7 = float32; token data only ever uses the integer ones).
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
          6: np.float64, 7: np.float32, 8: np.uint16}
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, N, D


def code_of(dtype):
    """The MMIDIDX dtype code of a NumPy dtype."""
    dtype = np.dtype(dtype)
    for code, value in DTYPES.items():
        if np.dtype(value) == dtype:
            return code
    raise ConfigError(f"dtype {dtype} cannot be stored in an indexed dataset; "
                      f"use one of {sorted(np.dtype(d).name for d in DTYPES.values())}")


def best_fitting_dtype(vocab_size=None):
    """uint16 when every token id fits (< 65500, Megatron's rule), else int32."""
    if vocab_size is not None and vocab_size < 65500:
        return np.uint16
    return np.int32


def index_file_path(prefix_path):
    return prefix_path + ".idx"


def data_file_path(prefix_path):
    return prefix_path + ".bin"


def dataset_exists(prefix):
    """True when both ``prefix.idx`` and ``prefix.bin`` exist."""
    return os.path.exists(index_file_path(prefix)) and os.path.exists(data_file_path(prefix))


def _tmp_name(path):
    remove_stale_tmps(path)  # a killed writer's leftovers
    return tmp_name(path)


def _check_prefix(prefix):
    if prefix.endswith((".bin", ".idx")):
        raise DataError(f"data prefix {prefix!r} ends with a file extension; pass the prefix "
                        f"without .bin/.idx (e.g. {prefix[:-4]!r})")
    for path in (index_file_path(prefix), data_file_path(prefix)):
        if not os.path.exists(path):
            raise DataError(f"data prefix {prefix!r}: {path} not found; pass the --output-prefix "
                            f"of tools/preprocess_data.py plus '_<key>_document' "
                            f"(e.g. my-corpus_text_document)")


class _Index:
    """The parsed ``.idx`` file; sizes/pointers/doc_idx are views into one memory map."""

    def __init__(self, path):
        file_size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(_HEADER.size)
        if head[:8] == b"TNTIDX\x00\x00":
            raise DataError(f"{path} is in Megatron's older lazy/cached format: open it with "
                            f"indexed_dataset.make_dataset() (read-only)")
        if len(head) < _HEADER.size or head[:9] != MAGIC:
            raise DataError(f"{path} is not a Megatron mmap index (bad magic); rebuild it with "
                            f"tools/preprocess_data.py")
        _, version, code, n, d = _HEADER.unpack(head)
        if version != VERSION:
            raise DataError(f"{path}: index version {version}, only version {VERSION} is supported")
        if code not in DTYPES:
            raise DataError(f"{path}: unknown dtype code {code}")
        expected = _HEADER.size + 4 * n + 8 * n + 8 * d
        if file_size != expected:
            raise DataError(f"{path}: {file_size} bytes, the header promises {expected}; the file "
                            f"is truncated or corrupt, rebuild it")
        self.dtype = np.dtype(DTYPES[code])
        self._mmap = np.memmap(path, mode="r", dtype=np.uint8)
        offset = _HEADER.size
        self.sizes = np.frombuffer(self._mmap, np.int32, n, offset)  # [N]
        offset += 4 * n
        self.pointers = np.frombuffer(self._mmap, np.int64, n, offset)  # [N], bytes
        offset += 8 * n
        self.doc_idx = np.frombuffer(self._mmap, np.int64, d, offset)  # [D]


class MMapIndexedDataset(SequenceAccess):
    """Read-only view of ``{path_prefix}.idx`` / ``.bin`` through memory maps.

    Args:
        path_prefix: the files' common prefix (no extension).
        skip_warmup: accepted for Megatron compatibility; pages are read lazily anyway.
    """

    def __init__(self, path_prefix, skip_warmup=True):
        _check_prefix(path_prefix)
        self.path_prefix = path_prefix
        self._index = _Index(index_file_path(path_prefix))
        bin_path = data_file_path(path_prefix)
        need = 0
        if len(self._index.sizes):
            need = int(self._index.pointers[-1]) + int(self._index.sizes[-1]) * self.dtype.itemsize
        have = os.path.getsize(bin_path)
        if have < need:
            raise DataError(f"{bin_path}: {have} bytes, the index needs {need}; the data file is "
                            f"truncated or belongs to another index, rebuild it")
        idx_path = index_file_path(path_prefix)
        check_entries(idx_path, self._index.sizes, self._index.pointers, self.dtype.itemsize,
                      have)
        check_doc_idx(idx_path, self._index.doc_idx, len(self._index.sizes))
        # np.memmap refuses empty files; an empty dataset gets an empty buffer.
        self._bin = np.memmap(bin_path, mode="r", dtype=np.uint8) if have else np.zeros(0, np.uint8)

    @property
    def dtype(self):
        return self._index.dtype

    @property
    def sizes(self):
        return self._index.sizes

    @property
    def pointers(self):
        return self._index.pointers

    @property
    def doc_idx(self):
        return self._index.doc_idx

    @property
    def supports_prefetch(self):
        return False

    @staticmethod
    def exists(path):
        return dataset_exists(path)


def write_index(path, dtype, sizes, doc_idx):
    """Write an ``.idx`` file atomically from per-sequence sizes and the document index.

    Args:
        path: the final ``.idx`` path.
        dtype: the token dtype of the matching ``.bin``.
        sizes: int array [N], tokens per sequence.
        doc_idx: int array [D], starts with 0 and ends with N.
    """
    sizes = np.asarray(sizes, dtype=np.int32)
    itemsize = np.dtype(dtype).itemsize
    pointers = np.zeros(len(sizes), dtype=np.int64)
    np.cumsum(sizes[:-1].astype(np.int64) * itemsize, out=pointers[1:])
    doc_idx = np.asarray(doc_idx, dtype=np.int64)
    tmp = _tmp_name(path)
    with open(tmp, "wb") as f:
        f.write(_HEADER.pack(MAGIC, VERSION, code_of(dtype), len(sizes), len(doc_idx)))
        f.write(sizes.tobytes(order="C"))
        f.write(pointers.tobytes(order="C"))
        f.write(doc_idx.tobytes(order="C"))
    os.replace(tmp, path)


class MMapIndexedDatasetBuilder:
    """Append sequences to a ``.bin`` file, then write the ``.idx`` with :meth:`finalize`.

    Tokens go to a temporary file next to ``data_file``; ``finalize`` renames it into place
    and then writes the index (also via a temporary name), so an interrupted build leaves no
    file under a final name. ``abort()`` removes the temporary file.

    Args:
        data_file: the final ``.bin`` path.
        dtype: token dtype (see :func:`best_fitting_dtype`).
    """

    def __init__(self, data_file, dtype=np.int64):
        self._data_file = data_file
        self._tmp = _tmp_name(data_file)
        self._file = open(self._tmp, "wb")
        self._dtype = np.dtype(dtype)
        code_of(self._dtype)  # reject unsupported dtypes up front
        self._sizes = []
        self._doc_idx = [0]

    def add_item(self, tensor):
        """Append one sequence (a 1-D NumPy array, torch tensor or list of ids)."""
        if hasattr(tensor, "detach"):  # torch.Tensor, without importing torch here
            tensor = tensor.detach().cpu().numpy()
        array = np.asarray(tensor)
        data = array.astype(self._dtype, copy=False)
        self._file.write(data.tobytes(order="C"))
        self._sizes.append(data.size)

    def add_doc(self, tensor, sizes):
        """Append one document made of sequences of the given ``sizes`` (Megatron-core API)."""
        data = np.asarray(tensor).astype(self._dtype, copy=False)
        self._file.write(data.tobytes(order="C"))
        self._sizes.extend(int(s) for s in sizes)
        self.end_document()

    def end_document(self):
        """Mark the sequences added since the last call as one document."""
        self._doc_idx.append(len(self._sizes))

    def merge_file_(self, another_file):
        """Append every sequence and document of the dataset at prefix ``another_file``."""
        _check_prefix(another_file)
        index = _Index(index_file_path(another_file))
        if index.dtype != self._dtype:
            raise DataError(f"cannot merge {another_file} ({index.dtype}) into a {self._dtype} "
                            f"dataset; preprocess both with the same tokenizer")
        offset = len(self._sizes)
        self._sizes.extend(index.sizes.tolist())
        self._doc_idx.extend((offset + index.doc_idx[1:]).tolist())
        self._file.flush()
        with open(data_file_path(another_file), "rb") as src:
            shutil.copyfileobj(src, self._file)

    def finalize(self, index_file):
        """Close the data file, move it into place and write ``index_file``."""
        self._file.close()
        os.replace(self._tmp, self._data_file)
        write_index(index_file, self._dtype, self._sizes, self._doc_idx)

    def abort(self):
        """Drop everything written so far (used when the input turns out to be bad)."""
        if not self._file.closed:
            self._file.close()
        if os.path.exists(self._tmp):
            os.remove(self._tmp)


def make_dataset(path, impl="mmap", skip_warmup=True):
    """Open the indexed dataset at prefix ``path``.

    The format is read from the file's magic whatever ``impl`` says: ``MMIDIDX`` (mmap),
    or Megatron's older ``TNTIDX`` ("lazy"/"cached", read-only, see
    :mod:`megatron.data.legacy_indexed_dataset`).
    """
    if impl not in ("mmap", "infer", "lazy", "cached"):
        raise ConfigError(f"--data-impl {impl!r} is not supported; use 'mmap' (lazy/cached "
                          f"files are recognised and read as well)")
    if is_legacy_index(path):
        _check_prefix(path)
        return LegacyIndexedDataset(path, DTYPES)
    return MMapIndexedDataset(path, skip_warmup=skip_warmup)


def make_builder(out_file, impl="mmap", vocab_size=None):
    """A builder writing ``out_file`` (the ``.bin`` path) with the best dtype for the vocab."""
    if impl != "mmap":
        raise ConfigError(f"--dataset-impl {impl!r} is not supported; use 'mmap'")
    return MMapIndexedDatasetBuilder(out_file, dtype=best_fitting_dtype(vocab_size))

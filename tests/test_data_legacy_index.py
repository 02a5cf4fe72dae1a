"""Megatron's older lazy/cached (TNTIDX) index files load, and give what the mmap files give.

The TNTIDX files are written here by hand from the format's definition (an independent
writer); the same documents also go through the project's mmap builder, and the two
datasets must agree item for item, on every ``get`` window, and on sizes and doc_idx.
"""
import struct

import numpy as np
import pytest

from megatron.data import indexed_dataset
from megatron.common.errors import DataError

CODES = {np.dtype(np.uint16): 8, np.dtype(np.int32): 4, np.dtype(np.int64): 5}


def write_tntidx(prefix, docs, dtype):
    """Megatron's IndexedDatasetBuilder layout: one 1-D item per sentence."""
    dtype = np.dtype(dtype)
    items = [s for doc in docs for s in doc]
    sizes = [len(s) for s in items]
    data_offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    dim_offsets = np.arange(len(items) + 1, dtype=np.int64)
    doc_idx = np.concatenate([[0], np.cumsum([len(d) for d in docs])]).astype(np.int64)
    with open(prefix + ".bin", "wb") as f:
        for s in items:
            f.write(np.asarray(s, dtype=dtype).tobytes())
    with open(prefix + ".idx", "wb") as f:
        f.write(b"TNTIDX\x00\x00" + struct.pack("<Q", 1))
        f.write(struct.pack("<QQ", CODES[dtype], dtype.itemsize))
        f.write(struct.pack("<QQ", len(items), len(sizes)) + struct.pack("<Q", len(doc_idx)))
        for arr in (dim_offsets, data_offsets, np.asarray(sizes, np.int64), doc_idx):
            f.write(arr.tobytes())


def _docs(rng, n=7):
    return [[rng.integers(0, 60000, rng.integers(1, 30)).tolist()
             for _ in range(rng.integers(1, 4))] for _ in range(n)]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_tntidx_reads_like_the_same_data_in_mmap(tmp_path, seed, dtype):
    rng = np.random.default_rng(seed)
    docs = _docs(rng)
    write_tntidx(str(tmp_path / "old"), docs, dtype)
    builder = indexed_dataset.MMapIndexedDatasetBuilder(str(tmp_path / "new.bin"), dtype=dtype)
    for doc in docs:
        for sentence in doc:
            builder.add_item(np.asarray(sentence))
        builder.end_document()
    builder.finalize(str(tmp_path / "new.idx"))
    for impl in ("lazy", "cached", "mmap", "infer"):
        old = indexed_dataset.make_dataset(str(tmp_path / "old"), impl)
        new = indexed_dataset.make_dataset(str(tmp_path / "new"))
        assert old.dtype == np.dtype(dtype) and len(old) == len(new)
        assert np.array_equal(old.sizes, new.sizes) and np.array_equal(old.doc_idx, new.doc_idx)
        assert np.array_equal(old.pointers, new.pointers)
        for i in range(len(new)):
            assert np.array_equal(old[i], new[i])
            off = int(rng.integers(0, new.sizes[i]))
            assert np.array_equal(old.get(i, off, new.sizes[i] - off), new.get(i, off))


def test_mmap_class_names_the_older_format(tmp_path, seed):
    write_tntidx(str(tmp_path / "old"), _docs(np.random.default_rng(seed)), np.int32)
    with pytest.raises(DataError, match="lazy/cached format"):
        indexed_dataset.MMapIndexedDataset(str(tmp_path / "old"))
    with open(tmp_path / "old.idx", "r+b") as f:
        f.truncate(60)
    with pytest.raises(DataError, match="truncated"):
        indexed_dataset.make_dataset(str(tmp_path / "old"))

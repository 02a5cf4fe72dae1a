"""MMIDIDX files: our reader/builder against an independent writer/reader made from the spec."""
import os
import re
import struct

import numpy as np
import pytest

from megatron.data import indexed_dataset as ids
from megatron.common.errors import DataError

# The format description, re-implemented here without our module's code.
SPEC_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}


def spec_write(prefix, sequences, doc_idx, code):
    dtype = SPEC_DTYPES[code]
    sizes = [len(s) for s in sequences]
    with open(prefix + ".bin", "wb") as f:
        for s in sequences:
            f.write(np.asarray(s, dtype=dtype).tobytes())
    pointers, pos = [], 0
    for n in sizes:
        pointers.append(pos)
        pos += n * np.dtype(dtype).itemsize
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", code))
        f.write(struct.pack("<Q", len(sizes)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(struct.pack(f"<{len(sizes)}i", *sizes))
        f.write(struct.pack(f"<{len(sizes)}q", *pointers))
        f.write(struct.pack(f"<{len(doc_idx)}q", *doc_idx))


def spec_read(prefix):
    with open(prefix + ".idx", "rb") as f:
        raw = f.read()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    version, code, n, d = struct.unpack_from("<QBQQ", raw, 9)
    assert version == 1
    off = 9 + 8 + 1 + 8 + 8
    sizes = struct.unpack_from(f"<{n}i", raw, off)
    pointers = struct.unpack_from(f"<{n}q", raw, off + 4 * n)
    doc_idx = struct.unpack_from(f"<{d}q", raw, off + 12 * n)
    data = open(prefix + ".bin", "rb").read()
    dtype = np.dtype(SPEC_DTYPES[code])
    seqs = [np.frombuffer(data, dtype, s, p).tolist() for s, p in zip(sizes, pointers)]
    return code, seqs, list(doc_idx)


def _random_dataset(rng, code):
    dtype = SPEC_DTYPES[code]
    hi = min(np.iinfo(dtype).max, 60000)
    n = int(rng.integers(1, 60))
    seqs = [rng.integers(0, hi, int(rng.integers(0, 40))).tolist() for _ in range(n)]
    cuts = np.sort(rng.choice(np.arange(1, n), size=min(n - 1, int(rng.integers(0, n))),
                              replace=False)).tolist() if n > 1 else []
    return seqs, [0] + cuts + [n]


@pytest.mark.parametrize("code", [1, 3, 4, 5, 8])
def test_spec_writer_to_our_reader(tmp_path, seed, code):
    rng = np.random.default_rng(seed)
    seqs, doc_idx = _random_dataset(rng, code)
    prefix = str(tmp_path / "d")
    spec_write(prefix, seqs, doc_idx, code)
    ds = ids.make_dataset(prefix)
    assert len(ds) == len(seqs) and ds.doc_idx.tolist() == doc_idx
    assert ds.sizes.tolist() == [len(s) for s in seqs]
    assert ds.dtype == np.dtype(SPEC_DTYPES[code])
    for i, s in enumerate(seqs):
        assert ds[i].tolist() == s
        if len(s) > 2:
            off = int(rng.integers(0, len(s) - 1))
            length = int(rng.integers(1, len(s) - off + 1))
            assert ds.get(i, off, length).tolist() == s[off:off + length]


@pytest.mark.parametrize("vocab_size", [200, 50257, 250000])
def test_our_builder_to_spec_reader(tmp_path, seed, vocab_size):
    import torch

    rng = np.random.default_rng(seed)
    prefix = str(tmp_path / "d")
    builder = ids.make_builder(ids.data_file_path(prefix), "mmap", vocab_size)
    seqs, doc_idx = [], [0]
    for _ in range(int(rng.integers(1, 30))):
        for _ in range(int(rng.integers(1, 4))):
            s = rng.integers(0, vocab_size, int(rng.integers(0, 50)))
            builder.add_item(torch.from_numpy(s) if rng.random() < 0.5 else s)
            seqs.append(s.tolist())
        builder.end_document()
        doc_idx.append(len(seqs))
    builder.finalize(ids.index_file_path(prefix))
    code, got, got_doc_idx = spec_read(prefix)
    assert code == (8 if vocab_size < 65500 else 4)
    assert got == seqs and got_doc_idx == doc_idx
    assert sorted(os.listdir(tmp_path)) == ["d.bin", "d.idx"]  # no temporary leftovers


def test_merge_equals_concatenation(tmp_path, seed):
    rng = np.random.default_rng(seed)
    parts = []
    for name in "ab":
        seqs, doc_idx = _random_dataset(rng, 8)
        spec_write(str(tmp_path / name), seqs, doc_idx, 8)
        parts.append((seqs, doc_idx))
    builder = ids.MMapIndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=np.uint16)
    builder.merge_file_(str(tmp_path / "a"))
    builder.merge_file_(str(tmp_path / "b"))
    builder.finalize(str(tmp_path / "m.idx"))
    _, seqs, doc_idx = spec_read(str(tmp_path / "m"))
    (sa, da), (sb, db) = parts
    assert seqs == sa + sb
    assert doc_idx == da + [len(sa) + d for d in db[1:]]


def test_interrupted_build_leaves_no_final_files(tmp_path):
    builder = ids.MMapIndexedDatasetBuilder(str(tmp_path / "x.bin"), dtype=np.uint16)
    builder.add_item(np.arange(10))
    assert not ids.dataset_exists(str(tmp_path / "x"))
    assert not os.path.exists(tmp_path / "x.bin")
    builder.abort()
    assert os.listdir(tmp_path) == []


def test_bad_files_raise_data_error(tmp_path, seed):
    prefix = str(tmp_path / "d")
    with pytest.raises(DataError, match=r"d.idx not found"):
        ids.make_dataset(prefix)
    with pytest.raises(DataError, match="without .bin/.idx"):
        ids.make_dataset(prefix + ".bin")
    spec_write(prefix, [[1, 2, 3], [4]], [0, 2], 8)
    raw = open(prefix + ".idx", "rb").read()
    open(prefix + ".idx", "wb").write(raw[:-3])
    with pytest.raises(DataError, match="truncated or corrupt"):
        ids.make_dataset(prefix)
    open(prefix + ".idx", "wb").write(b"NOTMAGIC!" + raw[9:])
    with pytest.raises(DataError, match="bad magic"):
        ids.make_dataset(prefix)
    open(prefix + ".idx", "wb").write(raw)
    open(prefix + ".bin", "wb").write(b"\x00\x00")
    with pytest.raises(DataError, match="data file is truncated"):
        ids.make_dataset(prefix)


def _rewrite_index(prefix, edit):
    """Apply ``edit(sizes, pointers, doc_idx)`` (NumPy copies) to the .idx at ``prefix``."""
    raw = bytearray(open(prefix + ".idx", "rb").read())
    n, d = struct.unpack_from("<QQ", raw, 18)
    off = 34
    sizes = np.frombuffer(raw, np.int32, n, off).copy()
    pointers = np.frombuffer(raw, np.int64, n, off + 4 * n).copy()
    doc_idx = np.frombuffer(raw, np.int64, d, off + 12 * n).copy()
    edit(sizes, pointers, doc_idx)
    raw[off:] = sizes.tobytes() + pointers.tobytes() + doc_idx.tobytes()
    open(prefix + ".idx", "wb").write(bytes(raw))


@pytest.mark.parametrize("edit, reason", [
    (lambda s, p, d: p.__setitem__(3, p[3] + 10 ** 9), "past the end of the .bin|starts at"),
    (lambda s, p, d: s.__setitem__(3, -2), "negative size -2"),
    (lambda s, p, d: p.__setitem__(3, p[2]), "starts at byte"),
    (lambda s, p, d: d.__setitem__(1, 10 ** 6), "document 1 starts at sequence 1000000"),
])
def test_bad_entry_in_the_middle_is_named(tmp_path, seed, monkeypatch, edit, reason):
    """Every entry is checked at open, not only the last; blocks must not hide an entry."""
    monkeypatch.setattr("megatron.data.index_check.BLOCK", 2)  # several blocks, odd split
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(0, 500, int(rng.integers(1, 9))).tolist() for _ in range(8)]
    prefix = str(tmp_path / "d")
    spec_write(prefix, seqs, [0, 2, 5, 8], 8)
    assert spec_read(prefix)[1] == seqs and len(ids.make_dataset(prefix)) == 8  # good as is
    _rewrite_index(prefix, edit)
    with pytest.raises(DataError) as info:
        ids.make_dataset(prefix)
    message = str(info.value)
    assert re.search(r"d\.idx: (sequence 3 is corrupt|document 1 )", message), message
    assert re.search(reason, message), message


def test_bad_entry_with_the_last_one_intact_fails_before_any_cache(tmp_path, seed):
    """The issue's case: a middle pointer past the end, the last entry fine; the GPT-2 dataset
    build stops at open, so no index cache is written next to the data."""
    from megatron.data.gpt2_dataset import build_train_valid_test_datasets

    rng = np.random.default_rng(seed)
    seqs = [rng.integers(0, 500, 40).tolist() for _ in range(20)]
    prefix = str(tmp_path / "d")
    spec_write(prefix, seqs, list(range(21)), 8)
    _rewrite_index(prefix, lambda s, p, d: p.__setitem__(7, 10 ** 7))
    with pytest.raises(DataError, match="sequence 7 is corrupt"):
        build_train_valid_test_datasets([prefix], "98,2,0", [8, 2, 0], 16, 1234)
    assert sorted(os.listdir(tmp_path)) == ["d.bin", "d.idx"]

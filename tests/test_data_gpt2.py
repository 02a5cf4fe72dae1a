"""GPT-2 dataset: exact sample contents, epoch coverage, determinism, rank-0 cache, blending."""
import glob
import os

import numpy as np
import pytest

from harness import run_distributed
from megatron.data import indexed_dataset as ids
from megatron.data.gpt2_dataset import build_train_valid_test_datasets, get_train_valid_test_split_
from megatron.common.errors import ConfigError, DataError


def _write(prefix, docs, dtype=np.int32):
    builder = ids.MMapIndexedDatasetBuilder(ids.data_file_path(prefix), dtype=dtype)
    for d in docs:
        builder.add_item(np.asarray(d))
        builder.end_document()
    builder.finalize(ids.index_file_path(prefix))
    return prefix


def _unique_docs(rng, n_docs, base=0):
    """Documents whose tokens are all distinct (token = global position + base)."""
    sizes = rng.integers(0, 60, n_docs)
    starts = np.concatenate(([0], np.cumsum(sizes)))
    return [np.arange(starts[i], starts[i + 1]) + base for i in range(n_docs)]


def test_samples_are_exact_windows_and_cover_the_split(tmp_path, seed):
    rng = np.random.default_rng(seed)
    docs = _unique_docs(rng, int(rng.integers(30, 120)))
    prefix = _write(str(tmp_path / "d"), docs)
    seq = int(rng.integers(4, 40))
    train, valid, test = build_train_valid_test_datasets([prefix], "80,15,5", [300, 50, 10],
                                                         seq, seed % 1000)
    bounds = get_train_valid_test_split_("80,15,5", len(docs))
    for k, ds in enumerate((train, valid, test)):
        split_docs = docs[bounds[k]:bounds[k + 1]]
        split_tokens = np.concatenate(split_docs + [np.zeros(0, np.int64)])
        if ds is None:
            assert len(split_docs) == 0
            continue
        # Brute force: the shuffled document stream, cut into overlapping windows.
        stream = np.concatenate([docs[d] for d in ds.doc_idx])
        windows = {}
        for j in range(len(ds)):
            item = ds[j]["text"]
            assert item.dtype == np.int64 and item.shape == (seq + 1,)
            i = int(ds.shuffle_idx[j])
            assert np.array_equal(item, stream[i * seq:i * seq + seq + 1])
            windows[i] = item
        # The first epoch's samples (those starting in it) come first in the shuffled
        # order, and together they hold every token of the split.
        first_epoch = min(len(ds), -(-len(split_tokens) // seq))
        assert set(ds.shuffle_idx[:first_epoch].tolist()) == set(range(first_epoch))
        seen = np.concatenate([windows[i] for i in range(first_epoch)])
        assert set(seen.tolist()) == set(split_tokens.tolist())
        assert len(ds) >= [300, 50, 10][k]


def test_same_seed_same_order_other_seed_differs(tmp_path, seed):
    rng = np.random.default_rng(seed)
    prefix = _write(str(tmp_path / "d"), _unique_docs(rng, 80))
    a = build_train_valid_test_datasets([prefix], "1", [200, 0, 0], 16, 7)[0]
    for f in glob.glob(prefix + "_*"):  # force a rebuild, not a cache read
        os.remove(f)
    b = build_train_valid_test_datasets([prefix], "1", [200, 0, 0], 16, 7)[0]
    c = build_train_valid_test_datasets([prefix], "1", [200, 0, 0], 16, 8)[0]
    ga = np.stack([a[i]["text"] for i in range(len(a))])
    assert np.array_equal(ga, np.stack([b[i]["text"] for i in range(len(b))]))
    assert not np.array_equal(ga, np.stack([c[i]["text"] for i in range(len(c))]))


def _ranks_build(prefix):
    import torch.distributed as dist

    train, _, _ = build_train_valid_test_datasets([prefix], "90,10,0", [150, 20, 0], 12, 3)
    files = sorted(glob.glob(prefix + "_train_indexmap_*"))
    text = np.stack([train[i]["text"] for i in range(len(train))])
    return dist.get_rank(), files, text, isinstance(train.shuffle_idx, np.memmap)


def test_rank0_builds_the_cache_and_every_rank_reads_it(tmp_path, seed):
    rng = np.random.default_rng(seed)
    prefix = _write(str(tmp_path / "d"), _unique_docs(rng, 60))
    results = run_distributed(_ranks_build, 3, prefix, timeout=120)
    names = [os.path.basename(f) for f in results[0][1]]
    assert names == [f"d_train_indexmap_150ns_12sl_3s_{k}" for k in
                     ("desc.json", "doc_idx.npy", "sample_idx.npy", "shuffle_idx.npy")]
    for rank, files, text, mapped in results:
        assert files == results[0][1] and mapped  # read back through mmap
        assert np.array_equal(text, results[0][2])
    assert not glob.glob(str(tmp_path / "*.tmp-*"))


def test_blend_proportions(tmp_path, seed):
    rng = np.random.default_rng(seed)
    a = _write(str(tmp_path / "a"), _unique_docs(rng, 40))
    b = _write(str(tmp_path / "b"), _unique_docs(rng, 40, base=10**6))
    w = float(rng.uniform(0.1, 0.9))
    train, _, _ = build_train_valid_test_datasets([str(w), a, str(1 - w), b], "1", [10000, 0, 0],
                                                  8, 1)
    assert len(train) == 10000
    from_b = sum(int(train[i]["text"][0] >= 10**6) for i in range(10000))
    assert abs(from_b / 10000 - (1 - w)) < 0.01


def test_split_strings():
    assert get_train_valid_test_split_("949,50,1", 1000) == [0, 949, 999, 1000]
    assert get_train_valid_test_split_("1", 7) == [0, 7, 7, 7]
    assert get_train_valid_test_split_("98/2", 100) == [0, 98, 100, 100]
    for bad in ("a,b", "0,0,0", "1,2,3,4", "-1,2"):
        with pytest.raises(ConfigError, match="--split"):
            get_train_valid_test_split_(bad, 10)


def test_bad_data_path(tmp_path):
    with pytest.raises(DataError, match="nothing.idx not found"):
        build_train_valid_test_datasets([str(tmp_path / "nothing")], "1", [1, 0, 0], 8, 1)
    with pytest.raises(ConfigError, match="weight/prefix"):
        build_train_valid_test_datasets(["0.5", "a", "b"], "1", [1, 0, 0], 8, 1)
    with pytest.raises(ConfigError, match="should be the weight"):
        build_train_valid_test_datasets(["x", "a", "0.5", "b"], "1", [1, 0, 0], 8, 1)

"""C++ index builders against their NumPy twins and brute-force references."""
import numpy as np
import pytest

from megatron.data import helpers


def _brute_sample_idx(sizes, doc_idx, seq_length, num_samples):
    """Token-by-token walk: where does global token i * seq_length sit?"""
    where = [(p, o) for p, d in enumerate(doc_idx) for o in range(sizes[d])]
    return np.array([where[i * seq_length] for i in range(num_samples + 1)], dtype=np.int64)


def test_cpp_module_builds():
    assert helpers.cpp_module() is not None, "g++/pybind11 build of csrc/data/helpers.cpp failed"


def test_sample_idx_cpp_numpy_bruteforce(seed):
    rng = np.random.default_rng(seed)
    for _ in range(30):
        n = int(rng.integers(1, 40))
        sizes = rng.integers(0, 30, n).astype(np.int32)  # empty documents included
        if sizes.sum() < 2:
            sizes[0] = 2
        epochs = int(rng.integers(1, 4))
        doc_idx = np.concatenate([rng.permutation(n) for _ in range(epochs)])
        seq = int(rng.integers(1, 50))
        total = (int(sizes.sum()) * epochs - 1) // seq
        want = _brute_sample_idx(sizes, doc_idx, seq, total)
        for impl in ("cpp", "numpy"):
            got = helpers.build_sample_idx(sizes, doc_idx, seq, total, impl=impl)
            assert got.dtype == np.int64 and np.array_equal(got, want), impl
            with pytest.raises(IndexError):
                helpers.build_sample_idx(sizes, doc_idx, seq, total + 1 + int(sizes.max()),
                                         impl=impl)


def test_sample_idx_large_random(seed):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(0, 300, 50000).astype(np.int32)
    doc_idx = np.concatenate([rng.permutation(50000), rng.permutation(50000)])
    seq = int(rng.integers(8, 2048))
    total = (2 * int(sizes.sum()) - 1) // seq
    a = helpers.build_sample_idx(sizes, doc_idx, seq, total, impl="cpp")
    b = helpers.build_sample_idx(sizes, doc_idx, seq, total, impl="numpy")
    assert np.array_equal(a, b)


def test_blending_cpp_numpy_and_proportions(seed):
    rng = np.random.default_rng(seed)
    for _ in range(10):
        k = int(rng.integers(1, 6))
        weights = rng.random(k) + 0.01
        weights /= weights.sum()
        size = int(rng.integers(1, 20000))
        di_c, si_c = helpers.build_blending_indices(weights, size, impl="cpp")
        di_n, si_n = helpers.build_blending_indices(weights, size, impl="numpy")
        assert np.array_equal(di_c, di_n) and np.array_equal(si_c, si_n)
        # Every prefix is near its target share: dataset d's count at due time T is
        # floor(T w_d + 1/2), and the prefix length is within k/2 of T, so the gap is
        # at most 1/2 + w_d * k/2.
        onehot = np.eye(k, dtype=np.int64)[di_c]
        counts = np.cumsum(onehot, axis=0)  # [size, k]
        target = np.arange(1, size + 1)[:, None] * weights[None, :]
        assert (np.abs(counts - target) <= 0.5 + weights * k / 2 + 1e-9).all()
        # Sample indices count up per dataset: 0, 1, 2, ...
        for d in range(k):
            assert np.array_equal(si_c[di_c == d], np.arange((di_c == d).sum()))

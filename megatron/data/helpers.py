"""Sample-index and blending-index builders: C++ (csrc/data/helpers.cpp) with NumPy twins.

The C++ module is compiled on first use through :func:`megatron.fused_kernels.build_utils.load_native`
(cached per source hash, rank 0 first). When it cannot be built, the NumPy versions below
run instead; both return identical arrays (tests/test_data_helpers.py). Set
``MEGATRON_TDS_DATA_HELPERS=numpy`` to force the fallback.
"""
import importlib.util
import logging
import os
import subprocess
import sys
import sysconfig

import numpy as np

from megatron.fused_kernels.build_utils import CSRC_DIR, load_native
from megatron.resilience.locks import remove_stale_tmps, tmp_name

logger = logging.getLogger(__name__)

SOURCE = CSRC_DIR / "data" / "helpers.cpp"
MODULE_NAME = "megatron_data_helpers"
CXXFLAGS = ("-O3", "-shared", "-fPIC", "-std=c++17")


def _builder(directory):
    """Compile helpers.cpp into ``directory`` (if not there yet) and import it."""
    target = directory / (MODULE_NAME + sysconfig.get_config_var("EXT_SUFFIX"))
    if not target.exists():
        includes = subprocess.run([sys.executable, "-m", "pybind11", "--includes"], check=True,
                                  capture_output=True, text=True).stdout.split()
        remove_stale_tmps(target)  # a killed compiler's output
        tmp = tmp_name(target)
        cmd = [os.environ.get("CXX", "g++"), *CXXFLAGS, *includes, str(SOURCE), "-o", str(tmp)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr}")
        os.replace(tmp, target)
    spec = importlib.util.spec_from_file_location(MODULE_NAME, target)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cpp_module():
    """The compiled helpers module, or None (fallback, logged once)."""
    if os.environ.get("MEGATRON_TDS_DATA_HELPERS", "").lower() == "numpy":
        return None
    return load_native(MODULE_NAME, [SOURCE], _builder, extra_key=CXXFLAGS,
                       what="C++ data helpers (csrc/data/helpers.cpp)")


def numpy_build_sample_idx(sizes, doc_idx, seq_length, num_samples):
    """NumPy twin of the C++ ``build_sample_idx``; see :func:`build_sample_idx`."""
    lengths = np.asarray(sizes)[np.asarray(doc_idx)].astype(np.int64)  # [D] in stream order
    ends = np.cumsum(lengths)  # [D] global position just past each document
    targets = np.arange(num_samples + 1, dtype=np.int64) * seq_length  # [S+1]
    # The first document that ends after the target holds it (skips empty documents too).
    pos = np.searchsorted(ends, targets, side="right")
    if num_samples >= 0 and (len(ends) == 0 or pos[-1] >= len(ends)):
        raise IndexError("not enough tokens for num_samples samples")
    out = np.empty((num_samples + 1, 2), dtype=np.int64)
    out[:, 0] = pos
    out[:, 1] = targets - (ends[pos] - lengths[pos])
    return out


def build_sample_idx(sizes, doc_idx, seq_length, num_samples, impl=None):
    """Locate the first token of each sample in the document stream.

    Args:
        sizes: int32 [N] tokens per sequence of the indexed dataset.
        doc_idx: int64 [D] sequence ids in stream order (shuffled, over all epochs).
        seq_length: tokens per sample minus one (samples share their boundary token).
        num_samples: samples to index; needs ``num_samples * seq_length + 1`` tokens.
        impl: None (C++ when available), "cpp" or "numpy".

    Returns:
        int64 [num_samples + 1, 2]: (position in doc_idx, offset in that sequence) of token
        ``i * seq_length``; sample i is tokens ``[i * seq_length, (i + 1) * seq_length]``.
    """
    sizes = np.ascontiguousarray(sizes, dtype=np.int32)
    doc_idx = np.ascontiguousarray(doc_idx, dtype=np.int64)
    module = _pick(impl)
    if module is None:
        return numpy_build_sample_idx(sizes, doc_idx, seq_length, num_samples)
    return module.build_sample_idx(sizes, doc_idx, int(seq_length), int(num_samples))


def numpy_build_blending_indices(weights, size):
    """NumPy twin of the C++ ``build_blending_indices``; see :func:`build_blending_indices`."""
    weights = np.asarray(weights, dtype=np.float64)
    due, owner, rank = [], [], []
    for d, w in enumerate(weights):  # one vectorised block per dataset, not per sample
        count = int(min(size, np.ceil(size * w) + 2))
        k = np.arange(count, dtype=np.int64)
        due.append((k + 0.5) / w)
        owner.append(np.full(count, d, dtype=np.int32))
        rank.append(k)
    due, owner, rank = (np.concatenate(a) for a in (due, owner, rank))
    order = np.lexsort((owner, due))[:size]  # by due time, ties to the lower dataset
    return owner[order], rank[order]


def build_blending_indices(weights, size, impl=None):
    """Interleave datasets so that every prefix of the order follows ``weights``.

    Args:
        weights: float [K], positive, summing to 1.
        size: number of blended samples.
        impl: None (C++ when available), "cpp" or "numpy".

    Returns:
        (dataset_index int32 [size], dataset_sample_index int64 [size]): sample i is sample
        ``dataset_sample_index[i]`` of dataset ``dataset_index[i]``.
    """
    weights = np.ascontiguousarray(weights, dtype=np.float64)
    if len(weights) == 0 or not np.all(weights > 0):
        raise ValueError("blending weights must be positive")
    module = _pick(impl)
    if module is None:
        return numpy_build_blending_indices(weights, size)
    return module.build_blending_indices(weights, int(size))


def _pick(impl):
    if impl == "numpy":
        return None
    module = cpp_module()
    if impl == "cpp" and module is None:
        raise RuntimeError("the C++ data helpers could not be built (see the log above)")
    return module

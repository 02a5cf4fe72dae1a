"""Build-once, mmap-everywhere cache of index arrays (``.npy`` next to the data).

Global rank 0 builds the arrays and writes them (temporary name + rename, a small
``_desc.json`` last, which marks the set complete); then it tells every rank whether that
worked (:func:`megatron.resilience.agreement.agree`, which doubles as the barrier: a failure raises the
same error, with rank 0's cause, on every rank), and every rank memory-maps the files.
A rank that cannot see the files afterwards (node-local disks on a multi-node run) builds
the same arrays itself: the construction is deterministic, so every rank agrees.
"""
import json
import logging
import os

import numpy as np

from megatron.resilience.agreement import agree
from megatron.common.errors import DataError
from megatron.resilience.locks import remove_stale_tmps, tmp_name

logger = logging.getLogger(__name__)


def _dist():
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist
    return None


def _valid(paths, desc_path, desc):
    if not all(os.path.exists(p) for p in paths.values()) or not os.path.exists(desc_path):
        return False
    try:
        with open(desc_path) as f:
            return json.load(f) == desc
    except (OSError, ValueError):
        return False


def _atomic_write(path, write):
    remove_stale_tmps(path)  # a killed writer's leftovers
    tmp = tmp_name(path)
    try:
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _save(paths, desc_path, desc, arrays):
    for key, path in paths.items():
        _atomic_write(path, lambda f, a=arrays[key]: np.save(f, a, allow_pickle=False))
    _atomic_write(desc_path, lambda f: f.write(json.dumps(desc, sort_keys=True).encode()))


def _load(paths):
    return {k: np.load(p, mmap_mode="r", allow_pickle=False) for k, p in paths.items()}


def cached_arrays(paths, desc_path, desc, build):
    """Arrays from the cache files, building them on rank 0 first when missing or stale.

    Must be called on every rank when torch.distributed is initialised (it synchronises).

    Args:
        paths: {key: .npy path}.
        desc_path: JSON file describing what the arrays were built from.
        desc: JSON-able description; a cache with another description is rebuilt.
        build: ``build() -> {key: np.ndarray}``, deterministic.

    Returns:
        {key: array} (memory-mapped when read from the cache).
    """
    dist = _dist()
    rank = dist.get_rank() if dist else 0
    error, arrays = None, None
    if rank == 0 and not _valid(paths, desc_path, desc):
        try:
            arrays = build()
            try:
                _save(paths, desc_path, desc, arrays)
                logger.info("wrote index cache %s", desc_path)
            except OSError as exc:  # read-only data folder: keep the arrays in memory
                logger.warning("cannot write the index cache next to the data (%s); every "
                               "rank builds it in memory", exc)
        except Exception as exc:  # told to every rank by the agreement below
            error = exc
    # the agreement doubles as the barrier: the files are complete when it returns
    agree(error, f"building the dataset index {desc_path}", error_type=DataError)
    if _valid(paths, desc_path, desc):
        return _load(paths)
    if arrays is not None:
        return arrays
    logger.warning("index cache %s not visible on rank %d; building it locally", desc_path, rank)
    return build()

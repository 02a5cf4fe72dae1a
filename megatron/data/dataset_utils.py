"""Shared by the GPT-2 and T5 datasets: ``--split`` parsing, ``--data-path`` blends."""
import logging
import math

import numpy as np

from megatron.data.blendable_dataset import BlendableDataset
from megatron.data.indexed_dataset import make_dataset
from megatron.common.errors import ConfigError

logger = logging.getLogger(__name__)
SPLIT_NAMES = ("train", "valid", "test")
BLEND_MARGIN = 1.005  # per-dataset headroom over its share, as in Megatron


def get_train_valid_test_split_(splits_string, size):
    """Boundaries [4] of the train/valid/test document ranges for ``size`` documents.

    Args:
        splits_string: e.g. "949,50,1" (or "/"-separated); weights, normalised, missing = 0.
        size: number of documents.
    """
    text = str(splits_string).replace("/", ",")
    try:
        splits = [float(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ConfigError(f"--split {splits_string!r} must be comma-separated numbers, "
                          f"e.g. 949,50,1") from None
    if not splits or len(splits) > 3 or min(splits) < 0 or sum(splits) <= 0:
        raise ConfigError(f"--split {splits_string!r} needs 1 to 3 non-negative weights with a "
                          f"positive sum, e.g. 949,50,1")
    splits = (splits + [0.0, 0.0])[:3]
    total = sum(splits)
    bounds = [0]
    for weight in splits:
        bounds.append(bounds[-1] + int(round(weight / total * size)))
    shift = bounds[-1] - size  # rounding may over/undershoot: the last split absorbs it
    bounds = [bounds[0]] + [b - shift for b in bounds[1:]]
    return [max(0, b) for b in bounds]


def parse_data_prefix(data_prefix):
    """``(weights, prefixes)`` from ``["prefix"]`` or ``["0.3", "A", "0.7", "B"]``."""
    if isinstance(data_prefix, str):
        data_prefix = [data_prefix]
    items = list(data_prefix)
    if len(items) == 1:
        return [1.0], items
    if not items or len(items) % 2:
        raise ConfigError(f"--data-path {' '.join(items)}: give one prefix, or weight/prefix "
                          f"pairs like '0.3 prefixA 0.7 prefixB'")
    weights, prefixes = [], []
    for weight, prefix in zip(items[::2], items[1::2]):
        try:
            value = float(weight)
        except ValueError:
            raise ConfigError(f"--data-path: {weight!r} should be the weight before prefix "
                              f"{prefix!r} (pairs like '0.3 prefixA 0.7 prefixB')") from None
        if not value > 0 or not math.isfinite(value):
            raise ConfigError(f"--data-path: weight {weight} of {prefix} must be positive")
        weights.append(value)
        prefixes.append(prefix)
    total = sum(weights)
    return [w / total for w in weights], prefixes


def _build_one(prefix, splits_string, num_samples, build_split):
    indexed = make_dataset(prefix)
    bounds = get_train_valid_test_split_(splits_string, len(indexed))
    logger.info("%s: %d documents, split %s", prefix, len(indexed), bounds)
    out = []
    for i, name in enumerate(SPLIT_NAMES):
        if bounds[i + 1] <= bounds[i]:
            out.append(None)
            continue
        documents = np.arange(bounds[i], bounds[i + 1], dtype=np.int64)
        out.append(build_split(prefix, indexed, name, documents, num_samples[i]))
    return out


def build_blended_splits(data_prefix, splits_string, train_valid_test_num_samples, build_split):
    """(train, valid, test) datasets from one prefix or a weighted blend of several.

    Args:
        data_prefix: ``["prefix"]`` or ``["w1", "prefix1", "w2", "prefix2", ...]``.
        splits_string: ``--split``.
        train_valid_test_num_samples: samples needed per split [3].
        build_split: ``build_split(prefix, indexed, name, documents, num_samples)`` -> dataset.

    Returns:
        Three datasets or None (empty split). A blend drops, with a warning, prefixes whose
        split is empty.
    """
    weights, prefixes = parse_data_prefix(data_prefix)
    # Check every prefix exists before building any index.
    for prefix in prefixes:
        make_dataset(prefix)
    if len(prefixes) == 1:
        return tuple(_build_one(prefixes[0], splits_string, train_valid_test_num_samples,
                                build_split))
    per_prefix = []
    for weight, prefix in zip(weights, prefixes):
        need = [int(math.ceil(n * weight * BLEND_MARGIN)) + 1
                for n in train_valid_test_num_samples]
        per_prefix.append(_build_one(prefix, splits_string, need, build_split))
    out = []
    for i, name in enumerate(SPLIT_NAMES):
        parts = [(w, p, ds[i]) for w, p, ds in zip(weights, prefixes, per_prefix)]
        present = [(w, ds) for w, _, ds in parts if ds is not None]
        for _, prefix, ds in parts:
            if ds is None and present:
                logger.warning("%s has no %s documents; left out of the %s blend", prefix,
                               name, name)
        if not present:
            out.append(None)
            continue
        size = max(int(train_valid_test_num_samples[i]), 1)
        out.append(BlendableDataset([ds for _, ds in present], [w for w, _ in present], size))
    return tuple(out)

"""GPT-2 dataset: fixed-length samples cut from the shuffled stream of a split's documents.

For a split (a contiguous range of the indexed dataset's sequences, from ``--split``):

* ``doc_idx`` int64 [epochs * docs]: the split's documents, each epoch shuffled on its own,
  so the first epoch's samples cover every token of the split before anything repeats.
* ``sample_idx`` int64 [samples + 1, 2]: (position in doc_idx, offset) of token
  ``i * seq_length`` (megatron/data/helpers.py); sample i is the ``seq_length + 1`` tokens
  from there, crossing document boundaries.
* ``shuffle_idx`` int64 [samples]: samples shuffled within each epoch, epochs in order.

The three arrays are cached as ``.npy`` next to the data under Megatron's names, built once
by rank 0 (megatron/data/index_cache.py).
"""
import logging

import numpy as np

from megatron.data import helpers
from megatron.data.dataset_utils import build_blended_splits, get_train_valid_test_split_  # noqa: F401
from megatron.data.index_cache import cached_arrays
from megatron.common.errors import ConfigError, DataError
from megatron.observability.progress import progress

logger = logging.getLogger(__name__)


def _epoch_shuffle(values, epoch_of, rng):
    """``values`` reordered: grouped by epoch in order, uniformly shuffled within each."""
    order = np.lexsort((rng.random_sample(len(values)), epoch_of))
    return values[order]


def build_index_arrays(documents, sizes, num_samples, seq_length, seed):
    """doc_idx, sample_idx and shuffle_idx for one split (see the module docstring).

    Args:
        documents: int64 [D] sequence ids of the split.
        sizes: int32 [N] tokens per sequence of the whole indexed dataset.
        num_samples: samples needed; at least one epoch's worth is built.
        seq_length: tokens per sample minus one.
        seed: shuffling seed (numpy RandomState, stable across numpy versions).
    """
    tokens_per_epoch = int(np.sum(sizes[documents], dtype=np.int64))
    # At least one full epoch's worth of samples, so that every token of the split is seen
    # (the last sample of the epoch may reach into the next one).
    total = max(int(num_samples), -(-(tokens_per_epoch - 1) // seq_length))
    num_epochs = -(-(total * seq_length + 1) // tokens_per_epoch)
    rng = np.random.RandomState(seed)
    # Three whole-array steps, each long on a big corpus: the bar shows which one runs.
    bar = progress(total=3, desc=f"sample index ({total} samples)", unit="steps")
    docs = np.tile(np.asarray(documents, dtype=np.int64), num_epochs)
    doc_epoch = np.repeat(np.arange(num_epochs), len(documents))
    doc_idx = _epoch_shuffle(docs, doc_epoch, rng)
    bar.update(1)
    sample_idx = helpers.build_sample_idx(sizes, doc_idx, seq_length, total)
    bar.update(1)
    starts = np.arange(total, dtype=np.int64) * seq_length
    shuffle_idx = _epoch_shuffle(np.arange(total, dtype=np.int64),
                                 starts // tokens_per_epoch, rng)
    bar.update(1)
    bar.close()
    return {"doc": doc_idx, "sample": sample_idx, "shuffle": shuffle_idx}


class GPT2Dataset:
    """Samples of ``seq_length + 1`` tokens: ``{"text": int64 [seq_length + 1]}``.

    Args:
        name: split name ("train", "valid", "test"), part of the cache file names.
        data_prefix: indexed dataset prefix (cache files go next to it).
        documents: int64 [D] sequence ids of this split.
        indexed_dataset: the MMapIndexedDataset.
        num_samples: samples needed (the dataset holds at least one epoch's worth).
        seq_length: tokens per sample minus one.
        seed: shuffling seed.
    """

    def __init__(self, name, data_prefix, documents, indexed_dataset, num_samples, seq_length,
                 seed):
        if seq_length < 1:
            raise ConfigError(f"--seq-length must be >= 1, got {seq_length}")
        self.name, self.indexed_dataset, self.seq_length = name, indexed_dataset, seq_length
        sizes = indexed_dataset.sizes
        tokens = int(np.sum(sizes[documents], dtype=np.int64))
        if tokens < 2:
            raise DataError(f"{data_prefix}: the {name} split has {tokens} tokens; a sample "
                            f"needs at least 2, give it more data or change --split")
        num_samples = max(int(num_samples), 1)
        base = f"{data_prefix}_{name}_indexmap_{num_samples}ns_{seq_length}sl_{seed}s"
        paths = {k: f"{base}_{k}_idx.npy" for k in ("doc", "sample", "shuffle")}
        desc = {"documents": [int(documents[0]), int(documents[-1]) + 1],
                "num_sequences": len(sizes), "tokens_per_epoch": tokens, "format": 1}
        # Loading the C++ helpers is collective under torch.distributed (rank 0 compiles,
        # then tells the others), so every rank does it here, not only the rank that builds.
        helpers.cpp_module()
        arrays = cached_arrays(paths, base + "_desc.json", desc, lambda: build_index_arrays(
            documents, sizes, num_samples, seq_length, seed))
        self.doc_idx, self.sample_idx = arrays["doc"], arrays["sample"]
        self.shuffle_idx = arrays["shuffle"]
        self.num_epochs = len(self.doc_idx) // len(documents)
        self.tokens_per_epoch = tokens
        logger.info("%s: %s split, %d documents, %d epochs, %d samples", data_prefix, name,
                    len(documents), self.num_epochs, len(self))

    def __len__(self):
        return len(self.shuffle_idx)

    def __getitem__(self, idx):
        i = int(self.shuffle_idx[idx])
        (p0, o0), (p1, o1) = self.sample_idx[i], self.sample_idx[i + 1]
        get, doc_idx = self.indexed_dataset.get, self.doc_idx
        if p0 == p1:
            parts = [get(int(doc_idx[p0]), int(o0), int(o1 - o0 + 1))]
        else:  # crosses documents: tail of the first, middle ones whole, head of the last
            parts = [get(int(doc_idx[p0]), int(o0))]
            parts += [get(int(doc_idx[p])) for p in range(p0 + 1, p1)]
            parts.append(get(int(doc_idx[p1]), 0, int(o1 + 1)))
        return {"text": np.concatenate(parts).astype(np.int64)}  # [seq_length + 1]


def build_train_valid_test_datasets(data_prefix, splits_string, train_valid_test_num_samples,
                                    seq_length, seed, skip_warmup=True):
    """Train/valid/test GPT-2 datasets (None for an empty split), blended when asked.

    Call on every rank when torch.distributed is initialised (rank 0 builds the caches).

    Args:
        data_prefix: ``["prefix"]`` or ``["0.3", "prefixA", "0.7", "prefixB"]``.
        splits_string: ``--split``, e.g. "949,50,1".
        train_valid_test_num_samples: samples needed per split [3].
        seq_length: tokens per sample minus one (items have ``seq_length + 1`` tokens).
        seed: shuffling seed.
        skip_warmup: accepted for Megatron compatibility.
    """
    def build(prefix, indexed, name, documents, num_samples):
        return GPT2Dataset(name, prefix, documents, indexed, num_samples, seq_length, seed)

    return build_blended_splits(data_prefix, splits_string, train_valid_test_num_samples, build)

"""Batch sampler and DataLoader for pretraining (Megatron's sequential sampler).

Step ``t`` of the global order covers samples ``[t * m * dp, (t + 1) * m * dp)`` (m = micro
batch size); data-parallel rank r takes the r-th slice of ``m``. So the samples of a global
batch do not depend on dp, and resuming from ``consumed_samples`` continues the exact order.
"""
import numpy as np

from megatron.common.errors import ConfigError


class MegatronPretrainingSampler:
    """Yields lists of ``micro_batch_size`` sample indices for one data-parallel rank.

    Args:
        total_samples: samples in the dataset.
        consumed_samples: samples already used (all ranks together); resume point.
        micro_batch_size: samples per rank per step.
        data_parallel_rank / data_parallel_size: this rank and the number of replicas.
        drop_last: drop a final incomplete global step (otherwise each rank gets its share
            of what is left, possibly fewer than ``micro_batch_size``).
    """

    def __init__(self, total_samples, consumed_samples, micro_batch_size, data_parallel_rank,
                 data_parallel_size, drop_last=True):
        if total_samples <= 0:
            raise ConfigError(f"no samples to draw from (total_samples={total_samples})")
        if micro_batch_size <= 0 or data_parallel_size <= 0:
            raise ConfigError(f"micro batch size ({micro_batch_size}) and data-parallel size "
                              f"({data_parallel_size}) must be positive")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ConfigError(f"data-parallel rank {data_parallel_rank} is outside "
                              f"[0, {data_parallel_size})")
        if not 0 <= consumed_samples < total_samples:
            raise ConfigError(f"consumed samples {consumed_samples} is not below the dataset's "
                              f"{total_samples}; the run has used up its data (build the "
                              f"dataset for more samples, e.g. a larger --train-iters)")
        self.total_samples, self.consumed_samples = total_samples, consumed_samples
        self.micro_batch_size, self.drop_last = micro_batch_size, drop_last
        self.dp_rank, self.dp_size = data_parallel_rank, data_parallel_size
        self.step = micro_batch_size * data_parallel_size

    def __len__(self):
        remaining = self.total_samples - self.consumed_samples
        return remaining // self.step if self.drop_last else -(-remaining // self.step)

    def _slice(self, start, size):
        per_rank = -(-size // self.dp_size) if size < self.step else self.micro_batch_size
        lo = start + self.dp_rank * per_rank
        return list(range(lo, min(lo + per_rank, start + size)))

    def __iter__(self):
        start = self.consumed_samples
        while start + self.step <= self.total_samples:
            yield self._slice(start, self.step)
            start += self.step
        if start < self.total_samples and not self.drop_last:
            batch = self._slice(start, self.total_samples - start)
            if batch:
                yield batch


def _collate(items):
    """List of dicts of int64 NumPy arrays -> dict of int64 tensors [b, ...]."""
    import torch

    return {k: torch.from_numpy(np.stack([np.asarray(it[k], dtype=np.int64) for it in items]))
            for k in items[0]}


def build_pretraining_data_loader(dataset, consumed_samples, micro_batch_size,
                                  data_parallel_rank, data_parallel_size, num_workers=0):
    """A DataLoader over ``dataset`` for one data-parallel rank, starting at consumed_samples.

    Args:
        dataset: items are dicts of int arrays (GPT-2: ``text``; T5: ``text_enc``...).
        consumed_samples: resume point (all ranks together).
        micro_batch_size: samples per step on this rank.
        data_parallel_rank / data_parallel_size: this rank and the number of replicas.
        num_workers: DataLoader worker processes.

    Returns:
        torch.utils.data.DataLoader yielding dicts of int64 tensors, or None without a dataset.
    """
    import torch

    if dataset is None:
        return None
    sampler = MegatronPretrainingSampler(len(dataset), consumed_samples, micro_batch_size,
                                         data_parallel_rank, data_parallel_size)
    # A private generator: starting an iterator draws a worker seed from it, and drawing
    # from the global generator would shift the dropout stream (resume would not be exact).
    # Pinned batches on a GPU: broadcast_data copies them to the device without blocking.
    from ..mpu.utils import get_device

    return torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                                       collate_fn=_collate,
                                       pin_memory=get_device().type == "cuda",
                                       persistent_workers=num_workers > 0,
                                       generator=torch.Generator().manual_seed(0))

"""A dataset drawing from several datasets in fixed proportions (``--data-path 0.3 A 0.7 B``)."""
import logging

import numpy as np

from megatron.data import helpers
from megatron.common.errors import DataError

logger = logging.getLogger(__name__)


class BlendableDataset:
    """``size`` samples interleaved from ``datasets`` by ``weights``.

    Every prefix of the order follows the weights to within one sample per dataset
    (stride scheduling, megatron/data/helpers.py), so proportions hold over any window.

    Args:
        datasets: list of datasets (``len`` and ``__getitem__``).
        weights: positive floats, normalised here.
        size: number of samples.
    """

    def __init__(self, datasets, weights, size):
        weights = np.asarray(weights, dtype=np.float64)
        self.datasets, self.size = list(datasets), int(size)
        self.weights = weights / weights.sum()
        self.dataset_index, self.dataset_sample_index = helpers.build_blending_indices(
            self.weights, self.size)
        counts = np.bincount(self.dataset_index, minlength=len(self.datasets))
        for d, (dataset, need) in enumerate(zip(self.datasets, counts)):
            if need > len(dataset):
                raise DataError(f"blended dataset {d} has {len(dataset)} samples, the blend "
                                f"needs {need}; build it with more samples")
        logger.info("blended %d datasets, %d samples, weights %s", len(self.datasets),
                    self.size, np.round(self.weights, 4).tolist())

    def __len__(self):
        return self.size

    def __getitem__(self, idx):
        d = int(self.dataset_index[idx])
        return self.datasets[d][int(self.dataset_sample_index[idx])]

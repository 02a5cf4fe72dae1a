"""Datasets -> data loaders -> iterators, resuming at the consumed sample counts.

Every rank builds the datasets (cheap: memory maps; index caches are built once by rank 0),
but only the ranks that feed the model read them: tensor-parallel rank 0 of the first and
last pipeline stages. The others get None and receive their batch through
``mpu.broadcast_data``. Readers read ``--prefetch-batches`` batches ahead on a background
thread (megatron/data/prefetch.py).
"""
from typing import Any, Callable, Iterable, List, Optional, Tuple

from .. import mpu
from ..config.run_config import RunConfig
from ..data.data_samplers import build_pretraining_data_loader
from ..data.prefetch import Prefetcher
from ..common.errors import DataError
from ..common.utils import print_rank_0


def reads_data() -> bool:
    """Whether this rank pulls batches from the data iterator."""
    state = mpu.get_parallel_state()
    on_edge = state.pp_size == 1 or state.pp_rank in (0, state.pp_size - 1)
    return state.tp_rank == 0 and on_edge


def train_valid_test_num_samples(cfg: RunConfig) -> List[int]:
    """Samples each split must provide for the whole run (Megatron's sizing)."""
    gbs, iters, log = cfg.batch.global_batch_size, cfg.batch.train_iters, cfg.logging
    evaluations = iters // log.eval_interval + 1
    return [iters * gbs, evaluations * log.eval_iters * gbs, log.eval_iters * gbs]


def _iterator(loader, depth):
    return Prefetcher(loader, depth) if depth > 0 else iter(loader)


def build_train_valid_test_data_iterators(provider: Callable, cfg: RunConfig, state: Any
                                          ) -> Tuple[Optional[Any], ...]:
    """Call ``provider`` and wrap each split; sets ``state.do_train/do_valid/do_test``.

    Returns:
        ``(train, valid, test)`` iterators, None on ranks that do not read or for empty splits.
    """
    num_samples = train_valid_test_num_samples(cfg)
    print_rank_0(f"> datasets: train {num_samples[0]}, validation {num_samples[1]}, "
                 f"test {num_samples[2]} samples")
    datasets = provider(num_samples)
    consumed = (state.consumed_train_samples, state.consumed_valid_samples, 0)
    dp_rank, dp_size = mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()
    iterators = []
    for name, dataset, done in zip(("train", "valid", "test"), datasets, consumed):
        present = dataset is not None and len(dataset) > 0
        setattr(state, f"do_{name}", present)
        if not present or not reads_data():
            iterators.append(None)
            continue
        loader = build_pretraining_data_loader(dataset, done, cfg.batch.micro_batch_size,
                                               dp_rank, dp_size, cfg.data.num_workers)
        iterators.append(_iterator(loader, cfg.data.prefetch_batches))
    if not state.do_train and state.iteration < cfg.batch.train_iters:
        # Every rank built the same (deterministic) splits, so every rank stops here.
        raise DataError(f"--split {cfg.data.split!r} leaves the training split of --data-path "
                        f"without documents; give the training split a larger share or use "
                        f"more data")
    return tuple(iterators)


def close_iterators(iterators: Iterable[Optional[Any]]) -> None:
    """Stop the prefetching threads of ``iterators`` (None entries allowed)."""
    for iterator in iterators:
        if isinstance(iterator, Prefetcher):
            iterator.close()

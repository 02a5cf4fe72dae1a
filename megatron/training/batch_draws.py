"""One batch on every stage: a batch function's random draws seeded by the batch's place in
the run.

A pipeline calls a family's batch function on its first stage (for the inputs) and on its
last (for the labels). A batch function that draws from torch's generators, as every
masked-LM collator does, would draw different masks on the two stages: the inputs masked at
one set of positions and the loss taken at another, a silent error. :class:`SeededBatchFn`
runs each call under torch's generators (the CPU's and the compute device's) seeded from

    (the run's --seed, the phase, the iteration, the evaluation batch, the micro-batch)

where the micro-batch is counted over the global batch: micro-batch ``m`` of data-parallel
rank ``r`` is number ``m x dp + r``, the same samples a serial run (dp 1) reads as micro-batch
``m x dp + r`` (Megatron's sampler: step ``t`` of the global order covers ``[t m dp, (t + 1)
m dp)`` and rank ``r`` takes the ``r``-th slice). So the draws are the same on every stage, at
every tp / pp / v / schedule, after a resume, and at another dp with the same micro-batch
size; another micro-batch size draws another stream. The generators are restored after the
call, so the model's own draws (dropout) go on as before.

The training loop says where the run is (:meth:`SeededBatchFn.at`); the backends say which
micro-batch of the step a call is for (:meth:`SeededBatchFn.micro_batch`: around the serial
forward step, and as tds's ``batch_context`` around the pipeline's calls).
"""
import contextlib
import hashlib
from typing import Any, Callable, Iterator, List, Optional, Tuple

import torch

from ..config.run_config import RunConfig


def draw_seed(*key: Any) -> int:
    """A 63-bit seed from ``key`` (ints and strings), the same in every process."""
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def generators_of(device: torch.device) -> List[torch.Generator]:
    """torch's default generators a call on ``device`` draws from: the CPU's, and the
    device's own (made, if they are not yet, by asking for its state once)."""
    if device.type == "cpu":
        return [torch.default_generator]
    module = torch.get_device_module(device.type)
    index = device.index if device.index is not None else module.current_device()
    module.get_rng_state(index)  # initialises the device's generators (made lazily)
    return [torch.default_generator, module.default_generators[index]]


@contextlib.contextmanager
def seeded_generators(seed: int, generators: List[torch.Generator]) -> Iterator[None]:
    """``generators`` seeded with ``seed`` inside, their states restored after.

    The states live on the host (a device generator's is its seed and offset), so this
    reads nothing back from the device.
    """
    states = [g.get_state() for g in generators]
    try:
        for generator in generators:
            generator.manual_seed(seed)
        yield
    finally:
        for generator, state in zip(generators, states):
            generator.set_state(state)


class SeededBatchFn:
    """``batch_fn`` whose every call draws from generators seeded by the batch's place.

    Args:
        batch_fn: the family's ``raw -> (inputs, labels)``.
        seed: the run's ``--seed``.
        dp_rank, dp_size: this rank's data-parallel rank and the data-parallel size.
        device: the compute device (its generator is seeded too).
    """

    def __init__(self, batch_fn: Callable, seed: int, dp_rank: int = 0, dp_size: int = 1,
                 device: Optional[torch.device] = None) -> None:
        self.batch_fn, self.seed = batch_fn, seed
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.device = device if device is not None else torch.device("cpu")
        self._generators: Optional[List[torch.Generator]] = None
        self._place: Tuple[Any, ...] = ("train", 0, 0)
        self._micro: Optional[int] = None
        self._calls = 0

    def at(self, phase: str, iteration: int, batch: int = 0) -> None:
        """The next calls are for ``phase`` ("train", "valid", "test") at ``iteration``
        (the steps done before it), evaluation batch ``batch``."""
        self._place = (phase, int(iteration), int(batch))
        self._calls = 0

    @contextlib.contextmanager
    def micro_batch(self, index: int) -> Iterator[None]:
        """Calls inside are for micro-batch ``index`` (0 .. gas - 1) of this rank's step."""
        previous, self._micro = self._micro, int(index)
        try:
            yield
        finally:
            self._micro = previous

    def seed_of(self, micro: int) -> int:
        """The seed of this rank's micro-batch ``micro`` at the current place."""
        return draw_seed(self.seed, *self._place, micro * self.dp_size + self.dp_rank)

    def __call__(self, raw: Any) -> Any:
        micro = self._micro
        if micro is None:  # a caller that does not say: calls in order since at()
            micro, self._calls = self._calls, self._calls + 1
        if self._generators is None:
            self._generators = generators_of(self.device)
        with seeded_generators(self.seed_of(micro), self._generators):
            return self.batch_fn(raw)


def seeded(batch_fn: Optional[Callable], cfg: RunConfig) -> Optional[SeededBatchFn]:
    """``batch_fn`` seeded for this rank of the run ``cfg`` (None stays None; one already
    seeded is returned as is)."""
    if batch_fn is None or isinstance(batch_fn, SeededBatchFn):
        return batch_fn
    from .. import mpu

    return SeededBatchFn(batch_fn, cfg.model.seed, mpu.get_data_parallel_rank(),
                         mpu.get_data_parallel_world_size(), mpu.get_device())


def micro_batch(batch_fn: Any, index: int) -> Any:
    """``batch_fn.micro_batch(index)`` for a :class:`SeededBatchFn`, else a null context."""
    if isinstance(batch_fn, SeededBatchFn):
        return batch_fn.micro_batch(index)
    return contextlib.nullcontext()

"""v1's ``mpu.random``: the model-parallel random stream and activation checkpointing.

The tracker and seeding are :mod:`megatron.mpu.random`'s (the model-parallel stream is seeded
``seed + 2718 + tensor-parallel rank``, as in v1). v1's helpers keep their names:
``_set_cuda_rng_state(state)`` sets the compute device's generator (the CUDA one on a GPU,
the CPU one otherwise, like everything in this tracker), and ``CudaRNGStatesTracker`` is the
tracker's class.
"""
from ..random import (  # noqa: F401
    MODEL_PARALLEL_SEED_OFFSET,
    RNGStatesTracker as CudaRNGStatesTracker,
    _MODEL_PARALLEL_RNG_TRACKER_NAME,
    _get_device_rng_state,
    _set_device_rng_state,
    checkpoint,
    get_cuda_rng_tracker,
    model_parallel_cuda_manual_seed,
)


def _set_cuda_rng_state(new_state, device=-1):
    """Set the compute device's generator state (v1's name; ``device`` is ignored: the
    current device's generator is set)."""
    _set_device_rng_state(new_state)

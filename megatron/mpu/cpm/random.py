"""CPM-1-Pretrain's ``mpu.random``: the model-parallel RNG stream, activation checkpointing,
and v1.1.5's checkpointed-activations buffer calls (no-ops: :func:`checkpoint` keeps each
saved slice in a tensor of its own, see docs/mpu.md), plus the 1-D split helpers."""
from ..random import (  # noqa: F401
    init_checkpointed_activations_memory_buffer,
    reset_checkpointed_activations_memory_buffer,
)
from ..split_1d import gather_split_1d_tensor, split_tensor_into_1d_equal_chunks  # noqa: F401
from ..v1.random import (  # noqa: F401
    MODEL_PARALLEL_SEED_OFFSET,
    CudaRNGStatesTracker,
    _MODEL_PARALLEL_RNG_TRACKER_NAME,
    _set_cuda_rng_state,
    checkpoint,
    get_cuda_rng_tracker,
    model_parallel_cuda_manual_seed,
)

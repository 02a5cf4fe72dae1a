"""CPM-1-Pretrain's ``mpu`` API (Megatron-LM v1.1.5 with DeepSpeed's 3D-parallel additions).

``from megatron.mpu import cpm as mpu`` (see docs/mpu.md for a CPM-1 checkout, whose own
package is also called ``megatron``). The 36 public names of CPM-1's ``mpu/__init__.py``,
with its meanings:

- :mod:`.initialize`: "model parallel" is *tensor* parallel (DeepSpeed's ``'model'``
  axis); ``initialize_model_parallel(mp, topology=...)``, ``get_topology()``,
  ``get_pipe_parallel_{group,rank,world_size}``, ``get_io_parallel_group()``,
  ``set_model_parallel_{rank,world_size}``, ``is_unitialized()``;
- :mod:`.layers`: ``LayerNorm``; ``ColumnParallelLinear`` / ``RowParallelLinear`` with
  ``skip_bias_add`` returning ``(output, bias)``; ``VocabParallelEmbedding``;
- :mod:`.mappings`: the ``*_model_parallel_region`` functions (tensor-parallel group);
- :mod:`.random`: ``checkpoint(fn, *args)``, the RNG tracker, and the checkpointed
  activations buffer calls; :mod:`.data`, :mod:`.grads`, :mod:`.cross_entropy`,
  :mod:`.utils`.

It shares its state with ``megatron.mpu`` (v2.6 names) and ``megatron.mpu.v1`` (v1.0:
same group meanings, tensor-returning linears, no topology). ``clip_grad_norm`` sums over
the tensor x pipeline replica, so it is the model's norm at any pipeline size (CPM-1's
summed over the tensor group only: the same at one stage).
"""
from ..v1 import cross_entropy, data, grads, mappings, utils  # noqa: F401
from . import initialize, layers, random  # noqa: F401
from .initialize import (  # noqa: F401
    destroy_model_parallel,
    get_data_parallel_group,
    get_data_parallel_rank,
    get_data_parallel_world_size,
    get_io_parallel_group,
    get_model_parallel_group,
    get_model_parallel_rank,
    get_model_parallel_src_rank,
    get_model_parallel_world_size,
    get_pipe_parallel_group,
    get_pipe_parallel_rank,
    get_pipe_parallel_world_size,
    get_topology,
    initialize_model_parallel,
    is_unitialized,
    model_parallel_is_initialized,
    set_model_parallel_rank,
    set_model_parallel_world_size,
)
from .layers import ColumnParallelLinear, LayerNorm, RowParallelLinear, VocabParallelEmbedding  # noqa: F401,E501
from .random import (  # noqa: F401
    checkpoint,
    get_cuda_rng_tracker,
    init_checkpointed_activations_memory_buffer,
    model_parallel_cuda_manual_seed,
    reset_checkpointed_activations_memory_buffer,
)
from ..v1.cross_entropy import vocab_parallel_cross_entropy  # noqa: F401
from ..v1.data import broadcast_data  # noqa: F401
from ..v1.grads import clip_grad_norm  # noqa: F401
from ..v1.mappings import (  # noqa: F401
    copy_to_model_parallel_region,
    gather_from_model_parallel_region,
    reduce_from_model_parallel_region,
    scatter_to_model_parallel_region,
)
from ..v1.utils import divide, split_tensor_along_last_dim  # noqa: F401

"""Megatron-LM v1.0's ``mpu`` API: ``from megatron.mpu import v1 as mpu``.

CPM-1-Pretrain (Megatron v1.1.5 with DeepSpeed's topology; linears returning ``(output,
bias)``) has its own namespace, :mod:`megatron.mpu.cpm`.

A package with v1's submodules, so v1 code ports by its import alone, whether it uses the
top-level names (``mpu.ColumnParallelLinear``), a submodule (``from megatron.mpu.v1 import
layers``, ``mpu.random.get_cuda_rng_tracker()``, ``mpu.data._check_data_types``) or a name
from one (``from megatron.mpu.v1.cross_entropy import vocab_parallel_cross_entropy``):

- :mod:`.initialize`: groups and ranks; "model parallel" means *tensor* parallel, as in v1
  (in ``megatron.mpu`` it is the tensor x pipeline replica, as in v2.6);
- :mod:`.layers`: the linear layers return a tensor, as in v1; ``ParallelEmbedding``
  (embedding split along the hidden dimension) and ``_initialize_affine_weight``;
- :mod:`.mappings`: the ``*_model_parallel_region`` functions;
- :mod:`.data`, :mod:`.random`, :mod:`.cross_entropy`, :mod:`.grads`, :mod:`.utils`.

Numerics and initialisation are the v2 layers' (layout-invariant for a given seed). See
docs/mpu.md.
"""
from . import cross_entropy, data, grads, initialize, layers, mappings, random, utils  # noqa: F401
from .cross_entropy import vocab_parallel_cross_entropy  # noqa: F401
from .data import broadcast_data  # noqa: F401
from .grads import clip_grad_norm  # noqa: F401
from .initialize import (  # noqa: F401
    destroy_model_parallel,
    get_data_parallel_group,
    get_data_parallel_rank,
    get_data_parallel_world_size,
    get_model_parallel_group,
    get_model_parallel_rank,
    get_model_parallel_src_rank,
    get_model_parallel_world_size,
    initialize_model_parallel,
    model_parallel_is_initialized,
)
from .layers import (  # noqa: F401
    ColumnParallelLinear,
    ParallelEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from .mappings import (  # noqa: F401
    copy_to_model_parallel_region,
    gather_from_model_parallel_region,
    reduce_from_model_parallel_region,
    scatter_to_model_parallel_region,
)
from .random import checkpoint, get_cuda_rng_tracker, model_parallel_cuda_manual_seed  # noqa: F401
from .utils import divide, split_tensor_along_last_dim  # noqa: F401

"""Tensor-model parallelism with Megatron-LM's API (v2 names and the v1/CPM aliases).

See DESIGN.md, "The mpu contract". Everything runs on CPU with gloo and on CUDA with NCCL.
"""
from .cross_entropy import vocab_parallel_cross_entropy
from .data import broadcast_data
from .grads import clip_grad_norm, param_is_shared
from .layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    param_is_not_tensor_parallel_duplicate,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
)
from .mappings import (
    copy_to_model_parallel_region,
    copy_to_tensor_model_parallel_region,
    gather_from_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    scatter_to_model_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from .parallel_state import (
    ParallelState,
    destroy_model_parallel,
    get_data_parallel_group,
    get_data_parallel_rank,
    get_data_parallel_src_rank,
    get_data_parallel_world_size,
    get_embedding_group,
    get_model_parallel_group,
    get_model_parallel_rank,
    get_model_parallel_src_rank,
    get_model_parallel_world_size,
    get_parallel_state,
    get_pipe_parallel_group,
    get_pipe_parallel_rank,
    get_pipe_parallel_world_size,
    get_pipeline_model_parallel_first_rank,
    get_pipeline_model_parallel_group,
    get_pipeline_model_parallel_last_rank,
    get_pipeline_model_parallel_next_rank,
    get_pipeline_model_parallel_prev_rank,
    get_pipeline_model_parallel_rank,
    get_pipeline_model_parallel_world_size,
    get_tensor_model_parallel_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_src_rank,
    get_tensor_model_parallel_world_size,
    grid_rank,
    initialize_model_parallel,
    is_pipeline_first_stage,
    is_pipeline_last_stage,
    model_parallel_is_initialized,
)
from .random import (
    RNGStatesTracker,
    checkpoint,
    get_cuda_rng_tracker,
    get_rng_tracker,
    model_parallel_cuda_manual_seed,
    model_parallel_manual_seed,
)
from .utils import VocabUtility, divide, ensure_divisibility, get_device, split_tensor_along_last_dim

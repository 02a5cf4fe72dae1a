"""Tensor-model parallelism with Megatron-LM v2.6's public API (and a little of core's).

See docs/mpu.md (the contract and every name). "Model parallel" here always means the
tensor x pipeline replica (v2.6's get_model_parallel_group). Megatron v1.0 code, where it
meant tensor-parallel, imports ``from megatron.mpu import v1 as mpu``; CPM-1-Pretrain code
``from megatron.mpu import cpm as mpu``.
Everything runs on CPU with gloo and on CUDA with NCCL.
"""
from .context_parallel import (
    dense_attention_mask,
    document_starts,
    gather_from_context_parallel,
    is_token_layout,
    layout_doc_starts,
    layout_positions,
    load_balanced_indices,
    reduce_loss_over_context_parallel,
    split_for_context_parallel,
    token_layout,
)
from .cp_attention import CP_COMM_TYPES, context_parallel_attention
from .cross_entropy import vocab_parallel_cross_entropy
from .data import broadcast_data
from .fp8 import FORMATS as FP8_FORMATS, RECIPES as FP8_RECIPES, Fp8Recipe
from .grads import (clip_coefficient, clip_grad_norm, clip_grad_norm_tensor,
                    counts_toward_norm, grad_norms, norm_of_grads, param_is_shared)
from .layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_tensor_model_parallel_attributes,
    param_is_not_tensor_parallel_duplicate,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
)
from .mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from .parallel_state import (
    ParallelOverrides,
    ParallelState,
    destroy_model_parallel,
    get_context_parallel_global_ranks,
    get_context_parallel_group,
    get_context_parallel_rank,
    get_context_parallel_world_size,
    get_data_parallel_group,
    get_data_parallel_rank,
    get_data_parallel_src_rank,
    get_data_parallel_world_size,
    get_embedding_group,
    get_expert_data_parallel_group,
    get_expert_data_parallel_rank,
    get_expert_data_parallel_world_size,
    get_expert_model_parallel_group,
    get_expert_model_parallel_rank,
    get_expert_model_parallel_world_size,
    get_model_parallel_group,
    get_model_parallel_rank,
    get_model_parallel_src_rank,
    get_model_parallel_world_size,
    get_parallel_overrides,
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
    get_pipeline_model_parallel_split_rank,
    get_pipeline_model_parallel_world_size,
    get_tensor_model_parallel_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_src_rank,
    get_tensor_model_parallel_world_size,
    get_virtual_pipeline_model_parallel_rank,
    get_virtual_pipeline_model_parallel_world_size,
    grid_coordinates,
    grid_rank,
    initialize_model_parallel,
    is_pipeline_first_stage,
    is_pipeline_last_stage,
    is_unitialized,
    model_parallel_is_initialized,
    set_pipeline_model_parallel_rank,
    set_pipeline_model_parallel_world_size,
    set_tensor_model_parallel_rank,
    set_tensor_model_parallel_world_size,
    set_virtual_pipeline_model_parallel_rank,
)
from .norms import MixedFusedLayerNorm, MixedFusedRMSNorm, RMSNorm
from .random import (
    RNGStatesTracker,
    checkpoint,
    get_cuda_rng_tracker,
    get_rng_tracker,
    in_model_parallel_stream,
    init_checkpointed_activations_memory_buffer,
    model_parallel_cuda_manual_seed,
    model_parallel_dropout,
    model_parallel_manual_seed,
    reset_checkpointed_activations_memory_buffer,
)
from .rotary import RotaryEmbedding, apply_rotary
from .split_1d import gather_split_1d_tensor, split_tensor_into_1d_equal_chunks
from .vocab_padding import mark_padded_vocab_rows, mask_padded_vocab_logits_
from .sequence_parallel_linear import linear_with_sequence_parallel_gather
from .sequence_parallel import (
    allreduce_sequence_parallel_grads,
    defer_sequence_parallel_grads,
    gather_from_sequence_parallel_region,
    mark_sequence_parallel,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    sequence_parallel_dropout,
    sequence_parallel_param,
)
from .utils import VocabUtility, divide, ensure_divisibility, get_device, split_tensor_along_last_dim
from .weight_grad import (
    LinearWithDeferredWeightGrad,
    WeightGradStore,
    WeightGradStoreError,
    COMPILE_OPTIONS as WEIGHT_GRAD_COMPILE_OPTIONS,
    accumulate_grad,
    deferrable_linear,
    set_weight_grad_deferral,
    weight_grad_store_of,
)
from . import moe  # noqa: E402 (mixture of experts: megatron.mpu.moe)

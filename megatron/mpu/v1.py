"""Megatron-LM v1 / CPM-Pretrain's ``mpu`` API: ``from megatron.mpu import v1 as mpu``.

In v1 there is no pipeline parallelism and "model parallel" means *tensor* parallel: here
``get_model_parallel_{group,rank,world_size,src_rank}`` and the ``*_model_parallel_region``
mappings are the tensor-parallel ones (in ``megatron.mpu`` "model parallel" is the tensor x
pipeline replica, as in v2.6). The linear layers return a tensor, as in v1, and
``ParallelEmbedding`` (embedding split along the hidden dimension) is back. Numerics and
initialisation are the v2 layers' (layout-invariant for a given seed). See docs/mpu.md.
"""
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn import init

from . import layers as _layers
from . import parallel_state as _ps
from .cross_entropy import vocab_parallel_cross_entropy  # noqa: F401
from .data import broadcast_data  # noqa: F401
from .grads import clip_grad_norm  # noqa: F401
from .layers import VocabParallelEmbedding  # noqa: F401
from .mappings import (  # noqa: F401
    copy_to_tensor_model_parallel_region as copy_to_model_parallel_region,
    gather_from_tensor_model_parallel_region as gather_from_model_parallel_region,
    reduce_from_tensor_model_parallel_region as reduce_from_model_parallel_region,
    scatter_to_tensor_model_parallel_region as scatter_to_model_parallel_region,
)
from .parallel_state import (  # noqa: F401
    destroy_model_parallel,
    get_data_parallel_group,
    get_data_parallel_rank,
    get_data_parallel_world_size,
    get_tensor_model_parallel_group as get_model_parallel_group,
    get_tensor_model_parallel_rank as get_model_parallel_rank,
    get_tensor_model_parallel_src_rank as get_model_parallel_src_rank,
    get_tensor_model_parallel_world_size as get_model_parallel_world_size,
    model_parallel_is_initialized,
)
from .random import checkpoint, get_cuda_rng_tracker, model_parallel_cuda_manual_seed  # noqa: F401
from .utils import divide, split_tensor_along_last_dim  # noqa: F401


def initialize_model_parallel(model_parallel_size_=1):
    """v1's form: ``model_parallel_size_`` tensor-parallel ranks, no pipeline.

    Args:
        model_parallel_size_: tensor-parallel size; it must divide the world size.
    """
    return _ps.initialize_model_parallel(model_parallel_size_, 1)


class _OutputOnly:
    """v1's linear layers return ``Y``, where v2's return ``(Y, bias)`` (bias None or added)."""

    def forward(self, input_):
        return super().forward(input_)[0]


class ColumnParallelLinear(_OutputOnly, _layers.ColumnParallelLinear):
    """v1's ColumnParallelLinear: same layer as ``megatron.mpu``'s, forward returns Y only.

    Args:
        input_size, output_size, bias, gather_output, init_method, stride,
            keep_master_weight_for_test: as in Megatron v1 (see megatron.mpu.layers).
    """

    def __init__(self, input_size, output_size, bias=True, gather_output=True,
                 init_method=init.xavier_normal_, stride=1, keep_master_weight_for_test=False):
        super().__init__(input_size, output_size, bias=bias, gather_output=gather_output,
                         init_method=init_method, stride=stride,
                         keep_master_weight_for_test=keep_master_weight_for_test)


class RowParallelLinear(_OutputOnly, _layers.RowParallelLinear):
    """v1's RowParallelLinear: same layer as ``megatron.mpu``'s, forward returns Y only.

    Args:
        input_size, output_size, bias, input_is_parallel, init_method, stride,
            keep_master_weight_for_test: as in Megatron v1 (see megatron.mpu.layers).
    """

    def __init__(self, input_size, output_size, bias=True, input_is_parallel=False,
                 init_method=init.xavier_normal_, stride=1, keep_master_weight_for_test=False):
        super().__init__(input_size, output_size, bias=bias, input_is_parallel=input_is_parallel,
                         init_method=init_method, stride=stride,
                         keep_master_weight_for_test=keep_master_weight_for_test)


class ParallelEmbedding(nn.Module):
    """v1's embedding split along the *hidden* dimension, gathered after the lookup.

    Each rank holds ``[num_embeddings, embedding_dim / tp]`` (columns ``tp_rank`` of the
    full weight), looks every id up, and the slices are all-gathered along the last dim.

    Args:
        num_embeddings: vocabulary size.
        embedding_dim: hidden size (must divide by the tensor-parallel size).
        init_method: in-place initialiser applied to the full weight.
        keep_master_weight_for_test: keep the full weight as ``self.master_weight``.
    """

    def __init__(self, num_embeddings, embedding_dim, init_method=init.xavier_normal_,
                 keep_master_weight_for_test=False):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.group, tp_rank, tp_size = _layers._tp_info(None)
        self.embedding_dim_per_partition = divide(embedding_dim, tp_size, "embedding size",
                                                  "tensor-model-parallel size")
        self.weight = nn.Parameter(torch.empty(num_embeddings, self.embedding_dim_per_partition,
                                               **_layers._factory(None, None)))
        _layers.set_tensor_model_parallel_attributes(self.weight, True, 1, 1)
        self.master_weight = _layers._init_partitioned(
            self.weight, (num_embeddings, embedding_dim), 1, init_method, tp_rank, tp_size,
            return_master=keep_master_weight_for_test)

    def forward(self, input_):  # [*] ids -> [*, h]
        output_parallel = F.embedding(input_, self.weight)  # [*, h/tp]
        return gather_from_model_parallel_region(output_parallel, self.group)


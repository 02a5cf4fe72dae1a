"""v1's ``mpu.layers``: the tensor-parallel layers as Megatron v1 defined them.

The linear layers are :mod:`megatron.mpu.layers`' with v1's forward, which returns ``Y``
where v2's returns ``(Y, bias)``; ``ParallelEmbedding`` (the embedding split along the
*hidden* dimension, gathered after the lookup) is v1's; ``VocabParallelEmbedding`` is the
same in both. ``_initialize_affine_weight(weight, output_size, input_size,
per_partition_size, partition_dim, init_method, stride=1, return_master_weight=False)``
keeps v1's signature: it draws the full weight and copies this rank's part. Numerics and
initialisation are the v2 layers' (the same for a given seed at any tensor-parallel size).
"""
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn import init

from .. import layers as _layers
from ..layers import VocabParallelEmbedding  # noqa: F401
from ..mappings import gather_from_tensor_model_parallel_region
from ..utils import divide


def _initialize_affine_weight(weight, output_size, input_size, per_partition_size,
                              partition_dim, init_method, stride=1,
                              return_master_weight=False):
    """Fill ``weight`` (this rank's part) from a full ``[output_size, input_size]`` weight
    drawn with ``init_method``; split along ``partition_dim`` into ``per_partition_size``
    rows or columns per rank (``stride`` interleaved chunks each).

    Returns:
        The full weight when ``return_master_weight``, else None.
    """
    _, tp_rank, tp_size = _layers._tp_info(None)
    full = (output_size, input_size)
    divide(full[partition_dim], per_partition_size, "partitioned dimension",
           "per-partition size")
    return _layers._init_partitioned(weight, full, partition_dim, init_method, tp_rank,
                                     tp_size, stride=stride,
                                     return_master=return_master_weight)


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
        return gather_from_tensor_model_parallel_region(output_parallel, self.group)

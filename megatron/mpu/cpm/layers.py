"""CPM-1-Pretrain's ``mpu.layers`` (Megatron v1.1.5): ``LayerNorm`` and the parallel layers.

The linear layers take v1.1.5's arguments (``skip_bias_add`` included) and return
``(output, bias)``: ``bias`` is the bias parameter when ``skip_bias_add`` (for the caller
to fuse), else None. They are :mod:`megatron.mpu.layers`' layers (layout-invariant
initialisation: the full weight is drawn on the CPU and sliced, which is CPM-1's
``--use-cpu-initialization``), without the keyword-only extras of that module. ``LayerNorm``
is ``torch.nn.LayerNorm``, what CPM-1 uses without apex.
"""
from torch.nn import LayerNorm  # noqa: F401  (CPM-1: apex's FusedLayerNorm or this)
from torch.nn import init

from .. import layers as _layers
from ..layers import VocabParallelEmbedding  # noqa: F401
from ..random import get_cuda_rng_tracker
from ..v1.layers import _initialize_affine_weight as _initialize_affine_weight_cpu  # noqa: F401


def _initialize_affine_weight_gpu(weight, init_method, partition_dim, stride=1):
    """CPM-1's device-side initialisation: mark ``weight`` as split along
    ``partition_dim`` and fill it with ``init_method`` in the model-parallel RNG stream
    (each rank draws its own slice, so the result depends on the tensor-parallel size)."""
    _layers.set_tensor_model_parallel_attributes(weight, True, partition_dim, stride)
    with get_cuda_rng_tracker().fork():
        init_method(weight)


class ColumnParallelLinear(_layers.ColumnParallelLinear):
    """``Y = XA + b`` with A split by columns; forward returns ``(Y, bias or None)``.

    Args:
        input_size, output_size, bias, gather_output, init_method, stride,
            keep_master_weight_for_test, skip_bias_add: as in CPM-1 / Megatron v1.1.5
            (see :class:`megatron.mpu.layers.ColumnParallelLinear`).
    """

    def __init__(self, input_size, output_size, bias=True, gather_output=True,
                 init_method=init.xavier_normal_, stride=1, keep_master_weight_for_test=False,
                 skip_bias_add=False):
        super().__init__(input_size, output_size, bias=bias, gather_output=gather_output,
                         init_method=init_method, stride=stride,
                         keep_master_weight_for_test=keep_master_weight_for_test,
                         skip_bias_add=skip_bias_add)


class RowParallelLinear(_layers.RowParallelLinear):
    """``Y = XA + b`` with A split by rows; forward returns ``(Y, bias or None)``.

    Args:
        input_size, output_size, bias, input_is_parallel, init_method, stride,
            keep_master_weight_for_test, skip_bias_add: as in CPM-1 / Megatron v1.1.5
            (see :class:`megatron.mpu.layers.RowParallelLinear`).
    """

    def __init__(self, input_size, output_size, bias=True, input_is_parallel=False,
                 init_method=init.xavier_normal_, stride=1, keep_master_weight_for_test=False,
                 skip_bias_add=False):
        super().__init__(input_size, output_size, bias=bias, input_is_parallel=input_is_parallel,
                         init_method=init_method, stride=stride,
                         keep_master_weight_for_test=keep_master_weight_for_test,
                         skip_bias_add=skip_bias_add)


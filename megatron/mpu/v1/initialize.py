"""v1's ``mpu.initialize``: one kind of model parallelism, the tensor-parallel one.

In Megatron v1 there were no pipeline stages, so ``get_model_parallel_group`` / ``_rank`` /
``_world_size`` / ``_src_rank`` named the tensor-parallel group; here they are the
tensor-parallel getters of :mod:`megatron.mpu.parallel_state` under those names. (In
``megatron.mpu``, as in v2.6, "model parallel" is the tensor x pipeline replica.)
"""
from .. import parallel_state as _ps
from ..parallel_state import (  # noqa: F401
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


def initialize_model_parallel(model_parallel_size_=1):
    """v1's form: ``model_parallel_size_`` tensor-parallel ranks, no pipeline.

    Args:
        model_parallel_size_: tensor-parallel size; it must divide the world size.
    """
    return _ps.initialize_model_parallel(model_parallel_size_, 1)

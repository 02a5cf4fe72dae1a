"""v1's ``mpu.mappings``: the four region functions under v1's names (tensor-parallel
group; the v2 names are in :mod:`megatron.mpu.mappings`)."""
from ..mappings import (  # noqa: F401
    copy_to_tensor_model_parallel_region as copy_to_model_parallel_region,
    gather_from_tensor_model_parallel_region as gather_from_model_parallel_region,
    reduce_from_tensor_model_parallel_region as reduce_from_model_parallel_region,
    scatter_to_tensor_model_parallel_region as scatter_to_model_parallel_region,
)

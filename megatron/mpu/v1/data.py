"""v1's ``mpu.data``: broadcast a batch from tensor-parallel rank 0 to its group.

``broadcast_data(keys, data, datatype)`` is :func:`megatron.mpu.data.broadcast_data`. v1's two
helpers keep their meanings: ``_check_data_types`` asserts every tensor's dtype, and
``_build_key_size_numel_dictionaries`` (collective over the tensor-parallel group) returns
the shapes and sizes the source rank holds.
"""
import torch
import torch.distributed as dist

from .. import parallel_state as _ps
from ..data import broadcast_data  # noqa: F401
from ..utils import get_device

_MAX_DATA_DIM = 5  # v1's limit on the number of dimensions of a broadcast tensor


def _check_data_types(keys, data, target_dtype):
    """Raise unless ``data[key]`` has ``target_dtype`` for every key."""
    for key in keys:
        if data[key].dtype != target_dtype:
            raise AssertionError(f"{key} has data type {data[key].dtype} which is different "
                                 f"than {target_dtype}")


def _build_key_size_numel_dictionaries(keys, data):
    """``(key -> shape as a list, key -> numel, total numel)`` of the source rank's data.

    Collective: every rank of the tensor-parallel group calls it; only tensor-parallel
    rank 0 needs ``data``.
    """
    sizes = torch.zeros(len(keys), _MAX_DATA_DIM, dtype=torch.long)
    if _ps.get_tensor_model_parallel_rank() == 0:
        for i, key in enumerate(keys):
            if data[key].dim() >= _MAX_DATA_DIM:
                raise AssertionError(f"{key} has more than {_MAX_DATA_DIM - 1} dimensions")
            sizes[i, :data[key].dim()] = torch.tensor(data[key].shape, dtype=torch.long)
    group = _ps.get_tensor_model_parallel_group()
    if dist.get_world_size(group) > 1:
        sizes = sizes.to(get_device())
        dist.broadcast(sizes, _ps.get_tensor_model_parallel_src_rank(), group=group)
        sizes = sizes.cpu()
    key_size, key_numel, total = {}, {}, 0
    for i, key in enumerate(keys):
        shape = [int(s) for s in sizes[i] if s > 0]
        numel = 1
        for s in shape:
            numel *= s
        key_size[key], key_numel[key] = shape, numel
        total += numel
    return key_size, key_numel, total

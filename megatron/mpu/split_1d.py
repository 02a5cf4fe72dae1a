"""Megatron v2.6's 1-D split/gather of a tensor across the tensor-parallel ranks.

Used by activation checkpointing with ``distribute_saved_activations``: each rank keeps
``1/tp`` of a saved (replicated) activation, and the whole is all-gathered for the recompute.
"""
import torch
import torch.distributed as dist

from . import parallel_state as ps
from .utils import divide


def split_tensor_into_1d_equal_chunks(tensor, new_buffer=False):
    """This rank's contiguous ``numel / tp`` slice of ``tensor`` flattened.

    Args:
        tensor: a tensor whose element count divides by the tensor-parallel size.
        new_buffer: return a copy (so the full tensor can be freed) instead of a view.
    """
    size = divide(tensor.numel(), ps.get_tensor_model_parallel_world_size(),
                  "tensor element count", "tensor-model-parallel size")
    start = size * ps.get_tensor_model_parallel_rank()
    data = tensor.reshape(-1)[start:start + size]
    return data.clone() if new_buffer else data


def gather_split_1d_tensor(tensor, group=None):
    """Inverse of :func:`split_tensor_into_1d_equal_chunks`: all-gather the 1-D slices.

    Args:
        tensor: this rank's 1-D slice.
        group: tensor-parallel group (default: mpu's).

    Returns:
        A 1-D tensor of ``tp * tensor.numel()`` elements on ``tensor``'s device.
    """
    group = ps.get_tensor_model_parallel_group() if group is None else group
    world = dist.get_world_size(group)
    tensor = tensor.contiguous().view(-1)
    if world == 1:
        return tensor.clone()
    gathered = torch.empty(world * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    # all_gather into views of one buffer: no concatenation copy afterwards.
    dist.all_gather(list(gathered.chunk(world)), tensor, group=group)
    return gathered

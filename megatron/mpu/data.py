"""Share a batch read by tensor-parallel rank 0 with the other ranks of its group."""
import torch
import torch.distributed as dist

from . import parallel_state as ps
from .utils import get_device

_MAX_DIMS = 8
_BAD = -1  # size header sent instead of a shape when the source's data is wrong


def _header(keys, data, datatype):
    """``[len(keys), 1 + _MAX_DIMS]`` int64: ndim then shape, or _BAD rows and a message."""
    header = torch.zeros(len(keys), 1 + _MAX_DIMS, dtype=torch.long)
    for i, key in enumerate(keys):
        tensor = data.get(key) if isinstance(data, dict) else None
        if tensor is None:
            return header.fill_(_BAD), f"broadcast_data: key {key!r} is missing from the batch"
        if tensor.dtype != datatype:
            return header.fill_(_BAD), (f"broadcast_data: {key!r} has dtype {tensor.dtype}, "
                                        f"expected {datatype}")
        if tensor.dim() > _MAX_DIMS:
            return header.fill_(_BAD), (f"broadcast_data: {key!r} has {tensor.dim()} dims, "
                                        f"at most {_MAX_DIMS} are supported")
        header[i, 0] = tensor.dim()
        header[i, 1:1 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.long)
    return header, None


def broadcast_data(keys, data, datatype, group=None):
    """Broadcast ``data[key]`` for each key from tensor-parallel rank 0 to its group.

    Only the source rank needs ``data``; the others may pass None. Shapes travel first
    (one small broadcast), then all tensors flattened into one buffer.

    Args:
        keys: names of the tensors, in a fixed order.
        data: dict of tensors on the source rank.
        datatype: dtype every tensor must have.
        group: tensor-parallel group (default: mpu's).

    Returns:
        dict key -> tensor on the compute device, identical on every rank of the group.

    Raises:
        ValueError: on every rank, when the source's data lacks a key or has the wrong dtype.
    """
    if group is None:
        group, src = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_src_rank()
    else:
        src = dist.get_global_rank(group, 0)
    device = get_device()
    is_src = dist.get_rank() == src
    error = None
    if is_src:
        header, error = _header(keys, data, datatype)
    else:
        header = torch.empty(len(keys), 1 + _MAX_DIMS, dtype=torch.long)
    single = dist.get_world_size(group) == 1
    if not single:
        header = header.to(device)
        dist.broadcast(header, src, group=group)
        header = header.cpu()
    if error is not None or (len(keys) > 0 and bool((header == _BAD).all())):
        raise ValueError(error or "broadcast_data: the source rank's batch is invalid "
                                  "(see the tensor-parallel rank 0 error)")
    shapes = [tuple(row[1:1 + row[0]].tolist()) for row in header]
    numels = [int(torch.Size(s).numel()) for s in shapes]
    if is_src:
        # each tensor to the device first: from pinned host memory (the DataLoader's on a
        # GPU) the copies do not block, where a host-side cat would make pageable memory
        flat = torch.cat([data[k].reshape(-1).to(device, non_blocking=True) for k in keys])
    else:
        flat = torch.empty(sum(numels), dtype=datatype, device=device)
    if not single:
        dist.broadcast(flat, src, group=group)
    return {k: part.view(shape) for k, part, shape in zip(keys, flat.split(numels), shapes)}

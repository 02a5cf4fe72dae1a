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


def _check_known(keys, data, datatype, shapes):
    """The source's batch against the shapes its caller knows: None, or what is wrong."""
    for key, shape in zip(keys, shapes):
        tensor = data.get(key) if isinstance(data, dict) else None
        if tensor is None:
            return f"broadcast_data: key {key!r} is missing from the batch"
        if tensor.dtype != datatype:
            return f"broadcast_data: {key!r} has dtype {tensor.dtype}, expected {datatype}"
        if tuple(tensor.shape) != tuple(shape):
            return (f"broadcast_data: {key!r} has shape {tuple(tensor.shape)}, expected "
                    f"{tuple(shape)} (the sizes the run configuration gives)")
    return None


def _to_device(keys, data, device):
    # from pinned host memory (the DataLoader's on a GPU) the copies do not block
    return {k: data[k].to(device, non_blocking=True) for k in keys}


def broadcast_data(keys, data, datatype, group=None, shapes=None):
    """Broadcast ``data[key]`` for each key from tensor-parallel rank 0 to its group.

    Only the source rank needs ``data``; the others may pass None. All tensors travel
    flattened into one buffer. Their shapes are either known to every rank (``shapes``:
    no host-device synchronisation, what a training step uses) or sent first in a small
    header that each rank reads back on the host (one sync per call on a GPU).

    Args:
        keys: names of the tensors, in a fixed order.
        data: dict of tensors on the source rank.
        datatype: dtype every tensor must have.
        group: tensor-parallel group (default: mpu's).
        shapes: optional, one shape per key, the same on every rank (e.g. from the run
            configuration). The source checks its batch against them; with one rank in the
            group the batch is only moved to the device.

    Returns:
        dict key -> tensor on the compute device, identical on every rank of the group.

    Raises:
        ValueError: when the source's data lacks a key, has the wrong dtype or (with
            ``shapes``) another shape: on every rank without ``shapes``; with ``shapes`` on
            the source, after it has sent zeros so that the others do not hang in the
            broadcast (their next collective fails when the source stops).
    """
    if group is None:
        group, src = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_src_rank()
    else:
        src = dist.get_global_rank(group, 0)
    if shapes is not None:
        return _broadcast_known(keys, data, datatype, group, src, [tuple(s) for s in shapes])
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


def _broadcast_known(keys, data, datatype, group, src, shapes):
    """:func:`broadcast_data` with shapes every rank knows: no header, no host read."""
    device = get_device()
    is_src = dist.get_rank() == src
    if len(shapes) != len(keys):
        raise ValueError(f"broadcast_data: {len(shapes)} shapes for {len(keys)} keys")
    error = _check_known(keys, data, datatype, shapes) if is_src else None
    if dist.get_world_size(group) == 1:
        if error is not None:
            raise ValueError(error)
        return _to_device(keys, data, device)
    numels = [int(torch.Size(s).numel()) for s in shapes]
    if is_src and error is None:
        flat = torch.cat([data[k].reshape(-1).to(device, non_blocking=True) for k in keys])
    else:
        flat = torch.zeros(sum(numels), dtype=datatype, device=device)
    dist.broadcast(flat, src, group=group)
    if error is not None:
        raise ValueError(error)
    return {k: part.view(shape) for k, part, shape in zip(keys, flat.split(numels), shapes)}

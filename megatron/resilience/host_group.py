"""A gloo process group over every rank, for small decisions taken on the host.

A flag reduced over NCCL would need a device tensor and a host read of the result (a sync
of the training stream); over gloo the tensor lives in host memory, so agreeing on a stop
costs one small host-side all-reduce and never waits for the GPU's queued work.
"""
from typing import Optional

import torch.distributed as dist


def new_host_group() -> Optional[dist.ProcessGroup]:
    """Collective (every rank, same order): a new gloo group of all ranks.

    A separate group rather than the world group even under gloo, so that its collectives
    never interleave with the training's (a background thread may use its own one).

    Returns:
        The group, or None when torch.distributed is not initialised or has one rank.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return dist.new_group(backend="gloo")

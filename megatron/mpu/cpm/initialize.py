"""CPM-1-Pretrain's ``mpu.initialize``: Megatron v1.1.5 groups plus DeepSpeed's topology.

"Model parallel" means *tensor* parallel here, as in CPM-1 (DeepSpeed's ``'model'`` axis);
the pipeline has its own getters (``get_pipe_parallel_*``). ``initialize_model_parallel(mp,
topology=PipeModelDataParallelTopology(...))`` builds the groups of that topology. The
groups themselves are :mod:`megatron.mpu.parallel_state`'s (one state for every namespace);
what only CPM-1 has (the topology object and the IO group) is one frozen record here, tied
to that state and forgotten when it is destroyed.
"""
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch.distributed as dist

from .. import parallel_state as _ps
from ..parallel_state import (  # noqa: F401
    get_data_parallel_group,
    get_data_parallel_rank,
    get_data_parallel_world_size,
    get_pipeline_model_parallel_group as get_pipe_parallel_group,
    get_pipeline_model_parallel_rank as get_pipe_parallel_rank,
    get_pipeline_model_parallel_world_size as get_pipe_parallel_world_size,
    get_tensor_model_parallel_group as get_model_parallel_group,
    get_tensor_model_parallel_rank as get_model_parallel_rank,
    get_tensor_model_parallel_src_rank as get_model_parallel_src_rank,
    get_tensor_model_parallel_world_size as get_model_parallel_world_size,
    is_unitialized,
    model_parallel_is_initialized,
    set_tensor_model_parallel_rank as set_model_parallel_rank,
    set_tensor_model_parallel_world_size as set_model_parallel_world_size,
)


@dataclass(frozen=True)
class CpmExtras:
    """What CPM-1 keeps beside the groups: the topology it was given and the IO group."""

    state: Any
    """The :class:`~megatron.mpu.parallel_state.ParallelState` these belong to."""
    topology: Any
    io_ranks: Tuple[int, ...]
    io_group: Any


_EXTRAS: Optional[CpmExtras] = None


def _check_topology(topology, tp, pp, world):
    """Raise unless ``topology`` places every rank where mpu's rank order does."""
    names = list(topology.get_axis_names())
    dims = {name: topology.get_dim(name) for name in names}
    if dims.get("model", 1) != tp or dims.get("pipe", 1) != pp or \
            topology.world_size() != world:
        raise ValueError(f"initialize_model_parallel: model_parallel_size {tp} and world size "
                         f"{world} disagree with the topology {dims} (world size "
                         f"{topology.world_size()}); build it as PipeModelDataParallelTopology("
                         f"num_pp=pp, num_mp={tp}, num_dp=world // (pp * {tp}))")
    dp = world // (tp * pp)
    for rank in range(world):
        coord = topology.get_coord(rank)._asdict()
        pp_rank, rest = divmod(rank, tp * dp)
        dp_rank, tp_rank = divmod(rest, tp)
        want = {"pipe": pp_rank, "data": dp_rank, "model": tp_rank}
        if any(coord.get(axis, 0) != want[axis] for axis in want):
            raise ValueError(f"initialize_model_parallel: the topology puts rank {rank} at "
                             f"{coord}, mpu's order (tensor fastest, then data, then pipe) at "
                             f"{want}; use DeepSpeed's PipeModelDataParallelTopology (axes "
                             f"pipe, data, model)")


def initialize_model_parallel(model_parallel_size_, topology=None):
    """Build the tensor- (CPM-1's "model"-), data- and pipeline-parallel groups.

    Args:
        model_parallel_size_: tensor-parallel size (capped at the world size, as CPM-1 does).
        topology: DeepSpeed's ``PipeModelDataParallelTopology`` (or None: no pipeline); its
            pipe dimension is the pipeline size. With more than one stage the IO group
            (tensor-parallel rank 0 of the first and last stage, every data-parallel
            replica) is built too; otherwise the IO group is the data-parallel group.

    Raises:
        ValueError: the sizes do not divide, or the topology orders ranks differently.

    Where DeepSpeed is installed, its communication backend is readied over the process
    group, so a DeepSpeed ``PipelineModule`` can be built next (CPM-1's order).
    """
    global _EXTRAS
    if not dist.is_initialized():
        raise RuntimeError("initialize_model_parallel needs torch.distributed: call "
                           "torch.distributed.init_process_group() first")
    world = dist.get_world_size()
    tp = min(int(model_parallel_size_), world)
    pp = topology.get_dim("pipe") if topology is not None and \
        "pipe" in topology.get_axis_names() else 1
    if topology is not None:
        _check_topology(topology, tp, pp, world)
    state = _ps.initialize_model_parallel(tp, pp)
    io_ranks, io_group = state.dp_ranks, state.dp_group
    if pp > 1:
        io_ranks = tuple(_ps.grid_rank(stage, dp, 0, tp, state.dp_size)
                         for stage in (0, pp - 1) for dp in range(state.dp_size))
        group = dist.new_group(ranks=list(io_ranks))  # collective: every rank calls it
        io_group = group if state.rank in io_ranks else None
    _EXTRAS = CpmExtras(state, topology, io_ranks, io_group)
    _ready_deepspeed_backend()


def _ready_deepspeed_backend():
    """CPM-1 builds its DeepSpeed ``PipelineModule`` right after this call, before any
    ``deepspeed.init_distributed``; DeepSpeed (since 0.4) needs its communication backend
    for that. Where DeepSpeed is installed it is readied over the existing process group
    (no new group, no communication): tds.comm_ready."""
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        return
    from tds.comm_ready import ensure_backend

    ensure_backend()


def _extras():
    if _EXTRAS is None or not model_parallel_is_initialized() or \
            _EXTRAS.state is not _ps.get_parallel_state():
        return None  # groups destroyed (or rebuilt) through another namespace
    return _EXTRAS


def get_topology():
    """The topology given to :func:`initialize_model_parallel` (None without one)."""
    extras = _extras()
    return None if extras is None else extras.topology


def get_io_parallel_group():
    """The group that synchronises data loading: the data-parallel group, or with a
    pipeline the tensor-parallel rank 0 of the first and last stages (None on others)."""
    extras = _extras()
    if extras is None:
        raise RuntimeError("IO parallel group is not initialized: call "
                           "initialize_model_parallel() first")
    return extras.io_group


def destroy_model_parallel():
    """Drop the groups (and CPM-1's topology and IO group)."""
    global _EXTRAS
    _EXTRAS = None
    _ps.destroy_model_parallel()

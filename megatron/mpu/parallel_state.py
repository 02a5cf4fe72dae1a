"""Who this rank is in the (pipeline, data, tensor) grid, and its process groups.

Rank order is tensor fastest, then data, then pipeline::

    rank = pp_rank * (tp_size * dp_size) + dp_rank * tp_size + tp_rank

which is DeepSpeed's ``PipeModelDataParallelTopology(num_pp, num_mp, num_dp)``,
so groups built here and DeepSpeed's pipeline grid agree rank for rank.

All of it lives in one immutable :class:`ParallelState`, built once by
:func:`initialize_model_parallel`; the Megatron-style getters below read it.
"""
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch.distributed as dist

from .utils import ensure_divisibility


@dataclass(frozen=True)
class ParallelState:
    """This rank's place in the 3D grid and the groups it belongs to."""

    world_size: int
    """Number of ranks in the default process group."""
    rank: int
    """Global rank."""
    tp_size: int
    """Tensor-model-parallel size (ranks that split each layer)."""
    pp_size: int
    """Pipeline-model-parallel size (number of stages)."""
    dp_size: int
    """Data-parallel size (model replicas)."""
    tp_rank: int
    pp_rank: int
    dp_rank: int
    tp_ranks: Tuple[int, ...]
    """Global ranks of this rank's tensor-parallel group, in tp order."""
    pp_ranks: Tuple[int, ...]
    """Global ranks of this rank's pipeline, first stage first."""
    dp_ranks: Tuple[int, ...]
    """Global ranks holding the same model shard as this rank."""
    mp_ranks: Tuple[int, ...]
    """Global ranks of this model replica (tensor x pipeline)."""
    embedding_ranks: Tuple[int, ...]
    """First and last stage of this pipeline (one rank when pp_size == 1; empty on the
    middle stages, which hold no word embedding)."""
    tp_group: Any
    pp_group: Any
    dp_group: Any
    mp_group: Any
    embedding_group: Any


_STATE: Optional[ParallelState] = None


def grid_rank(pp_rank, dp_rank, tp_rank, tp_size, dp_size):
    """Global rank of grid coordinate (pp_rank, dp_rank, tp_rank)."""
    return (pp_rank * dp_size + dp_rank) * tp_size + tp_rank


def _grid_groups(tp_size, pp_size, dp_size):
    """Every group of every kind, as tuples of global ranks, in a fixed order."""
    tp, pp, dp = tp_size, pp_size, dp_size
    r = lambda p, d, t: grid_rank(p, d, t, tp, dp)  # noqa: E731
    tp_groups = [tuple(r(p, d, t) for t in range(tp)) for p in range(pp) for d in range(dp)]
    dp_groups = [tuple(r(p, d, t) for d in range(dp)) for p in range(pp) for t in range(tp)]
    pp_groups = [tuple(r(p, d, t) for p in range(pp)) for d in range(dp) for t in range(tp)]
    mp_groups = [tuple(r(p, d, t) for p in range(pp) for t in range(tp)) for d in range(dp)]
    emb_groups = [g if len(g) == 1 else (g[0], g[-1]) for g in pp_groups]
    return {"tp": tp_groups, "dp": dp_groups, "pp": pp_groups, "mp": mp_groups,
            "embedding": emb_groups}


def _new_groups(rank, ranks_lists):
    """Create every group (all ranks must create all of them, in order); keep ours."""
    mine = ((), None)
    for ranks in ranks_lists:
        group = dist.new_group(list(ranks))
        if rank in ranks:
            mine = (ranks, group)
    return mine


def initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1):
    """Split the world into tensor-, pipeline- and data-parallel groups.

    Args:
        tensor_model_parallel_size: ranks that split each layer (tp). 0 means 1.
        pipeline_model_parallel_size: pipeline stages (pp). 0 means 1.

    Returns:
        The new :class:`ParallelState`.

    Raises:
        RuntimeError: torch.distributed is not initialised, or the groups already exist.
        ValueError: tp * pp does not divide the world size.
    """
    global _STATE
    if not dist.is_initialized():
        raise RuntimeError("initialize_model_parallel needs torch.distributed: call "
                           "torch.distributed.init_process_group() first")
    if _STATE is not None:
        raise RuntimeError("model parallel groups are already initialized; call "
                           "destroy_model_parallel() first")
    tp = max(int(tensor_model_parallel_size), 1)
    pp = max(int(pipeline_model_parallel_size), 1)
    world, rank = dist.get_world_size(), dist.get_rank()
    ensure_divisibility(world, tp * pp, "world size",
                        f"tensor-model-parallel size ({tp}) x pipeline-model-parallel size ({pp})")
    dp = world // (tp * pp)
    groups = {kind: _new_groups(rank, lists) for kind, lists in _grid_groups(tp, pp, dp).items()}
    pp_rank, rest = divmod(rank, tp * dp)
    dp_rank, tp_rank = divmod(rest, tp)
    _STATE = ParallelState(
        world_size=world, rank=rank, tp_size=tp, pp_size=pp, dp_size=dp,
        tp_rank=tp_rank, pp_rank=pp_rank, dp_rank=dp_rank,
        tp_ranks=groups["tp"][0], pp_ranks=groups["pp"][0], dp_ranks=groups["dp"][0],
        mp_ranks=groups["mp"][0], embedding_ranks=groups["embedding"][0],
        tp_group=groups["tp"][1], pp_group=groups["pp"][1], dp_group=groups["dp"][1],
        mp_group=groups["mp"][1], embedding_group=groups["embedding"][1],
    )
    return _STATE


def model_parallel_is_initialized():
    """Whether :func:`initialize_model_parallel` has run (and not been destroyed)."""
    return _STATE is not None


def get_parallel_state():
    """The current :class:`ParallelState`; raises if the groups are not built."""
    if _STATE is None:
        raise RuntimeError("model parallel groups are not initialized: call "
                           "megatron.mpu.initialize_model_parallel(tp, pp) first")
    return _STATE


def destroy_model_parallel():
    """Forget the groups (they are destroyed with the default process group)."""
    global _STATE
    _STATE = None


# ---------------------------------------------------------------- groups
def get_tensor_model_parallel_group():
    return get_parallel_state().tp_group


def get_pipeline_model_parallel_group():
    return get_parallel_state().pp_group


def get_data_parallel_group():
    return get_parallel_state().dp_group


def get_model_parallel_group():
    """Tensor x pipeline group of this model replica (Megatron v2 meaning)."""
    return get_parallel_state().mp_group


def get_embedding_group():
    """First and last pipeline stage: they hold the tied word embedding (None on middle stages)."""
    return get_parallel_state().embedding_group


# ---------------------------------------------------------------- sizes and ranks
def get_tensor_model_parallel_world_size():
    return get_parallel_state().tp_size


def get_pipeline_model_parallel_world_size():
    return get_parallel_state().pp_size


def get_data_parallel_world_size():
    return get_parallel_state().dp_size


def get_tensor_model_parallel_rank():
    return get_parallel_state().tp_rank


def get_pipeline_model_parallel_rank():
    return get_parallel_state().pp_rank


def get_data_parallel_rank():
    return get_parallel_state().dp_rank


def is_pipeline_first_stage(ignore_virtual=True):
    """Whether this rank runs the first pipeline stage (``ignore_virtual`` kept for API parity)."""
    return get_parallel_state().pp_rank == 0


def is_pipeline_last_stage(ignore_virtual=True):
    """Whether this rank runs the last pipeline stage."""
    state = get_parallel_state()
    return state.pp_rank == state.pp_size - 1


def get_tensor_model_parallel_src_rank():
    """Global rank of tp rank 0 in this rank's tensor-parallel group."""
    return get_parallel_state().tp_ranks[0]


def get_data_parallel_src_rank():
    """Global rank of dp rank 0 in this rank's data-parallel group."""
    return get_parallel_state().dp_ranks[0]


def get_pipeline_model_parallel_first_rank():
    return get_parallel_state().pp_ranks[0]


def get_pipeline_model_parallel_last_rank():
    return get_parallel_state().pp_ranks[-1]


def get_pipeline_model_parallel_next_rank():
    """Global rank of the next stage (wraps around, as in Megatron)."""
    state = get_parallel_state()
    return state.pp_ranks[(state.pp_rank + 1) % state.pp_size]


def get_pipeline_model_parallel_prev_rank():
    """Global rank of the previous stage (wraps around, as in Megatron)."""
    state = get_parallel_state()
    return state.pp_ranks[(state.pp_rank - 1) % state.pp_size]


# ---------------------------------------------------------------- Megatron v1 / CPM aliases
get_model_parallel_rank = get_tensor_model_parallel_rank
get_model_parallel_world_size = get_tensor_model_parallel_world_size
get_model_parallel_src_rank = get_tensor_model_parallel_src_rank
get_pipe_parallel_rank = get_pipeline_model_parallel_rank
get_pipe_parallel_world_size = get_pipeline_model_parallel_world_size
get_pipe_parallel_group = get_pipeline_model_parallel_group

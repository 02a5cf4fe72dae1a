"""Who this rank is in the (pipeline, data, context, tensor) grid, and its process groups.

Rank order is tensor fastest, then context, then data, then pipeline (Megatron-core's
default order, "tp-cp-dp-pp")::

    rank = ((pp_rank * dp_size + dp_rank) * cp_size + cp_rank) * tp_size + tp_rank

Without context parallelism (cp_size 1) this is DeepSpeed's
``PipeModelDataParallelTopology(num_pp, num_mp, num_dp)``; with it, DeepSpeed's topology
of ``num_dp = dp_size * cp_size`` (its "data" axis is the data x context group, the
group gradients are reduced over), so groups built here and DeepSpeed's pipeline grid
agree rank for rank.

The expert-model-parallel groups (MoE layers' experts split over ep ranks) are carved out
of each data x context group, as Megatron-core does (:func:`.grid.expert_groups`).

All of it lives in one immutable :class:`ParallelState`, built once by
:func:`initialize_model_parallel`; the Megatron-style getters below read it.

Megatron-LM v2.6's setters (``set_tensor_model_parallel_rank`` ...) do not mutate that
state: they write a small, explicit :class:`ParallelOverrides` record (also immutable,
replaced on each set). A rank/size getter returns the override when one is set, else
the state's value; the groups and collectives always use the real state. See docs/mpu.md.
"""
from dataclasses import dataclass, replace
from typing import Any, Optional, Tuple

import torch.distributed as dist

from .grid import expert_groups, grid_coordinates, grid_groups, grid_rank  # noqa: F401
from .utils import check_optional_size as _check_optional_size
from .utils import ensure_divisibility
from .utils import v26_arguments as _v26_arguments


@dataclass(frozen=True)
class ParallelState:
    """This rank's place in the (pipeline, data, context, tensor) grid and its groups."""

    world_size: int
    """Number of ranks in the default process group."""
    rank: int
    """Global rank."""
    tp_size: int
    """Tensor-model-parallel size (ranks that split each layer)."""
    pp_size: int
    """Pipeline-model-parallel size (number of stages)."""
    dp_size: int
    """Data-parallel size (model replicas reading different samples; the ranks of a
    context-parallel group read the same samples and count once)."""
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
    cp_size: int = 1
    """Context-parallel size (ranks that split each sequence, --context-parallel-size)."""
    cp_rank: int = 0
    cp_ranks: Tuple[int, ...] = ()
    """Global ranks of this rank's context-parallel group, in cp order."""
    dp_cp_ranks: Tuple[int, ...] = ()
    """Global ranks of this rank's data x context group (the gradient reduction's)."""
    cp_group: Any = None
    dp_cp_group: Any = None
    virtual_pp_size: Optional[int] = None
    """Model chunks per pipeline rank (Megatron v2.6's virtual pipeline size), or None.
    Stored for model code that asks; the pipeline module builds its chunks from
    ``num_virtual_stages`` and tds's schedules (interleaved 1F1B, ZB-V) run them."""
    pp_split_rank: Optional[int] = None
    """First decoder stage of an encoder-decoder pipeline (Megatron-core), or None."""
    ep_size: int = 1
    """Expert-model-parallel size: ranks of a data x context group splitting each MoE
    layer's experts (carved out as Megatron-core does: :func:`.grid.expert_groups`)."""
    ep_rank: int = 0
    ep_ranks: Tuple[int, ...] = ()
    ep_group: Any = None
    edp_rank: int = 0
    edp_ranks: Tuple[int, ...] = ()
    """Global ranks holding this rank's experts (dp x cp / ep): their gradients' group."""
    edp_group: Any = None


@dataclass(frozen=True)
class ParallelOverrides:
    """Values set by Megatron v2.6's ``set_*`` functions; None means "read the state"."""

    tp_size: Optional[int] = None
    pp_size: Optional[int] = None
    tp_rank: Optional[int] = None
    pp_rank: Optional[int] = None
    virtual_pp_rank: Optional[int] = None


_STATE: Optional[ParallelState] = None
_OVERRIDES = ParallelOverrides()


def _new_groups(rank, ranks_lists):
    """Create every group (all ranks must create all of them, in order); keep ours."""
    mine = ((), None)
    for ranks in ranks_lists:
        group = dist.new_group(list(ranks))
        if rank in ranks:
            mine = (ranks, group)
    return mine


def _build_groups(rank, tp, pp, dp, cp, ep=1):
    """Our groups of every kind: ``{kind: (ranks, group)}``. Without context parallelism
    the data x context group is the data-parallel group itself (no second group); without
    expert parallelism the expert-data-parallel group is the data x context group."""
    lists = grid_groups(tp, pp, dp, cp)
    lists.update(expert_groups(lists["dp_cp"], ep))
    kinds = [kind for kind in lists if not (kind == "dp_cp" and cp == 1)
             and not (kind == "edp" and ep == 1)]
    groups = {kind: _new_groups(rank, lists[kind]) for kind in kinds}
    if cp == 1:
        groups["dp_cp"] = groups["dp"]
    if ep == 1:
        groups["edp"] = groups["dp_cp"]
    return groups


def initialize_model_parallel(tensor_model_parallel_size: int = 1,
                              pipeline_model_parallel_size: int = 1,
                              virtual_pipeline_model_parallel_size: Optional[int] = None,
                              pipeline_model_parallel_split_rank: Optional[int] = None,
                              context_parallel_size: int = 1,
                              expert_model_parallel_size: int = 1,
                              **v26_names: int) -> ParallelState:
    """Split the world into tensor-, context-, pipeline- and data-parallel groups.

    Accepts Megatron v2.6's 3-argument form ``(tp, pp, virtual_pp_size)`` and core's
    4-argument form ``(tp, pp, virtual_pp_size, pp_split_rank)``, positionally or with
    v2.6's keyword names (``tensor_model_parallel_size_=`` ...).

    Args:
        tensor_model_parallel_size: ranks that split each layer (tp). 0 means 1.
        pipeline_model_parallel_size: pipeline stages (pp). 0 means 1.
        virtual_pipeline_model_parallel_size: model chunks per pipeline rank (v2.6's
            interleaved schedule). Stored in the state, and the virtual rank starts at 0;
            ``is_pipeline_first/last_stage()`` honour it as v2.6 does. tds's engine does
            not interleave, so this only informs model code that reads it.
        pipeline_model_parallel_split_rank: stage where an encoder-decoder model's
            decoder starts (stored; tds's T5 pipeline decides its own split).
        context_parallel_size: ranks that split each sequence (cp, Megatron-core's
            keyword); the data-parallel size is what is left: world / (tp * cp * pp).
        expert_model_parallel_size: ranks that split each MoE layer's experts (ep,
            Megatron-core's keyword), carved out of the dp x cp ranks: it must divide
            dp * cp. The experts' tensor-parallel size is tp (each expert's FFN is split
            like a dense one).
        **v26_names: the same four values under v2.6's names with a trailing underscore.

    Returns:
        The new :class:`ParallelState`.

    Raises:
        RuntimeError: torch.distributed is not initialised, or the groups already exist.
        ValueError: tp * cp * pp does not divide the world size, or ep does not divide
            dp * cp.
    """
    global _STATE, _OVERRIDES
    (tensor_model_parallel_size, pipeline_model_parallel_size,
     virtual_pipeline_model_parallel_size, pipeline_model_parallel_split_rank) = _v26_arguments(
        (tensor_model_parallel_size, pipeline_model_parallel_size,
         virtual_pipeline_model_parallel_size, pipeline_model_parallel_split_rank), v26_names)
    if not dist.is_initialized():
        raise RuntimeError("initialize_model_parallel needs torch.distributed: call "
                           "torch.distributed.init_process_group() first")
    if _STATE is not None:
        raise RuntimeError("model parallel groups are already initialized; call "
                           "destroy_model_parallel() first")
    tp = max(int(tensor_model_parallel_size), 1)
    pp = max(int(pipeline_model_parallel_size), 1)
    cp = _check_optional_size(context_parallel_size, "context_parallel_size", 1) or 1
    world, rank = dist.get_world_size(), dist.get_rank()
    what = f"tensor-model-parallel size ({tp}) x pipeline-model-parallel size ({pp})"
    ensure_divisibility(world, tp * pp * cp, "world size",
                        what if cp == 1 else f"{what} x context-parallel size ({cp})")
    vpp = _check_optional_size(virtual_pipeline_model_parallel_size,
                               "virtual_pipeline_model_parallel_size", 1)
    split = _check_optional_size(pipeline_model_parallel_split_rank,
                                 "pipeline_model_parallel_split_rank", 0)
    dp = world // (tp * pp * cp)
    ep = _check_optional_size(expert_model_parallel_size, "expert_model_parallel_size", 1) or 1
    ensure_divisibility(dp * cp, ep, f"data-parallel x context-parallel size ({dp} x {cp})",
                        f"expert-model-parallel size ({ep}): the expert-parallel group is "
                        f"carved out of the data x context ranks")
    groups = _build_groups(rank, tp, pp, dp, cp, ep)
    pp_rank, dp_rank, cp_rank, tp_rank = grid_coordinates(rank, tp, dp, cp)
    _STATE = ParallelState(
        world_size=world, rank=rank, tp_size=tp, pp_size=pp, dp_size=dp,
        tp_rank=tp_rank, pp_rank=pp_rank, dp_rank=dp_rank,
        tp_ranks=groups["tp"][0], pp_ranks=groups["pp"][0], dp_ranks=groups["dp"][0],
        mp_ranks=groups["mp"][0], embedding_ranks=groups["embedding"][0],
        tp_group=groups["tp"][1], pp_group=groups["pp"][1], dp_group=groups["dp"][1],
        mp_group=groups["mp"][1], embedding_group=groups["embedding"][1],
        cp_size=cp, cp_rank=cp_rank, cp_ranks=groups["cp"][0], cp_group=groups["cp"][1],
        dp_cp_ranks=groups["dp_cp"][0], dp_cp_group=groups["dp_cp"][1],
        virtual_pp_size=vpp, pp_split_rank=split,
        ep_size=ep, ep_rank=(dp_rank * cp + cp_rank) % ep, ep_ranks=groups["ep"][0],
        ep_group=groups["ep"][1], edp_rank=(dp_rank * cp + cp_rank) // ep,
        edp_ranks=groups["edp"][0], edp_group=groups["edp"][1],
    )
    _OVERRIDES = ParallelOverrides(virtual_pp_rank=None if vpp is None else 0)
    return _STATE


def model_parallel_is_initialized() -> bool:
    """Whether :func:`initialize_model_parallel` has run (and not been destroyed)."""
    return _STATE is not None


def is_unitialized() -> bool:
    """Megatron v2.6's (misspelt) name: True while the groups are not built."""
    return _STATE is None


def get_parallel_state() -> ParallelState:
    """The current :class:`ParallelState`; raises if the groups are not built."""
    if _STATE is None:
        raise RuntimeError("model parallel groups are not initialized: call "
                           "megatron.mpu.initialize_model_parallel(tp, pp) first")
    return _STATE


def destroy_model_parallel() -> None:
    """Forget the groups (destroyed with the default process group) and every override."""
    global _STATE, _OVERRIDES
    _STATE = None
    _OVERRIDES = ParallelOverrides()


def get_parallel_overrides() -> ParallelOverrides:
    """The current :class:`ParallelOverrides` (all None unless a ``set_*`` was called)."""
    return _OVERRIDES


def _override_or_state(field):
    value = getattr(_OVERRIDES, field)
    return getattr(get_parallel_state(), field) if value is None else value


# ---------------------------------------------------------------- groups
def get_tensor_model_parallel_group() -> Optional[dist.ProcessGroup]:
    return get_parallel_state().tp_group


def get_pipeline_model_parallel_group() -> Optional[dist.ProcessGroup]:
    return get_parallel_state().pp_group


def get_data_parallel_group(with_context_parallel: bool = False) -> Optional[dist.ProcessGroup]:
    """The ranks holding the same model shard and the same part of the sequence; with
    ``with_context_parallel`` (Megatron-core's keyword) the data x context group, which
    reduces the gradients (every rank of it holds the same shard)."""
    state = get_parallel_state()
    return state.dp_cp_group if with_context_parallel else state.dp_group


def get_context_parallel_group() -> Optional[dist.ProcessGroup]:
    """The ranks that split this rank's sequences (a group of one without cp)."""
    return get_parallel_state().cp_group


def get_model_parallel_group() -> Optional[dist.ProcessGroup]:
    """Tensor x pipeline group of this model replica (Megatron v2.6 meaning)."""
    return get_parallel_state().mp_group


def get_embedding_group() -> Optional[dist.ProcessGroup]:
    """First and last pipeline stage: they hold the tied word embedding (None on middle stages)."""
    return get_parallel_state().embedding_group


# ---------------------------------------------------------------- sizes and ranks
def get_tensor_model_parallel_world_size() -> int:
    """Tensor-parallel size (the override from the setter when one is set)."""
    return _override_or_state("tp_size")


def get_pipeline_model_parallel_world_size() -> int:
    """Pipeline-parallel size (the override from the setter when one is set)."""
    return _override_or_state("pp_size")


def get_data_parallel_world_size(with_context_parallel: bool = False) -> int:
    """Data-parallel size; with ``with_context_parallel`` the data x context size."""
    state = get_parallel_state()
    return state.dp_size * (state.cp_size if with_context_parallel else 1)


def get_context_parallel_world_size() -> int:
    """Context-parallel size (1 without context parallelism)."""
    return get_parallel_state().cp_size


def get_context_parallel_rank() -> int:
    """This rank's index in its context-parallel group (which part of each sequence)."""
    return get_parallel_state().cp_rank


def get_context_parallel_global_ranks() -> Tuple[int, ...]:
    """Global ranks of this rank's context-parallel group, in cp order (core's name)."""
    return get_parallel_state().cp_ranks


def get_tensor_model_parallel_rank() -> int:
    """Rank in the tensor-parallel group (the override from the setter when one is set)."""
    return _override_or_state("tp_rank")


def get_pipeline_model_parallel_rank() -> int:
    """Pipeline stage of this rank (the override from the setter when one is set)."""
    return _override_or_state("pp_rank")


def get_data_parallel_rank(with_context_parallel: bool = False) -> int:
    """Data-parallel rank; with ``with_context_parallel`` the rank in the data x context
    group (``dp_rank * cp_size + cp_rank``)."""
    state = get_parallel_state()
    if with_context_parallel:
        return state.dp_rank * state.cp_size + state.cp_rank
    return state.dp_rank


def is_pipeline_first_stage(ignore_virtual: bool = False) -> bool:
    """Whether this rank runs the first pipeline stage.

    Args:
        ignore_virtual: with a virtual pipeline size set, v2.6 counts only virtual
            chunk 0 as first; True ignores the virtual rank.
    """
    if not ignore_virtual and get_virtual_pipeline_model_parallel_world_size() is not None \
            and get_virtual_pipeline_model_parallel_rank() != 0:
        return False
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage(ignore_virtual: bool = False) -> bool:
    """Whether this rank runs the last pipeline stage (see :func:`is_pipeline_first_stage`)."""
    vpp = get_virtual_pipeline_model_parallel_world_size()
    if not ignore_virtual and vpp is not None \
            and get_virtual_pipeline_model_parallel_rank() != vpp - 1:
        return False
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of tp rank 0 in this rank's tensor-parallel group."""
    return get_parallel_state().tp_ranks[0]


def get_data_parallel_src_rank(with_context_parallel: bool = False) -> int:
    """Global rank of dp rank 0 in this rank's data-parallel (x context) group."""
    state = get_parallel_state()
    return (state.dp_cp_ranks if with_context_parallel else state.dp_ranks)[0]


def get_pipeline_model_parallel_first_rank() -> int:
    return get_parallel_state().pp_ranks[0]


def get_pipeline_model_parallel_last_rank() -> int:
    return get_parallel_state().pp_ranks[-1]


def get_pipeline_model_parallel_next_rank() -> int:
    """Global rank of the next stage (wraps around, as in Megatron)."""
    state = get_parallel_state()
    return state.pp_ranks[(state.pp_rank + 1) % state.pp_size]


def get_pipeline_model_parallel_prev_rank() -> int:
    """Global rank of the previous stage (wraps around, as in Megatron)."""
    state = get_parallel_state()
    return state.pp_ranks[(state.pp_rank - 1) % state.pp_size]


# ---------------------------------------------------------------- experts (Megatron-core's names)
def get_expert_model_parallel_group() -> Optional[dist.ProcessGroup]:
    """The ranks splitting each MoE layer's experts: tokens are dispatched over it."""
    return get_parallel_state().ep_group


def get_expert_model_parallel_rank() -> int:
    """Index in the expert-parallel group: this rank holds experts [r E/ep, (r+1) E/ep)."""
    return get_parallel_state().ep_rank


def get_expert_model_parallel_world_size() -> int:
    return get_parallel_state().ep_size


def get_expert_data_parallel_group() -> Optional[dist.ProcessGroup]:
    """The ranks holding this rank's experts: their gradients are reduced over it."""
    return get_parallel_state().edp_group


def get_expert_data_parallel_rank() -> int:
    return get_parallel_state().edp_rank


def get_expert_data_parallel_world_size() -> int:
    """Data x context size / expert-parallel size."""
    return len(get_parallel_state().edp_ranks)


# ---------------------------------------------------------------- model replica (tp x pp)
# One meaning for the whole "model parallel" family: the tensor x pipeline group of this
# model replica, as get_model_parallel_group() in Megatron v2.6 and DeepSpeed's grid.
# Megatron v1.0 / CPM-1 meant tensor-parallel by these names: megatron.mpu.v1 / .cpm.
def get_model_parallel_world_size() -> int:
    """Ranks in this model replica (tensor x pipeline)."""
    return len(get_parallel_state().mp_ranks)


def get_model_parallel_rank() -> int:
    """This rank's index in :func:`get_model_parallel_group` (pp_rank * tp + tp_rank)."""
    state = get_parallel_state()
    return state.mp_ranks.index(state.rank)


def get_model_parallel_src_rank() -> int:
    """Global rank of the first rank of this model replica."""
    return get_parallel_state().mp_ranks[0]


get_pipe_parallel_rank = get_pipeline_model_parallel_rank
get_pipe_parallel_world_size = get_pipeline_model_parallel_world_size
get_pipe_parallel_group = get_pipeline_model_parallel_group


# ---------------------------------------------------------------- Megatron v2.6 setters
def _set_override(**value):
    global _OVERRIDES
    (name, v), = value.items()
    if v is not None and (isinstance(v, bool) or int(v) != v or v < 0):
        raise ValueError(f"{name} must be a non-negative integer or None, got {v!r}")
    _OVERRIDES = replace(_OVERRIDES, **{name: None if v is None else int(v)})


def set_tensor_model_parallel_world_size(world_size: Optional[int]) -> None:
    """Override what :func:`get_tensor_model_parallel_world_size` reports (None clears).

    Used, as in v2.6, to build one tensor-parallel shard of a model in a single process
    (checkpoint tools). Layers built with the default group shard by the overridden
    rank and size; collectives still run on the real groups.

    Args:
        world_size: the size to report, or None to read the state again.
    """
    _set_override(tp_size=world_size)


def set_pipeline_model_parallel_world_size(world_size: Optional[int]) -> None:
    """Override the reported pipeline size (None clears); see the tensor setter.

    Args:
        world_size: the size to report, or None.
    """
    _set_override(pp_size=world_size)


def set_tensor_model_parallel_rank(rank: Optional[int]) -> None:
    """Override the reported tensor-parallel rank (None clears); see the size setter.

    Args:
        rank: the rank to report, or None.
    """
    _set_override(tp_rank=rank)


def set_pipeline_model_parallel_rank(rank: Optional[int]) -> None:
    """Override the reported pipeline rank (None clears): stage tests read it.

    Args:
        rank: the stage to report, or None.
    """
    _set_override(pp_rank=rank)


def get_virtual_pipeline_model_parallel_world_size() -> Optional[int]:
    """Model chunks per pipeline rank given to :func:`initialize_model_parallel`, or None."""
    return None if _STATE is None else _STATE.virtual_pp_size


def get_virtual_pipeline_model_parallel_rank() -> Optional[int]:
    """The model chunk being built or run (v2.6: set by the interleaved schedule), or None."""
    return _OVERRIDES.virtual_pp_rank


def set_virtual_pipeline_model_parallel_rank(rank: Optional[int]) -> None:
    """Set the current model chunk (v2.6 sets it before building/running each chunk).

    Args:
        rank: chunk index in ``[0, virtual_pipeline_model_parallel_size)``, or None.
    """
    _set_override(virtual_pp_rank=rank)


def get_pipeline_model_parallel_split_rank() -> Optional[int]:
    """Stage where an encoder-decoder pipeline's decoder starts, or None (core's name)."""
    return get_parallel_state().pp_split_rank

"""Parallel state: every rank's groups equal DeepSpeed's topology, for every layout up to 8 ranks."""
import pytest
import torch
import torch.distributed as dist
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

from harness import run_distributed
from megatron import mpu
from megatron.mpu import v1


def _layouts(world):
    return [(tp, pp, world // (tp * pp)) for tp in (1, 2, 4, 8) for pp in (1, 2, 4, 8)
            if world % (tp * pp) == 0]


def _describe_every_layout(world):
    out = {}
    for tp, pp, dp in _layouts(world):
        mpu.initialize_model_parallel(tp, pp)
        s = mpu.get_parallel_state()
        # The group objects must connect exactly the listed ranks.
        sums = {}
        for name, group in [("tp", mpu.get_tensor_model_parallel_group()),
                            ("pp", mpu.get_pipeline_model_parallel_group()),
                            ("dp", mpu.get_data_parallel_group()),
                            ("mp", mpu.get_model_parallel_group()),
                            ("embedding", mpu.get_embedding_group())]:
            if group is None:  # middle pipeline stages have no embedding group
                continue
            t = torch.tensor([float(dist.get_rank())])
            dist.all_reduce(t, group=group)
            sums[name] = t.item()
        out[(tp, pp, dp)] = {
            "ranks": (s.tp_rank, s.pp_rank, s.dp_rank),
            "sizes": (mpu.get_tensor_model_parallel_world_size(),
                      mpu.get_pipeline_model_parallel_world_size(),
                      mpu.get_data_parallel_world_size()),
            "getter_ranks": (mpu.get_tensor_model_parallel_rank(),
                             mpu.get_pipeline_model_parallel_rank(),
                             mpu.get_data_parallel_rank()),
            "members": {"tp": s.tp_ranks, "pp": s.pp_ranks, "dp": s.dp_ranks,
                        "mp": s.mp_ranks, "embedding": s.embedding_ranks},
            "sums": sums,
            "src": mpu.get_tensor_model_parallel_src_rank(),
            "dp_src": mpu.get_data_parallel_src_rank(),
            "first": mpu.get_pipeline_model_parallel_first_rank(),
            "last": mpu.get_pipeline_model_parallel_last_rank(),
            "next": mpu.get_pipeline_model_parallel_next_rank(),
            "prev": mpu.get_pipeline_model_parallel_prev_rank(),
            "is_first": mpu.is_pipeline_first_stage(),
            "is_last": mpu.is_pipeline_last_stage(),
            "replica": (mpu.get_model_parallel_rank(), mpu.get_model_parallel_world_size(),
                        mpu.get_model_parallel_src_rank()),
            "v1": (v1.get_model_parallel_rank(), v1.get_model_parallel_world_size(),
                   v1.get_model_parallel_src_rank()),
        }
        mpu.destroy_model_parallel()
    return out


def _group_of(topo, axis, rank):
    return next(tuple(g) for g in topo.get_axis_comm_lists(axis) if rank in g)


def _expected(topo, rank, tp, pp, dp):
    coord = topo.get_coord(rank)
    pipe = _group_of(topo, "pipe", rank) if pp > 1 else (rank,)
    mp = tuple(sorted(r for r in range(tp * pp * dp) if topo.get_coord(r).data == coord.data))
    return {
        "ranks": (coord.model, coord.pipe, coord.data),
        "sizes": (tp, pp, dp),
        "getter_ranks": (coord.model, coord.pipe, coord.data),
        "members": {
            "tp": _group_of(topo, "model", rank) if tp > 1 else (rank,),
            "pp": pipe,
            "dp": _group_of(topo, "data", rank) if dp > 1 else (rank,),
            "mp": mp,
            "embedding": (rank,) if pp == 1 else
                         (pipe[0], pipe[-1]) if rank in (pipe[0], pipe[-1]) else (),
        },
        "src": topo.get_rank(pipe=coord.pipe, data=coord.data, model=0),
        "dp_src": topo.get_rank(pipe=coord.pipe, data=0, model=coord.model),
        "first": pipe[0],
        "last": pipe[-1],
        "next": pipe[(coord.pipe + 1) % pp],
        "prev": pipe[(coord.pipe - 1) % pp],
        "is_first": coord.pipe == 0,
        "is_last": coord.pipe == pp - 1,
        # megatron.mpu: "model parallel" is the tp x pp replica; v1: tensor parallel.
        "replica": (mp.index(rank), tp * pp, mp[0]),
        "v1": (coord.model, tp, topo.get_rank(pipe=coord.pipe, data=coord.data, model=0)),
    }


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_groups_match_deepspeed_topology(world):
    per_rank = run_distributed(_describe_every_layout, world, world)
    for layout in _layouts(world):
        tp, pp, dp = layout
        topo = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
        for rank, described in enumerate(per_rank):
            got = dict(described[layout])
            sums = got.pop("sums")
            assert got == _expected(topo, rank, tp, pp, dp), (layout, rank)
            for name, members in got["members"].items():
                if not members:
                    assert name not in sums
                    continue
                assert sums[name] == float(sum(members)), (layout, rank, name)


def _bad_layout(tp, pp):
    try:
        mpu.initialize_model_parallel(tp, pp)
    except ValueError as exc:
        return str(exc)
    return None


def test_sizes_that_do_not_divide_the_world_raise_on_every_rank():
    messages = run_distributed(_bad_layout, 4, 3, 1, timeout=60)
    assert all(m is not None and "world size (4)" in m and "(3)" in m for m in messages), messages
    messages = run_distributed(_bad_layout, 4, 2, 4, timeout=60)
    assert all(m is not None and "(2) x pipeline-model-parallel size (4)" in m
               for m in messages), messages


def _state_is_immutable_and_single():
    mpu.initialize_model_parallel(1, 1)
    state = mpu.get_parallel_state()
    errors = []
    try:
        state.tp_size = 2
    except Exception as exc:  # dataclasses.FrozenInstanceError
        errors.append(type(exc).__name__)
    try:
        mpu.initialize_model_parallel(1, 1)
    except RuntimeError as exc:
        errors.append(str(exc))
    mpu.destroy_model_parallel()
    try:
        mpu.get_tensor_model_parallel_rank()
    except RuntimeError as exc:
        errors.append(str(exc))
    return errors


def test_state_is_frozen_and_built_once():
    (errors,) = run_distributed(_state_is_immutable_and_single, 1)
    assert errors[0] == "FrozenInstanceError"
    assert "already initialized" in errors[1]
    assert "not initialized" in errors[2]


# ---------------------------------------------------------------- context parallelism
#: (tp, cp, pp) at 8 ranks (dp what is left): cp 2, 4 and 8, beside tp, pp and dp
CP_LAYOUTS = [(1, 2, 1), (2, 2, 2), (1, 2, 4), (2, 4, 1), (1, 4, 2), (1, 8, 1)]


def _describe_cp_layouts(layouts):
    out = {}
    for tp, cp, pp in layouts:
        mpu.initialize_model_parallel(tp, pp, context_parallel_size=cp)
        s = mpu.get_parallel_state()
        sums = {}
        for name, group in [("tp", mpu.get_tensor_model_parallel_group()),
                            ("cp", mpu.get_context_parallel_group()),
                            ("dp", mpu.get_data_parallel_group()),
                            ("dp_cp", mpu.get_data_parallel_group(with_context_parallel=True)),
                            ("pp", mpu.get_pipeline_model_parallel_group()),
                            ("mp", mpu.get_model_parallel_group())]:
            t = torch.tensor([float(dist.get_rank())])
            dist.all_reduce(t, group=group)
            sums[name] = t.item()
        out[(tp, cp, pp)] = {
            "coords": (s.pp_rank, s.dp_rank, s.cp_rank, s.tp_rank),
            "getters": (mpu.get_context_parallel_rank(), mpu.get_context_parallel_world_size(),
                        mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size(),
                        mpu.get_data_parallel_rank(with_context_parallel=True),
                        mpu.get_data_parallel_world_size(with_context_parallel=True),
                        mpu.get_data_parallel_src_rank(with_context_parallel=True)),
            "members": {"tp": s.tp_ranks, "cp": mpu.get_context_parallel_global_ranks(),
                        "dp": s.dp_ranks, "dp_cp": s.dp_cp_ranks, "pp": s.pp_ranks,
                        "mp": s.mp_ranks},
            "sums": sums}
        mpu.destroy_model_parallel()
    return out


def _cp_expected(rank, tp, cp, pp, dp):
    """From DeepSpeed's own row-major topologies: (pipe, data, context, model) for every
    group, and PipeModelDataParallelTopology with dp x cp as its data axis for the grid
    tds's pipeline engine builds (its data groups reduce the gradients)."""
    from deepspeed.runtime.pipe.topology import ProcessTopology

    topo = ProcessTopology(axes=["pipe", "data", "context", "model"], dims=[pp, dp, cp, tp])
    grid = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp * cp)
    c = topo.get_coord(rank)
    same = lambda *axes: tuple(sorted(  # noqa: E731  ranks agreeing with us on ``axes``
        r for r in range(topo.world_size())
        if all(getattr(topo.get_coord(r), a) == getattr(c, a) for a in axes)))
    dp_cp = _group_of(grid, "data", rank)
    assert dp_cp == same("pipe", "model")
    return {"coords": (c.pipe, c.data, c.context, c.model),
            "getters": (c.context, cp, c.data, dp, dp_cp.index(rank), dp * cp, dp_cp[0]),
            "members": {"tp": same("pipe", "data", "context"),
                        "cp": same("pipe", "data", "model"),
                        "dp": same("pipe", "context", "model"), "dp_cp": dp_cp,
                        "pp": same("data", "context", "model"),
                        "mp": same("data", "context")}}


def test_context_parallel_groups_match_deepspeed_topologies():
    per_rank = run_distributed(_describe_cp_layouts, 8, CP_LAYOUTS, timeout=180)
    for tp, cp, pp in CP_LAYOUTS:
        for rank, described in enumerate(per_rank):
            got = dict(described[(tp, cp, pp)])
            sums = got.pop("sums")
            assert got == _cp_expected(rank, tp, cp, pp, 8 // (tp * cp * pp)), \
                ((tp, cp, pp), rank)
            for name, members in got["members"].items():
                assert sums[name] == float(sum(members)), ((tp, cp, pp), rank, name)


def _bad_cp(tp, cp):
    try:
        mpu.initialize_model_parallel(tp, 1, context_parallel_size=cp)
    except ValueError as exc:
        return str(exc)
    return None


def test_context_parallel_size_that_does_not_divide_the_world_raises_on_every_rank():
    messages = run_distributed(_bad_cp, 4, 2, 4, timeout=60)
    assert all(m is not None and "world size (4)" in m and "context-parallel size (4)" in m
               for m in messages), messages

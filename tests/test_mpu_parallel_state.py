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

"""Megatron v2.6's public mpu API and the v1/CPM namespace.

- every name v2.6's ``megatron/mpu/__init__.py`` exports exists here; enums have v2.6's values;
- v2.6 setters override the getters and the sharding of layers built afterwards, and clear;
- virtual pipeline sizes follow v2.6's stage rules; 1-D split/gather round-trips;
- ``checkpoint`` in both call shapes (with distributed saved activations) gives the
  gradients of a plain run;
- a model file in v2.6 style and one in CPM style (ported by its import) train at tp=2
  with the losses of tp=1;
- v2.0-v2.5's checkpointed-activations memory-buffer calls exist with v2's signature (no
  arguments) and do nothing: checkpointing needs no buffer here.
"""
import pytest
import torch
from torch import nn

from harness import run_distributed
from megatron import mpu
from megatron.mpu import v1

V26_NAMES = """vocab_parallel_cross_entropy broadcast_data is_unitialized destroy_model_parallel
get_data_parallel_group get_data_parallel_rank get_data_parallel_world_size get_embedding_group
get_model_parallel_group get_tensor_model_parallel_group get_pipeline_model_parallel_group
get_tensor_model_parallel_rank set_tensor_model_parallel_rank get_pipeline_model_parallel_rank
set_pipeline_model_parallel_rank is_pipeline_first_stage is_pipeline_last_stage
get_tensor_model_parallel_src_rank get_pipeline_model_parallel_first_rank
get_pipeline_model_parallel_last_rank get_pipeline_model_parallel_next_rank
get_pipeline_model_parallel_prev_rank get_tensor_model_parallel_world_size
set_tensor_model_parallel_world_size get_pipeline_model_parallel_world_size
set_pipeline_model_parallel_world_size get_virtual_pipeline_model_parallel_rank
set_virtual_pipeline_model_parallel_rank get_virtual_pipeline_model_parallel_world_size
initialize_model_parallel model_parallel_is_initialized ColumnParallelLinear RowParallelLinear
VocabParallelEmbedding set_tensor_model_parallel_attributes
set_defaults_if_not_set_tensor_model_parallel_attributes copy_tensor_model_parallel_attributes
copy_to_tensor_model_parallel_region gather_from_tensor_model_parallel_region
reduce_from_tensor_model_parallel_region scatter_to_tensor_model_parallel_region checkpoint
get_cuda_rng_tracker model_parallel_cuda_manual_seed gather_split_1d_tensor
split_tensor_into_1d_equal_chunks divide split_tensor_along_last_dim""".split()

V1_NAMES = """vocab_parallel_cross_entropy broadcast_data clip_grad_norm destroy_model_parallel
get_data_parallel_group get_data_parallel_rank get_data_parallel_world_size
get_model_parallel_group get_model_parallel_rank get_model_parallel_src_rank
get_model_parallel_world_size initialize_model_parallel model_parallel_is_initialized
ColumnParallelLinear ParallelEmbedding RowParallelLinear VocabParallelEmbedding
copy_to_model_parallel_region gather_from_model_parallel_region
reduce_from_model_parallel_region scatter_to_model_parallel_region checkpoint
get_cuda_rng_tracker model_parallel_cuda_manual_seed divide split_tensor_along_last_dim""".split()


def test_every_public_name_exists():
    assert [n for n in V26_NAMES if not callable(getattr(mpu, n, None))] == []
    assert [n for n in V1_NAMES if not callable(getattr(v1, n, None))] == []


def test_v2_memory_buffer_calls_take_v2s_arguments_and_do_nothing():
    import inspect

    for name in ("init_checkpointed_activations_memory_buffer",
                 "reset_checkpointed_activations_memory_buffer"):
        fn = getattr(mpu, name)
        assert list(inspect.signature(fn).parameters) == [], name  # v2's: no arguments
        assert fn() is None and fn() is None, name  # callable any number of times
        assert "buffer" in fn.__doc__


def test_enums_have_megatron_values():
    from megatron.model.enums import AttnMaskType, AttnType, LayerType
    from megatron.model.fused_softmax import AttnMaskType as SoftmaxMaskType

    assert {e.name: e.value for e in LayerType} == {"encoder": 1, "decoder": 2}
    assert {e.name: e.value for e in AttnType} == {"self_attn": 1, "cross_attn": 2}
    assert {e.name: e.value for e in AttnMaskType} == {"padding": 1, "causal": 2}
    assert SoftmaxMaskType is AttnMaskType  # one class, one meaning


def test_setters_shard_layers_built_without_groups(seed):
    """v2.6's tools build one tp shard in one process with the setters."""
    assert mpu.is_unitialized()
    try:
        mpu.set_tensor_model_parallel_world_size(4)
        mpu.set_tensor_model_parallel_rank(2)
        mpu.set_pipeline_model_parallel_world_size(3)
        mpu.set_pipeline_model_parallel_rank(2)
        assert (mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank(),
                mpu.get_pipeline_model_parallel_world_size(),
                mpu.get_pipeline_model_parallel_rank()) == (4, 2, 3, 2)
        assert mpu.is_pipeline_last_stage() and not mpu.is_pipeline_first_stage()
        torch.manual_seed(seed)
        layer = mpu.ColumnParallelLinear(8, 16, keep_master_weight_for_test=True)
        assert layer.weight.shape == (4, 8)
        assert torch.equal(layer.weight.data, layer.master_weight[8:12])
        row = mpu.RowParallelLinear(16, 8, keep_master_weight_for_test=True)
        assert torch.equal(row.weight.data, row.master_weight[:, 8:12])
        with pytest.raises(ValueError, match="non-negative integer"):
            mpu.set_tensor_model_parallel_rank(-1)
        mpu.set_tensor_model_parallel_rank(None)
        with pytest.raises(RuntimeError, match="not initialized"):
            mpu.get_tensor_model_parallel_rank()  # cleared: back to the (absent) state
    finally:
        mpu.destroy_model_parallel()
    assert mpu.get_parallel_overrides() == mpu.ParallelOverrides()


def _virtual_and_split(seed):
    import torch.distributed as dist

    out = {}
    mpu.initialize_model_parallel(1, 2, 2)  # v2.6's 3-argument form
    pp = mpu.get_pipeline_model_parallel_rank()
    out["vpp"] = (mpu.get_virtual_pipeline_model_parallel_world_size(),
                  mpu.get_virtual_pipeline_model_parallel_rank())
    stages = []
    for chunk in (0, 1):
        mpu.set_virtual_pipeline_model_parallel_rank(chunk)
        stages.append((mpu.is_pipeline_first_stage(), mpu.is_pipeline_last_stage(),
                       mpu.is_pipeline_first_stage(ignore_virtual=True),
                       mpu.is_pipeline_last_stage(ignore_virtual=True)))
    out["stages"], out["pp"] = stages, pp
    mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(tensor_model_parallel_size_=2, pipeline_model_parallel_size_=1,
                                  virtual_pipeline_model_parallel_size_=None,
                                  pipeline_model_parallel_split_rank_=0)  # 4 values, v2 names
    out["split"] = mpu.get_pipeline_model_parallel_split_rank()
    full = torch.randn(3, 4, 6, generator=torch.Generator().manual_seed(seed))
    part = mpu.split_tensor_into_1d_equal_chunks(full, new_buffer=True)
    out["part"] = torch.equal(part, full.view(-1)[dist.get_rank() * 36:(dist.get_rank() + 1) * 36])
    out["gathered"] = torch.equal(mpu.gather_split_1d_tensor(part).view(3, 4, 6), full)
    src = nn.Linear(2, 2).weight
    mpu.set_tensor_model_parallel_attributes(src, True, 1, 3)
    dst = torch.empty(1)
    mpu.copy_tensor_model_parallel_attributes(dst, src)
    out["attrs"] = (dst.tensor_model_parallel, dst.partition_dim, dst.partition_stride)
    return out


def test_virtual_pipeline_split_1d_and_attributes(seed):
    for out in run_distributed(_virtual_and_split, 2, seed):
        assert out["vpp"] == (2, 0)
        first, last = out["pp"] == 0, out["pp"] == 1
        # chunk 0 is first only on stage 0; chunk 1 (the last chunk) is last only on stage 1.
        assert out["stages"] == [(first, False, first, last), (False, last, first, last)]
        assert out["split"] == 0 and out["part"] and out["gathered"]
        assert out["attrs"] == (True, 1, 3)


def _checkpoint_grads(seed):
    """Gradients of a block run plainly, with (fn, *args) and with v2.6's (fn, True, *args)."""
    mpu.initialize_model_parallel(2, 1)
    mpu.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    mlp = mpu.ColumnParallelLinear(8, 16, gather_output=True)
    x0 = torch.randn(4, 3, 8)

    def block(x, scale):
        return mlp(x)[0] * scale

    mpu.init_checkpointed_activations_memory_buffer()  # a v2 run's initialize calls it
    grads = []
    for call in (lambda x: block(x, 2.0), lambda x: mpu.checkpoint(block, x, 2.0),
                 lambda x: mpu.checkpoint(block, True, x, 2.0),
                 lambda x: mpu.checkpoint(block, x, 2.0, distribute_saved_activations=True)):
        x = x0.clone().requires_grad_()
        mlp.zero_grad()
        call(x).square().sum().backward()
        mpu.reset_checkpointed_activations_memory_buffer()  # v2's train step calls it
        grads.append((x.grad.clone(), mlp.weight.grad.clone()))
    return [all(torch.equal(a, b) for a, b in zip(grads[0], g)) for g in grads[1:]]


def test_checkpoint_accepts_both_call_shapes(seed):
    for same in run_distributed(_checkpoint_grads, 2, seed):
        assert same == [True, True, True]


def _train(module, tp, seed):
    import importlib

    return importlib.import_module(f"compat_models.{module}").train(tp, seed)


@pytest.mark.parametrize("module", ["v26_style", "cpm_style"])
def test_foreign_model_file_trains_at_tp2_like_serial(module, seed):
    serial = run_distributed(_train, 1, module, 1, seed)[0]
    for losses in run_distributed(_train, 2, module, 2, seed):
        rel = max(abs(a - b) / abs(b) for a, b in zip(losses, serial))
        assert rel < 1e-5, (losses, serial)

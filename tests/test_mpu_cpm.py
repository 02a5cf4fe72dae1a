"""CPM-1-Pretrain's mpu namespace (``megatron.mpu.cpm``) and tds as CPM's TDS behaved.

- the namespace has CPM-1's 36 public names and v1.1.5's linear signatures;
- ``initialize_model_parallel(mp, topology=...)`` builds the topology's groups (tensor =
  CPM's "model", pipe, data, IO) and refuses a topology that orders ranks otherwise;
- a CPM-1-style GPT-2 and T5 (tests/compat_models/cpm1_models.py), serial and pipelined,
  trained as CPM-1 trains them (``deepspeed.initialize`` with CPM's ds_config settings:
  ``gradient_clipping`` 1.0; the PipelineModule built before any
  ``deepspeed.init_distributed``; T5's float masks declared ``'int'``), give the per-step
  losses of the serial model from the same weights within 1e-5 at tp=2, pp=2 and
  tp=2 x pp=2, with and without ``--checkpoint-activations``. The gradient norm exceeds the
  clip on every step, so a wrong norm at pp > 1 would show.
"""
import inspect

import pytest
import torch

from harness import run_distributed
from megatron.mpu import cpm

CPM1_NAMES = """vocab_parallel_cross_entropy broadcast_data clip_grad_norm is_unitialized
destroy_model_parallel get_data_parallel_group get_data_parallel_rank
get_data_parallel_world_size get_model_parallel_group get_model_parallel_rank
set_model_parallel_rank get_model_parallel_src_rank get_model_parallel_world_size
set_model_parallel_world_size get_topology get_pipe_parallel_group get_pipe_parallel_rank
get_pipe_parallel_world_size get_io_parallel_group initialize_model_parallel
model_parallel_is_initialized LayerNorm ColumnParallelLinear RowParallelLinear
VocabParallelEmbedding copy_to_model_parallel_region gather_from_model_parallel_region
reduce_from_model_parallel_region scatter_to_model_parallel_region checkpoint
get_cuda_rng_tracker init_checkpointed_activations_memory_buffer
model_parallel_cuda_manual_seed reset_checkpointed_activations_memory_buffer divide
split_tensor_along_last_dim""".split()

MICRO, GAS, STEPS, SEQ, DEC_SEQ = 2, 4, 3, 8, 6


def test_every_cpm1_name_and_linear_signature():
    assert len(CPM1_NAMES) == 36
    assert [n for n in CPM1_NAMES if not hasattr(cpm, n)] == []
    column = list(inspect.signature(cpm.ColumnParallelLinear).parameters)
    row = list(inspect.signature(cpm.RowParallelLinear).parameters)
    assert column == ["input_size", "output_size", "bias", "gather_output", "init_method",
                      "stride", "keep_master_weight_for_test", "skip_bias_add"]
    assert row == ["input_size", "output_size", "bias", "input_is_parallel", "init_method",
                   "stride", "keep_master_weight_for_test", "skip_bias_add"]
    assert cpm.LayerNorm is torch.nn.LayerNorm


def _groups():
    import torch.distributed as dist
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)
    cpm.initialize_model_parallel(2, topology=topo)
    rank = dist.get_rank()
    io = cpm.get_io_parallel_group()
    seen = {
        "topology": cpm.get_topology() is topo,
        "tp": (cpm.get_model_parallel_rank(), cpm.get_model_parallel_world_size(),
               cpm.get_model_parallel_src_rank()),
        "pp": (cpm.get_pipe_parallel_rank(), cpm.get_pipe_parallel_world_size()),
        "dp": (cpm.get_data_parallel_rank(), cpm.get_data_parallel_world_size()),
        "io": None if io is None else dist.get_world_size(io),
        "coord": topo.get_coord(rank)._asdict(),
    }
    cpm.destroy_model_parallel()
    seen["after_destroy"] = (cpm.is_unitialized(), cpm.get_topology())
    try:  # a topology with tensor slowest: mpu's groups would not be the topology's
        from deepspeed.runtime.pipe.topology import ProcessTopology

        cpm.initialize_model_parallel(2, topology=ProcessTopology(["model", "pipe", "data"],
                                                                  [2, 2, 2]))
    except ValueError as exc:
        seen["bad_topology"] = str(exc)
    return seen


def test_topology_groups_and_io_group():
    for rank, seen in enumerate(run_distributed(_groups, 8, timeout=120)):
        coord = seen["coord"]
        assert seen["topology"]
        assert seen["tp"] == (coord["model"], 2, rank - coord["model"])
        assert seen["pp"] == (coord["pipe"], 2) and seen["dp"] == (coord["data"], 2)
        # IO group: tensor rank 0 of the first and last stage, every data-parallel replica
        assert seen["io"] == (4 if coord["model"] == 0 else None)
        assert seen["after_destroy"] == (True, None)
        assert "rank 1 at" in seen["bad_topology"] and "PipeModelDataParallelTopology" in \
            seen["bad_topology"]


# ---------------------------------------------------------------- training equivalence
def _batches(model, seed):
    """Raw micro-batches, in the global order every layout consumes."""
    g = torch.Generator().manual_seed(seed)
    vocab = 64
    out = []
    for _ in range(STEPS * GAS):
        if model == "gpt2":
            out.append({"text": torch.randint(0, vocab, (MICRO, SEQ + 1), generator=g)})
        else:
            out.append({k: torch.randint(0, vocab, (MICRO, n), generator=g)
                        for k, n in (("contexts", SEQ), ("targets", DEC_SEQ),
                                     ("labels", DEC_SEQ))})
    return out


def gpt2_batch(raw):
    """CPM-1's get_batch_pipe for GPT-2: ``((tokens, pos, bool mask), (labels, loss mask))``."""
    tokens, labels = raw["text"][:, :-1], raw["text"][:, 1:]
    b, s = tokens.shape
    mask = torch.tril(torch.ones(1, 1, s, s)) < 0.5
    return (tokens, torch.arange(s).expand(b, s), mask), (labels, torch.ones(b, s))


def t5_batch(raw):
    """CPM-1's get_batch_pipe for T5: float masks (1 = visible)."""
    enc, dec = raw["contexts"], raw["targets"]
    b, se, sd = enc.shape[0], enc.shape[1], dec.shape[1]
    inputs = (enc, torch.arange(se).expand(b, se), torch.ones(b, 1, se, se),
              dec, torch.arange(sd).expand(b, sd), torch.tril(torch.ones(b, 1, sd, sd)),
              torch.ones(b, 1, sd, se))
    return inputs, (raw["labels"], torch.ones(b, sd))


def _loss(model, raw, batch_fn):
    inputs, (labels, loss_mask) = batch_fn(raw)
    losses = model(*inputs, labels)
    return torch.sum(losses.view(-1) * loss_mask.view(-1)) / loss_mask.sum()


def _serial(name, cfg, raws, batch_fn):
    """Plain PyTorch: mean loss over GAS micro-batches, torch's clip at 1.0, SGD."""
    from compat_models import cpm1_models

    model = (cpm1_models.GPT2Model if name == "gpt2" else cpm1_models.T5Model)(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, norms = [], []
    for step in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for raw in raws[step * GAS:(step + 1) * GAS]:
            loss = _loss(model, raw, batch_fn)
            (loss / GAS).backward()
            total += float(loss) / GAS
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        opt.step()
        losses.append(total)
    return losses, norms


def _ds_config(dp):
    """CPM-1's ds_config_{gpt2,t5}.json settings, fp32, this test's batch sizes."""
    return {"train_batch_size": MICRO * GAS, "train_micro_batch_size_per_gpu": MICRO,
            "steps_per_print": 10**9, "gradient_clipping": 1.0,
            "fp16": {"enabled": False, "loss_scale": 0, "loss_scale_window": 1000,
                     "hysteresis": 2, "initial_scale_power": 16},
            "zero_allow_untested_optimizer": True, "wall_clock_breakdown": False}


def _parallel(name, cfg, raws, batch_fn, tp, pp):
    """CPM-1's setup: mpu (with a topology when pp > 0), the model, deepspeed.initialize,
    then the setters CPM-1's training.py calls."""
    import torch.distributed as dist
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    import tds as deepspeed
    from compat_models import cpm1_models

    world = dist.get_world_size()
    dp = world // (tp * max(pp, 1))
    topo = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp) if pp else None
    cpm.initialize_model_parallel(tp, topology=topo)
    dp_rank = cpm.get_data_parallel_rank()
    mine = [raw for i, raw in enumerate(raws) if i % dp == dp_rank]
    config = _ds_config(dp)
    if not pp:  # CPM-1's pipe_parallel_size == 0: the model with mpu=
        model = (cpm1_models.GPT2Model if name == "gpt2" else cpm1_models.T5Model)(cfg)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config, mpu=cpm,
                                          dist_init_required=False)
        losses = []
        for step in range(STEPS):
            total = torch.zeros(())
            for raw in mine[step * GAS // dp:(step + 1) * GAS // dp]:
                loss = _loss(engine, raw, batch_fn)
                engine.backward(loss)
                engine.step()
                total += loss.detach() / (GAS // dp)
            dist.all_reduce(total, group=cpm.get_data_parallel_group())
            losses.append(float(total) / dp)
    else:
        build = cpm1_models.gpt2_model_pipe if name == "gpt2" else cpm1_models.t5_model_pipe
        model = build(cfg)  # before deepspeed.init_distributed, as CPM-1 does
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config,
                                          dist_init_required=False)
        engine.set_batch_fn(batch_fn)
        engine.set_input_grad(model._input_grad)
        engine.set_input_type(model._input_type)
        engine.set_input_pipe_partitioned(model._input_pipe_partitioned)
        it = iter(mine)
        losses = [float(engine.train_batch(it)) for _ in range(STEPS)]
    cpm.destroy_model_parallel()
    return losses


def _all_layouts(name, seed):
    """Serial on every rank (tp=1 groups), then tp=2, pp=2, tp=2 x pp=2, each with and
    without activation checkpointing (4 ranks: dp fills the rest)."""
    from compat_models import cpm1_models

    raws = _batches(name, seed)
    batch_fn = gpt2_batch if name == "gpt2" else t5_batch
    cpm.initialize_model_parallel(1)
    serial = _serial(name, cpm1_models.config(seed=seed), raws, batch_fn)
    cpm.destroy_model_parallel()
    runs = {}
    for ckpt in (False, True):
        cfg = cpm1_models.config(seed=seed, checkpoint_activations=ckpt)
        for tp, pp in ((2, 0), (1, 2), (2, 2)):
            runs[(tp, pp, ckpt)] = _parallel(name, cfg, raws, batch_fn, tp, pp)
    return serial, runs


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "t5"])
def test_cpm1_models_match_serial_at_tp2_pp2_and_3d(name, seed):
    results = run_distributed(_all_layouts, 4, name, seed, timeout=300)
    (serial, norms), _ = results[0]
    assert min(norms) > 1.0, norms  # clipping acts on every step
    for rank, (_, runs) in enumerate(results):
        for (tp, pp, ckpt), losses in runs.items():
            diff = max(abs(a - b) for a, b in zip(losses, serial))
            assert diff < 1e-5, (rank, tp, pp, ckpt, losses, serial)

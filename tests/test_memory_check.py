"""The start-up memory check (refusal with an emulated free-memory figure, the printed
stages of a tiny run) and the layout planner (tools/plan_layout.py)."""
import json
import random
import re

import pytest

from megatron.common.errors import WillNotFitError
from megatron.memory import GIB, MemorySpec, predict
from megatron.memory.check import check_memory
from megatron.memory.planner import Hardware, plan


def _spec(**changes):
    base = dict(family="gpt2", num_layers=24, hidden=1024, heads=16, kv_channels=64,
                ffn=4096, vocab=50304, seq=1024, micro_batch=16, num_micro_batches=8,
                tp=1, pp=4, dp=2, dtype="bf16", backend="engine")
    base.update(changes)
    return MemorySpec(**base)


def test_refusal_names_the_stage_the_figure_the_free_memory_and_two_fits():
    spec = _spec(micro_batch=random.choice([8, 16]))
    stages = predict(spec)
    worst = max(stages, key=lambda s: s.peak)
    free = int(worst.peak * random.uniform(0.3, 0.9))  # an emulated device
    with pytest.raises(WillNotFitError) as info:
        check_memory(spec, free)
    message = str(info.value)
    assert f"pipeline stage {worst.stage} " in message
    assert f"{worst.peak / GIB:.2f} GiB" in message and f"{free / GIB:.2f} GiB free" in message
    fixes = message.split("changes that would fit: ")[1].split(" (--no-memory-check")[0]
    assert len(fixes.split("; ")) == 2, message
    # each suggestion is a layout the planner predicts to fit in the free memory
    fitting = plan(spec, Hardware(gpus=spec.world, gpu_memory=free),
                   spec.micro_batch * spec.num_micro_batches * spec.dp, 1.0)
    assert fitting and all(p.peak <= free for p in fitting)
    lines = check_memory(spec, free, enforce=False)
    assert lines[-1].startswith("WARNING: pipeline stage")
    assert len(check_memory(spec, worst.peak + 1)) == spec.pp  # fits: no refusal


def test_planner_ranks_layouts_that_fit(capsys):
    import sys

    sys.path.insert(0, "tools")
    import plan_layout

    gpus = random.choice([8, 16])
    assert plan_layout.main(["--config", "configs/gpt2/gpt2_345m.yaml", "--gpus", str(gpus),
                             "--gpu-memory", "16GiB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    layouts = out["layouts"]
    assert layouts, out
    times = [x["step_time_s"] for x in layouts]
    assert times == sorted(times)
    for x in layouts:
        assert x["tp"] * x["pp"] * x["dp"] == gpus
        assert max(x["stage_peak_bytes"]) == x["peak_bytes"] <= 16 * GIB
        assert x["micro_batch"] * x["num_micro_batches"] * x["dp"] == out["global_batch"]


@pytest.mark.parametrize("flags, said", [
    (["--gpu-memory", "80 parsecs"], "--gpu-memory '80 parsecs'"),
    (["--nodes", "3"], "--nodes 3 must be >= 1 and divide --gpus 8"),
    (["--efficiency", "1.5"], "--efficiency is a share of the peak"),
])
def test_planner_flags_are_checked(flags, said):
    import sys

    from megatron.common.errors import ConfigError

    sys.path.insert(0, "tools")
    import plan_layout

    with pytest.raises(ConfigError, match=re.escape(said)):
        plan_layout.main(["--config", "configs/gpt2/gpt2_345m.yaml", "--gpus", "8", *flags])


def test_pretrain_prints_the_predicted_peak_per_stage(gpt2_data):
    from gpt2_runs import gpt2_argv
    from harness import run_distributed
    from memory_runs import pretrain_stdout

    argv = gpt2_argv(gpt2_data, "--pipe-parallel-size", "2", "--batch-size", "1", "--gas", "1",
                     "--train-iters", "1", "--eval-iters", "0")
    first, second = run_distributed(pretrain_stdout, 2, argv, timeout=240)
    for stage in (0, 1):  # rank 0 prints one line per stage, the other rank none
        assert first.count(f"stage {stage}/2: predicted peak") == 1, first
    assert "predicted peak" not in second


def test_startup_check_prints_or_steps_aside(capsys):
    """On the CPU the start-up hook prints one line per stage; a run the model does not
    describe (ZeRO-3) gets a note and trains; --zero-stage 1 without --deepspeed is the
    distributed optimizer."""
    from megatron.config import build_run_config
    from megatron.families import get_family
    from megatron.memory import predict, spec_from_run_config
    from megatron.memory.check import startup_memory_check

    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "32", "--batch-size", "2", "--lr", "1e-3", "--train-iters", "1"]

    def cfg(*extra, world=4):
        made, _ = build_run_config([*base, *extra], get_family("gpt2"), world_size=world,
                                   rank=0, check_files=False)
        return made.replace(padded_vocab_size=512, true_vocab_size=500)

    startup_memory_check(cfg("--pipe-parallel-size", "2"))
    out = capsys.readouterr().out
    assert out.count("predicted peak") == 2 and "stage 1/2" in out, out
    # context parallelism: predicted and checked as at cp 1, the figures the model's
    startup_memory_check(cp2 := cfg("--context-parallel-size", "2", "--pipe-parallel-size", "2",
                                    "--attention-dropout", "0", world=8))
    out = capsys.readouterr().out
    assert out.count("predicted peak") == 2 and "no prediction" not in out, out
    for stage in predict(spec_from_run_config(cp2, device="cpu")):  # a small model: MiB
        assert f"stage {stage.stage}/2: predicted peak {stage.peak / 2**20:.2f} MiB" in out
    # MoE layers: predicted (experts per rank at ep 2 of dp 4), the figures the model's
    startup_memory_check(moe := cfg("--num-experts", "8", "--expert-model-parallel-size", "2"))
    out = capsys.readouterr().out
    assert out.count("predicted peak") == 1 and "no prediction" not in out, out
    moe_spec = spec_from_run_config(moe, device="cpu")
    assert (moe_spec.num_experts, moe_spec.ep) == (8, 2)
    stage = predict(moe_spec)[0]
    assert f"stage 0/1: predicted peak {stage.peak / 2**20:.2f} MiB" in out, out
    dense = predict(spec_from_run_config(cfg(), device="cpu"))[0]
    # each MoE layer: 4 of the 8 experts (2 x 64 x 256 each) and the 8 x 64 router, less the
    # dense MLP (fc1 and fc2 with their biases)
    per_layer = 4 * 2 * 64 * 256 + 8 * 64 - (2 * 64 * 256 + 256 + 64)
    assert stage.states.params - dense.states.params == 2 * per_layer
    startup_memory_check(cfg("--deepspeed", "--zero-stage", "3"))
    assert "no prediction" in capsys.readouterr().out
    # without --deepspeed, ZeRO stage 1 is the project's distributed optimizer: Adam's
    # moments of 1 / dp of the parameters on each of the 4 ranks
    ddp = spec_from_run_config(cfg("--zero-stage", "1"), device="cpu")
    assert ddp.backend == "ddp" and ddp.zero_stage == 1
    states = predict(ddp)[0].states
    assert states.optimizer_bytes == 8 * -(-states.params // 4)


def test_grad_accum_dtype_is_read_from_the_deepspeed_config(tmp_path):
    """DeepSpeed's ``data_types.grad_accum_dtype`` (any of its spellings) reaches the model of
    DeepSpeed's engine (``--deepspeed``): with bf16 weights and ZeRO-1, fp32 accumulation is
    DeepSpeed's BF16_Optimizer, whose flat gradient buffer holds 4 bytes a parameter; a
    spelling DeepSpeed does not take, or the mix DeepSpeed refuses without ZeRO, is a
    ConfigError naming it (the start-up check prints it). A pipeline run (the project's own
    step) accumulates in its fp32 gradient buffer whatever the JSON says."""
    from megatron.config import build_run_config
    from megatron.common.errors import ConfigError
    from megatron.families import get_family
    from megatron.memory import predict, spec_from_run_config

    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "32", "--batch-size", "2", "--lr", "1e-3", "--train-iters", "1",
            "--bf16"]

    def spec(config, *extra):
        path = tmp_path / "ds.json"
        path.write_text(json.dumps(config))
        made, _ = build_run_config([*base, "--deepspeed_config", str(path), *extra],
                                   get_family("gpt2"), world_size=2, rank=0, check_files=False)
        return spec_from_run_config(made.replace(padded_vocab_size=512, true_vocab_size=500),
                                    device="cpu")

    zero1 = {"zero_optimization": {"stage": 1}}
    for spelling in ("fp32", "float32", "torch.float32", "float"):
        fp32 = spec({**zero1, "data_types": {"grad_accum_dtype": spelling}}, "--deepspeed")
        assert fp32.grad_accum == "fp32" and fp32.accum_bytes == 4
        for stage in predict(fp32):
            n, partition = stage.states.params, -(-stage.states.params // 2)
            assert stage.states.optimizer_bytes == 4 * n + 12 * partition
            # the step's reduction flattens the fp32 buffer and sends a bf16 copy
            assert stage.step >= 6 * n
    default = spec(zero1, "--deepspeed")  # bf16 accumulation: DeepSpeed's ZeRO optimizer
    assert default.grad_accum == "" and all(
        s.states.optimizer_bytes == 12 * -(-s.states.params // 2) for s in predict(default))
    with pytest.raises(ConfigError, match="int8"):
        spec({**zero1, "data_types": {"grad_accum_dtype": "int8"}}, "--deepspeed")
    with pytest.raises(ConfigError, match="needs ZeRO"):
        spec({"data_types": {"grad_accum_dtype": "fp32"}}, "--deepspeed")
    # a pipeline: the project's step, the distributed optimizer for the JSON's stage 1, its
    # fp32 gradient buffer whatever data_types says
    pipeline = spec({**zero1, "data_types": {"grad_accum_dtype": "bfloat16"}},
                    "--pipe-parallel-size", "2")
    assert pipeline.backend == "ddp" and pipeline.grad_accum == "" and all(
        s.states.grad_bytes == 4 * s.states.params and
        s.states.optimizer_bytes == 8 * s.states.params for s in predict(pipeline))  # dp 1

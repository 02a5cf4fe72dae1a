"""The MoE flags (Megatron-LM's names), YAML, the run scripts' variables, the model they
build, and the refusals: before any group is built, on every rank, one message each."""
import dataclasses
import types

import pytest

from gpt2_runs import gpt2_argv
from harness import run_distributed
from megatron.config import build_run_config
from megatron.common.errors import ConfigError
from megatron.families import get_family

GPT2 = get_family("gpt2")
BASE = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--batch-size", "2", "--train-iters", "2", "--lr", "1e-3"]


def _cfg(*flags, world=4, family=GPT2):
    return build_run_config(BASE + list(flags), family=family, world_size=world, rank=0,
                            check_files=False)[0]


def test_flags_build_the_moe_layers():
    cfg = _cfg("--num-experts", "8", "--expert-model-parallel-size", "1", "--moe-router-topk",
               "1", "--moe-layer-freq", "([0]+[1])*2", "--moe-ffn-hidden-size", "48",
               "--moe-router-score-function", "sigmoid", "--moe-grouped-gemm",
               "--moe-expert-capacity-factor", "1.25",
               "--moe-token-dispatcher-type", "allgather",
               "--moe-shared-expert-intermediate-size", "16", "--moe-z-loss-coeff", "1e-3")
    model_config = GPT2.model_config(cfg)
    assert model_config.moe_layers == (False, True, False, True)
    m = model_config.moe
    assert (m.num_experts, m.topk, m.ffn_hidden_size, m.score_function, m.grouped_gemm,
            m.capacity_factor, m.dispatcher, m.shared_expert_intermediate_size,
            m.z_loss_coeff) == (8, 1, 48, "sigmoid", True, 1.25, "allgather", 16, 1e-3)
    assert cfg.parallel.ep == 1 and cfg.moe.enabled
    dense = GPT2.model_config(_cfg())
    assert dense.moe is None and not _cfg().moe.enabled


def test_flops_count_the_active_experts():
    dense, moe = (GPT2.flops_per_step(_cfg(*f).replace(padded_vocab_size=512)) for f in
                  ([], ["--num-experts", "8", "--moe-router-topk", "2"]))
    h, f, s, b, layers = 32, 128, 16, 2 * 4, 4  # ffn 4h; global batch 2 x dp 4
    extra_per_token = layers * (h * 8 + (2 - 1) * 2 * h * f)  # router + a second expert
    assert moe - dense == pytest.approx(6.0 * b * s * extra_per_token)


def test_yaml_and_run_script_variables(tmp_path):
    from megatron.launch.check import script_variables

    yaml_file = tmp_path / "moe.yaml"
    yaml_file.write_text("num_experts: 4\nmoe_router_topk: 1\nparallel_config:\n"
                         "  expert_parallel: 2\n")
    cfg = _cfg("--config", str(yaml_file))  # the YAML's parallel_config reaches the run
    assert (cfg.moe.num_experts, cfg.moe.moe_router_topk, cfg.parallel.ep) == (4, 1, 2)
    names = script_variables("--expert-model-parallel-size (3) does not divide ...")
    assert names == ["ep_size"]
    assert script_variables("--num-experts (6) is not divisible") == ["NUM_EXPERTS"]
    for script in ("examples/run_gpt2.sh", "examples/run_t5.sh"):
        text = open(script).read()
        assert "--expert-model-parallel-size $ep_size" in text
        assert "--num-experts $NUM_EXPERTS" in text


REFUSALS = [  # (flags, the message's words)
    (["--num-experts", "6", "--expert-model-parallel-size", "4"],
     "--num-experts (6) is not divisible by --expert-model-parallel-size (4)"),
    (["--num-experts", "8", "--expert-model-parallel-size", "8"],
     "--expert-model-parallel-size (8) does not divide the data-parallel x context-parallel"),
    (["--num-experts", "4", "--moe-router-topk", "5"],
     "--moe-router-topk (5) must be between 1 and --num-experts (4)"),
    (["--num-experts", "4", "--moe-expert-capacity-factor", "0"],
     "--moe-expert-capacity-factor must be > 0"),
    (["--num-experts", "4", "--moe-expert-capacity-factor", "-1"],
     "--moe-expert-capacity-factor must be > 0"),
    (["--expert-model-parallel-size", "2"], "--expert-model-parallel-size 2 needs --num-experts"),
    (["--num-experts", "4", "--moe-layer-freq", "[1,0,1]"], "has 3 entries but the stack has 4"),
    (["--num-experts", "4", "--moe-layer-freq", "__import__('os')"], "--moe-layer-freq"),
    (["--num-experts", "4", "--model-parallel-size", "2", "--sequence-parallel"],
     "--sequence-parallel with --num-experts is not supported yet"),
    (["--num-experts", "4", "--deepspeed"], "--deepspeed with --num-experts"),
]


@pytest.mark.parametrize("flags, words", REFUSALS)
def test_bad_moe_flags_are_refused(flags, words):
    with pytest.raises(ConfigError) as info:
        _cfg(*flags)
    assert words in str(info.value)
    assert str(info.value).count(words) == 1  # one message each


def test_family_without_an_moe_block_is_refused():
    """A family whose model config carries no ``moe`` (or that declares no "moe")."""
    no_moe = dataclasses.replace(
        GPT2, name="mine", supports=None,
        model_config=lambda cfg, dropout=True: types.SimpleNamespace(moe=None))
    with pytest.raises(ConfigError, match="--num-experts is not supported by the 'mine'"):
        _cfg("--num-experts", "4", family=no_moe)
    declared = dataclasses.replace(GPT2, name="other", supports=frozenset({"pipeline"}))
    with pytest.raises(ConfigError, match="--num-experts is not supported by the 'other'"):
        _cfg("--num-experts", "4", family=declared)


def _refused_on_every_rank(argvs):
    import pretrain_gpt2
    from megatron import mpu
    from megatron.common.errors import MegatronError

    out = []
    for argv in argvs:
        try:
            pretrain_gpt2.main(argv)
            out.append(None)
        except MegatronError as exc:
            out.append((str(exc), mpu.model_parallel_is_initialized()))
    return out


def test_refused_on_every_rank_before_any_group(gpt2_data):
    argvs = [gpt2_argv(gpt2_data, "--batch-size", "2", "--train-iters", "2", *flags)
             for flags, _ in REFUSALS[:3]]
    for per_rank in run_distributed(_refused_on_every_rank, 4, argvs, timeout=240):
        for result, (_, words) in zip(per_rank, REFUSALS[:3]):
            assert result is not None and words in result[0] and not result[1], result


def test_memory_model_describes_moe_and_says_where_it_does_not():
    """The spec carries the run's MoE settings (experts, top-k, ep, the layer pattern), and a
    layout the MoE description does not cover (here sequence parallelism, which the run
    refuses with MoE) is said, not predicted."""
    from megatron.memory.spec import spec_from_run_config

    cfg = _cfg("--num-experts", "4").replace(padded_vocab_size=128)
    spec = spec_from_run_config(cfg, device="cuda")
    assert (spec.num_experts, spec.moe_topk, spec.ep) == (4, cfg.moe.moe_router_topk, 1)
    assert len(spec.moe_layers) == cfg.model.num_layers and all(spec.moe_layers)
    dense = spec_from_run_config(_cfg().replace(padded_vocab_size=128), device="cuda")
    assert dense.num_experts in (0, None)
    from dataclasses import replace

    from megatron.memory.moe import moe_problems
    assert moe_problems(spec) == []
    assert any("sequence parallelism" in p
               for p in moe_problems(replace(spec, sequence_parallel=True)))

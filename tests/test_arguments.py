"""Flags, aliases, YAML configs and the validation pass."""
import glob
import os
import sys

import pytest
import torch

from megatron.config import parse_args
from megatron.common.errors import ConfigError
from precision import WITH_FP16, WITHOUT_FP16

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "8",
        "--seq-length", "32", "--batch-size", "2", "--train-iters", "10", "--lr", "1e-3",
        "--tokenizer-type", "GPT2BPETokenizer"]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _parse(extra=(), world_size=8, **kw):
    return parse_args(BASE + list(extra), world_size=world_size, rank=0, check_files=False, **kw)


def test_cpm_flags_and_derived_values():
    args = _parse(["--model-parallel-size", "2", "--pipe-parallel-size", "2", "--gas", "3",
                   "--warmup", "0.2", "--lr-decay-iters", "50"])
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (2, 2)
    assert args.data_parallel_size == 2
    assert args.global_batch_size == 2 * 3 * 2
    assert args.kv_channels == 8 and args.ffn_hidden_size == 256
    assert args.max_position_embeddings == 32
    assert args.lr_warmup_iters == 10  # 0.2 x 50
    assert args.compute_dtype == torch.float32 and args.params_dtype == torch.float32
    assert args.distributed_backend in ("gloo", "nccl")


def test_megatron_v2_aliases_mean_the_same():
    cpm = _parse(["--model-parallel-size", "4", "--batch-size", "3", "--gas", "2",
                  "--kv-hidden-size", "16", "--ff-hidden-size", "96"])
    v2 = _parse(["--tensor-model-parallel-size", "4", "--micro-batch-size", "3",
                 "--global-batch-size", "12", "--kv-channels", "16", "--ffn-hidden-size", "96"])
    for key in ("tensor_model_parallel_size", "micro_batch_size", "gas", "global_batch_size",
                "kv_channels", "ffn_hidden_size"):
        assert getattr(cpm, key) == getattr(v2, key), key


def test_pipe_parallel_size_zero_means_no_pipeline():
    assert _parse(["--pipe-parallel-size", "0"]).pipeline_model_parallel_size == 1


def test_warmup_as_iterations():
    assert _parse(["--warmup", "7"]).lr_warmup_iters == 7


@pytest.mark.precision
def test_yaml_config_with_parallel_block_and_cli_override(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("hidden-size: 128\nnum_attention_heads: 16\nfp16: true\n"
                   "no_hidden_bias: true\nlr: 2.0e-4\n"
                   "parallel_config:\n  model_parallel: 2\n  pipeline_stage: 2\n"
                   "  micro_batch_num: 4\n  recompute: true\n  data_parallel: 2\n")
    base = [a for a in BASE if a not in ("--hidden-size", "64",
                                                        "--num-attention-heads", "8")]
    argv = base + ["--config", str(cfg), "--lr", "5e-4"]
    args = parse_args(argv, world_size=8, rank=0, check_files=False, accelerator=WITH_FP16)
    assert args.hidden_size == 128 and args.num_attention_heads == 16  # file beats defaults
    assert args.lr == 5e-4  # ... and the command line beats the file
    assert args.fp16 and args.compute_dtype == torch.float16 and args.hidden_bias is False
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (2, 2)
    assert args.gas == 4 and args.checkpoint_activations
    # on a device whose DeepSpeed has no fp16: pp 2 trains through the project's own step
    # (torch's autocast), so it is accepted; DeepSpeed's engine at pp 1 is refused
    assert parse_args(argv, world_size=8, rank=0, check_files=False,
                      accelerator=WITHOUT_FP16).fp16
    engine = argv + ["--pipe-parallel-size", "1", "--deepspeed", "--zero-stage", "1"]
    with pytest.raises(ConfigError, match="--fp16 is not supported by DeepSpeed on this device"):
        parse_args(engine, world_size=8, rank=0, check_files=False, accelerator=WITHOUT_FP16)


@pytest.mark.parametrize("text,message", [
    ("hiden_size: 3\n", r"unknown key 'hiden_size' \(did you mean 'hidden_size'\?\)"),
    ("train-itres: 3\n", r"unknown key 'train-itres' \(did you mean 'train_iters'\?\)"),
    ("zzzzz: 3\n", r"unknown key 'zzzzz'; keys are flag names"),
    ("hidden_size: big\n", "'hidden_size' must be of type int"),
    ("fp16: 1\n", "'fp16' must be true or false"),
    ("- a\n- b\n", "must be a mapping"),
    ("parallel_config:\n  stages: 2\n", "unknown parallel_config key 'stages'"),
    ("parallel_config:\n  model_paralel: 2\n", "did you mean 'model_parallel'"),
    ("parallel_config:\n  data_parallel: 3\n", "parallel_config.data_parallel is 3"),
    ("lr_decay_style: zigzag\n", "'lr_decay_style' must be one of"),
])
def test_bad_config_files_say_what_is_wrong(tmp_path, text, message):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    with pytest.raises(ConfigError, match=message):
        _parse(["--config", str(cfg)])


@pytest.mark.parametrize("extra,world,message", [
    (["--model-parallel-size", "3"], 6, r"--num-attention-heads \(8\) is not divisible by the "
                                        r"tensor-model-parallel size \(3\)"),
    (["--max-position-embeddings", "16"], 8, r"--seq-length \(32\) is longer than "
                                             r"--max-position-embeddings \(16\)"),
    (["--model-parallel-size", "2", "--pipe-parallel-size", "2"], 6,
     r"world size \(6\) is not divisible"),
    (["--fp16", "--bf16"], 8, "mutually exclusive"),
    (["--global-batch-size", "7"], 2, r"--global-batch-size \(7\) is not divisible"),
    (["--min-lr", "1"], 8, r"--min-lr \(1.0\) is above --lr"),
    (["--save-interval", "0"], 8, "--save-interval must be >= 1"),
    (["--split", "90,10"], 8, "must be three non-negative numbers"),
])
def test_validation_errors_name_the_numbers(extra, world, message):
    with pytest.raises(ConfigError, match=message):
        _parse(extra, world_size=world)


def test_all_problems_reported_at_once():
    with pytest.raises(ConfigError) as info:
        _parse(["--model-parallel-size", "3", "--max-position-embeddings", "16"], world_size=3)
    assert "--num-attention-heads" in str(info.value) and "--seq-length" in str(info.value)


def test_missing_required_flags_are_listed():
    with pytest.raises(ConfigError, match="--num-layers.*--lr|--lr.*--num-layers"):
        parse_args(["--hidden-size", "8"], world_size=1, rank=0, check_files=False)


def test_missing_files_are_reported(tmp_path):
    with pytest.raises(ConfigError) as info:
        parse_args(BASE + ["--data-path", str(tmp_path / "nope"), "--vocab-file",
                           str(tmp_path / "v.json"), "--merge-file", str(tmp_path / "m.txt")],
                   world_size=1, rank=0)
    text = str(info.value)
    assert "has no .bin or .idx file" in text and "v.json does not exist" in text
    assert "m.txt does not exist" in text


def test_no_data_path_is_named_with_the_files_checked():
    """The file check runs with the flag checks: no --data-path is a listed problem, not a
    crash of the check that reads the prefixes."""
    with pytest.raises(ConfigError) as info:
        parse_args(BASE, world_size=1, rank=0)
    assert "--data-path is required" in str(info.value)


@pytest.mark.precision
@pytest.mark.parametrize("device", [WITH_FP16, WITHOUT_FP16], ids=["fp16", "no_fp16"])
@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(REPO, "configs", "*", "*.yaml"))),
                         ids=os.path.basename)
def test_shipped_configs_parse(path, device):
    import yaml

    from megatron.config.preflight import uses_deepspeed

    from megatron.families import load_family

    sys.path.insert(0, os.path.join(REPO, "tools"))
    from plan_layout import default_family  # configs/<folder>/ names the family

    family = load_family(default_family(path))
    argv = ["--config", path, "--train-iters", "10"]
    layout = yaml.safe_load(open(path)).get("parallel_config", {})  # e.g. 64 GPUs for 175B
    # the layout's own world: ep is carved out of dp x cp, so it needs ep data-parallel ranks
    world = max(8, layout.get("model_parallel", 1) * layout.get("pipeline_stage", 1)
                * layout.get("expert_parallel", 1))
    if device is WITHOUT_FP16:
        full = parse_args(argv, world_size=world, rank=0, check_files=False,
                          accelerator=WITH_FP16, family=family)
        if full.fp16 and uses_deepspeed(full):  # a DeepSpeed engine would refuse it
            with pytest.raises(ConfigError, match="--fp16 is not supported.*use --bf16 or fp32"):
                parse_args(argv, world_size=world, rank=0, check_files=False,
                           accelerator=device, family=family)
            return
    args = parse_args(argv, world_size=world, rank=0, check_files=False, accelerator=device,
                      family=family)
    assert args.num_layers > 0 and args.global_batch_size > 0

"""--fp8-format / --fp8-recipe: flags, YAML, the run configuration and the model configs, the
refusals (one message each, before any compute, on every rank) and the log's MFU figures."""
import dataclasses
import types

import pytest
import torch

from megatron.config import parse_args
from megatron.common.errors import ConfigError

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--batch-size", "2", "--train-iters", "10", "--lr", "1e-3",
        "--tokenizer-type", "GPT2BPETokenizer"]


def _parse(*extra, world_size=2, family=None):
    return parse_args(BASE + list(extra), world_size=world_size, rank=0, check_files=False,
                      family=family)


def _problems(*extra, capability=None, world_size=2):
    """The FP8 problems of a flag set otherwise valid (validate_fp8 on its namespace)."""
    from megatron.config.fp8 import validate_fp8

    import argparse

    ns = argparse.Namespace(**_parse_without_fp8_check(*extra, world_size=world_size).to_dict())
    problems = []
    validate_fp8(ns, problems, capability=capability)
    return problems


def _parse_without_fp8_check(*extra, world_size=2):
    """Parse with the FP8 check skipped (its verdict is asked for separately)."""
    import megatron.config.fp8 as fp8

    original = fp8.validate_fp8
    fp8.validate_fp8 = lambda args, problems, capability=None: None
    try:
        return _parse(*extra, world_size=world_size)
    finally:
        fp8.validate_fp8 = original


def test_flags_yaml_and_the_run_and_model_configs(tmp_path):
    from megatron.families import get_family
    from megatron import mpu

    args = _parse("--bf16", "--fp8-format", "hybrid")
    assert (args.fp8_format, args.fp8_recipe) == ("hybrid", "tensorwise")
    yaml = tmp_path / "fp8.yaml"
    yaml.write_text("bf16: true\nfp8_format: e4m3\nfp8-recipe: rowwise\n")
    args = _parse("--config", str(yaml))
    assert (args.fp8_format, args.fp8_recipe) == ("e4m3", "rowwise")
    assert _parse("--config", str(yaml), "--fp8-recipe", "tensorwise").fp8_recipe == \
        "tensorwise"  # the command line wins
    cfg = args  # parse_args gives the frozen RunConfig
    assert cfg.precision.fp8 == mpu.Fp8Recipe("e4m3", "rowwise")
    assert _parse("--bf16").precision.fp8 is None
    gpt2 = get_family("gpt2")
    assert gpt2.model_config(cfg).fp8 == mpu.Fp8Recipe("e4m3", "rowwise")
    # inference and conversion build the model in fp32, without FP8
    assert gpt2.model_config(cfg, dropout=False).fp8 is None
    assert gpt2.config_from_saved(cfg.to_dict()).fp8 is None


def test_the_transformer_layers_linears_take_the_recipe_the_rest_does_not():
    """GPT-2's, T5's and the Llama example's attention and MLP linears run FP8; embeddings,
    norms and an untied output layer (T5 v1.1's, Llama's lm head) stay in the compute
    dtype."""
    from megatron import mpu
    from megatron.model.gpt2_model import GPT2Model
    from megatron.model.t5_layers import T5TransformerConfig
    from megatron.model.t5_model import T5Model
    from megatron.model.transformer import TransformerConfig

    recipe = mpu.Fp8Recipe("hybrid", "rowwise")
    sizes = dict(num_layers=1, hidden_size=32, num_attention_heads=4, kv_channels=8,
                 ffn_hidden_size=64, fp8=recipe)
    import llama_runs  # noqa: F401  (puts examples/llama on the path)
    from llama_model import LlamaConfig, LlamaModel

    mpu.set_tensor_model_parallel_world_size(1)
    mpu.set_tensor_model_parallel_rank(0)
    llama = {k: v for k, v in sizes.items() if k != "kv_channels"}
    try:
        models = [GPT2Model(TransformerConfig(**sizes), 64, 16),
                  T5Model(T5TransformerConfig(**sizes, vocab_size=64, tie_embeddings=False)),
                  LlamaModel(LlamaConfig(**llama, num_key_value_heads=2, vocab_size=64))]
    finally:
        mpu.set_tensor_model_parallel_world_size(None)
        mpu.set_tensor_model_parallel_rank(None)
    for model in models:
        linears = {name: m for name, m in model.named_modules()
                   if isinstance(m, (mpu.ColumnParallelLinear, mpu.RowParallelLinear))}
        fp8 = sorted(n for n, m in linears.items() if m.fp8 is not None)
        assert fp8 and all(m.fp8.recipe == recipe for n, m in linears.items() if n in fp8)
        head = {GPT2Model: [], T5Model: ["lm_head"], LlamaModel: ["3.lm_head"]}[type(model)]
        assert sorted(set(linears) - set(fp8)) == head, linears  # the untied output layer
        assert len(fp8) == {GPT2Model: 4, T5Model: 4 + 7, LlamaModel: 7}[type(model)]


def test_every_refusal_in_one_message():
    with pytest.raises(ConfigError) as caught:
        _parse("--fp16", "--fp8-format", "e4m3", "--hidden-size", "40",
               "--ffn-hidden-size", "168", "--seq-length", "30", "--model-parallel-size", "2")
    message = str(caught.value)
    for part in ("--fp16 with --fp8-format is not supported",
                 "the hidden size (--hidden-size 40 = 40) is not a multiple of 16",
                 "the attention projection per tensor-parallel rank (--num-attention-heads x "
                 "--kv-hidden-size / tp = 4 x 10 / 2 = 20)",
                 "change --num-attention-heads or --kv-hidden-size or the "
                 "tensor-model-parallel size",
                 "(--ff-hidden-size / tp = 168 / 2 = 84)",
                 "(--seq-length x --batch-size = 30 x 2 = 60)"):
        assert part in message, (part, message)
    with pytest.raises(ConfigError, match="--fp8-format needs --bf16"):
        _parse("--fp8-format", "hybrid")
    with pytest.raises(ConfigError, match="--fp8-recipe needs --fp8-format"):
        _parse("--bf16", "--fp8-recipe", "rowwise")
    cp = _problems("--bf16", "--fp8-format", "e4m3", "--context-parallel-size", "2",
                   "--seq-length", "16", "--batch-size", "1", "--attention-dropout", "0")
    assert any("--seq-length / --context-parallel-size 2 x --batch-size = 16 / 2 x 1" in p
               for p in cp), cp


@pytest.mark.parametrize("capability,refused", [((8, 0), True), ((8, 6), True),
                                                ((8, 9), False), ((9, 0), False),
                                                ((10, 0), False)])
def test_cuda_below_compute_capability_8_9_is_refused(capability, refused):
    problems = _problems("--bf16", "--fp8-format", "e4m3", capability=capability)
    said = [p for p in problems if "compute capability 8.9" in p]
    assert bool(said) == refused, problems
    if refused:
        assert f"this one is {capability[0]}.{capability[1]}" in said[0]


def test_without_torchao_the_message_says_how_to_install_it(monkeypatch):
    import megatron.mpu.fp8 as fp8

    monkeypatch.setattr(fp8, "torchao_available", lambda: False)
    problems = _problems("--bf16", "--fp8-format", "e4m3")
    assert problems == ["--fp8-format needs torchao (its float8 scaling): "
                        "pip install -e '.[fp8]' (or pip install torchao)"]


def test_a_family_whose_model_config_lacks_fp8_is_refused():
    """A model config without ``fp8`` means layers that never see the recipe: refused, not
    trained in bf16 under an FP8 flag."""
    from megatron.families import get_family

    bare = dataclasses.replace(get_family("gpt2"), name="mine", supports=None,
                               model_config=lambda cfg, dropout=True: types.SimpleNamespace())
    with pytest.raises(ConfigError, match=r"--fp8-format is not supported by the 'mine' model "
                                          r"family: its model config \(SimpleNamespace\) does "
                                          r"not carry fp8=True"):
        _parse("--bf16", "--fp8-format", "e4m3", family=bare)


def test_layers_refuse_sizes_and_types_they_cannot_run():
    from megatron import mpu

    mpu.set_tensor_model_parallel_world_size(1)
    mpu.set_tensor_model_parallel_rank(0)
    try:
        with pytest.raises(ConfigError, match=r"ColumnParallelLinear in FP8: this rank's GEMM "
                                              r"has output 40, not a multiple of 16"):
            mpu.ColumnParallelLinear(64, 40, fp8=mpu.Fp8Recipe())
        with pytest.raises(ConfigError, match=r"RowParallelLinear in FP8: this rank's GEMM has "
                                              r"input 24, output 8"):
            mpu.RowParallelLinear(24, 8, fp8=mpu.Fp8Recipe())
        with pytest.raises(TypeError, match="fp8 must be an mpu.Fp8Recipe or None, got str"):
            mpu.RowParallelLinear(32, 32, fp8="hybrid")
    finally:
        mpu.set_tensor_model_parallel_world_size(None)
        mpu.set_tensor_model_parallel_rank(None)


def _user_error(argv):
    from gpt2_runs import user_error

    return user_error(argv)


@pytest.mark.slow
@pytest.mark.exhaustive  # the flag checks are one pass every rank runs alike: shown once here
def test_a_bad_fp8_run_fails_on_every_rank_before_any_compute(gpt2_data):
    """On 2 ranks, both get the message from validation (nothing built, nothing run)."""
    from gpt2_runs import gpt2_argv
    from harness import run_distributed

    argv = gpt2_argv(gpt2_data, "--bf16", "--fp8-format", "hybrid", "--hidden-size", "48",
                     "--num-attention-heads", "4", "--model-parallel-size", "2",
                     "--batch-size", "1", "--train-iters", "2")
    messages = run_distributed(_user_error, 2, argv, timeout=300)
    assert messages[0] == messages[1] and messages[0] is not None
    assert "the attention projection per tensor-parallel rank (--num-attention-heads x " \
           "--kv-hidden-size / tp = 4 x 12 / 2 = 24) is not a multiple of 16" in messages[0]


def test_mfu_against_the_bf16_and_the_fp8_peaks(monkeypatch, capsys):
    """On an (emulated) H100 SXM an FP8 run's log line gives MFU against the bf16 dense peak
    (989 TFLOP/s) and against FP8's (1979); a bf16 run only the first; the start-up line says
    which peak is which."""
    from megatron.config import saved_run_config
    from megatron.observability import training_log

    props = types.SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=80 * 2**30)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    sizes = dict(global_batch_size=8, seq_length=1024, num_layers=24, hidden_size=1024,
                 padded_vocab_size=50304, world_size=1, train_iters=10, compute_dtype="bfloat16")
    state = types.SimpleNamespace(steps_in_interval=1, iteration=1, consumed_train_samples=8,
                                  lr=1e-4, skipped_in_interval=0, loss_scale=1.0,
                                  flops_per_step=4.0e15)
    line = {}
    for fp8 in (None, "hybrid"):
        cfg = saved_run_config(dict(sizes, fp8_format=fp8, fp8_recipe=fp8 and "tensorwise"))
        training_log.log_training_step(cfg, state, {"lm loss": 2.0}, 10.0, None)
        line[fp8] = capsys.readouterr().out
    tflops = 4.0e15 / 10.0 / 1e12  # 400 TFLOP/s per device
    assert f"MFU: {tflops / 989.0 * 100:.1f}%" in line["hybrid"]
    assert f"MFU of FP8 peak: {tflops / 1979.0 * 100:.1f}%" in line["hybrid"]
    assert "FP8" not in line[None]
    cfg = saved_run_config(dict(sizes, fp8_format="e4m3", fp8_recipe="rowwise"))
    assert training_log.peaks_line(cfg) == (
        "> MFU against the bf16 dense peak (989 TFLOP/s); 'MFU of FP8 peak' against the FP8 "
        "dense peak (1979 TFLOP/s)")
    assert training_log.peaks_line(saved_run_config(sizes)) is None


def test_the_run_scripts_fp8_variables(tmp_path):
    """FP8=... adds the FP8 flags (FP8_RECIPE's recipe) and makes PRECISION=auto bf16 (on a
    GPU node, where it is fp16 otherwise); a settings message about them names the
    variables."""
    import os

    from test_launch_check import REPO, _launch_common
    from megatron.launch.check import annotate

    body = 'megatron_precision_and_deepspeed_args fp16\necho "precision=[$precision_args]"'
    gpu = True
    out = _launch_common(tmp_path, body, gpu, PRECISION="auto", FP8="hybrid")
    assert "precision=[--bf16 --fp8-format hybrid --fp8-recipe tensorwise]" in out.stdout, \
        out.stdout + out.stderr
    out = _launch_common(tmp_path, body, gpu, PRECISION="auto", FP8="e4m3",
                         FP8_RECIPE="rowwise")
    assert "precision=[--bf16 --fp8-format e4m3 --fp8-recipe rowwise]" in out.stdout
    out = _launch_common(tmp_path, body, gpu, PRECISION="auto")
    assert "fp8" not in out.stdout
    line = annotate("--fp16 with --fp8-format is not supported: ...",
                    os.path.join(REPO, "examples/run_gpt2.sh"))
    assert line.endswith("[run_gpt2.sh: PRECISION, FP8]"), line


def _moe_fp8_losses(seed):
    """Rank body: GPT-2 with an MoE layer and a dense one, bf16 and FP8, same weights;
    returns the FP8 model's FP8 linears, the two losses and gradients."""
    from megatron import mpu
    from megatron.model.gpt2_model import GPT2Model
    from megatron.model.transformer import TransformerConfig
    from megatron.mpu import moe

    def build(fp8):
        torch.manual_seed(seed)
        experts = moe.MoEConfig(num_experts=4, topk=2, hidden_size=32, ffn_hidden_size=32,
                                aux_loss_coeff=0.01, init_method_std=0.05,
                                shared_expert_intermediate_size=16)
        config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                                   kv_channels=8, ffn_hidden_size=64, hidden_dropout=0.0,
                                   attention_dropout=0.0, moe=experts, moe_layers=(True, False),
                                   fp8=fp8)
        return GPT2Model(config, 64, 16)

    mpu.initialize_model_parallel(1, 1)
    models = [build(None), build(mpu.Fp8Recipe("e4m3", "tensorwise"))]
    in_fp8 = sorted(n for n, m in models[1].named_modules()
                    if isinstance(m, (mpu.ColumnParallelLinear, mpu.RowParallelLinear))
                    and m.fp8 is not None)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (2, 16), generator=gen)
    pos = torch.arange(16)[None].expand_as(ids)
    mask = torch.ones(1, 1, 16, 16, dtype=torch.bool).tril().logical_not()
    losses, grads = [], []
    for model in models:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(ids, pos, mask, labels=ids.roll(-1, 1)).float().mean()
        loss.backward()
        losses.append(loss.detach())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()
                                if p.grad is not None]))
    return in_fp8, losses, grads


def test_moe_experts_stay_in_the_compute_dtype_under_fp8(seed):
    """With MoE blocks, FP8 takes the attention and dense MLP linears; the router, the
    grouped experts and the shared expert stay in bf16. The FP8 model's loss and gradients
    are those of the same weights in bf16 within FP8's error (and not equal: FP8 ran)."""
    from harness import run_distributed

    in_fp8, losses, grads = run_distributed(_moe_fp8_losses, 1, seed)[0]
    assert any(".1.mlp." in n for n in in_fp8), in_fp8  # the dense layer's MLP
    assert all(".0.mlp." not in n for n in in_fp8), in_fp8  # the MoE block's shared expert
    assert any(".0.attention." in n or ".0.self_attention." in n for n in in_fp8), in_fp8
    assert torch.isfinite(losses[1]) and torch.isfinite(grads[1]).all()
    assert not torch.equal(grads[0], grads[1])
    assert abs(losses[1] - losses[0]) < 0.02 * abs(losses[0]), losses
    rel = (grads[1] - grads[0]).norm() / grads[0].norm()
    assert rel < 0.15, rel

"""A model family defined here, outside the package, gets what GPT-2 and T5 get: it loads
its own checkpoint (no registration), the log shows its FLOPs, a resume with another value
of a setting it declares is refused, a flag it does not implement is refused at start-up,
--compile says so when it compiled nothing and says its compile time apart
from the steps'; a Megatron-style provider run logs the FLOPs
it is given, or n/a."""
import dataclasses
import os
import re

import pytest

from harness import run_distributed
from llama_runs import llama_argv

FLOPS = 3.0e9  # per step: a made-up count, so the logged TFLOP/s can only come from it


def my_flops(cfg):
    return FLOPS


def _family(**changes):
    from llama_model import LLAMA

    return dataclasses.replace(LLAMA, name="mine", label="Mine", flops_per_step=my_flops,
                               supports=frozenset({"pipeline"}), memory_model=None, **changes)


def _captured(argv, family=None, **providers):
    """pretrain() with stdout and stderr captured; (losses or the error message, output)."""
    import contextlib
    import io

    from megatron import mpu
    from megatron.common.errors import MegatronError
    from megatron.training import pretrain

    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            result = pretrain(family=family, argv=argv, **providers).losses
    except MegatronError as exc:
        result = str(exc)
    finally:
        if mpu.model_parallel_is_initialized():
            mpu.destroy_model_parallel()
    return result, out.getvalue()


def _providers():
    """Megatron-style providers for the example model (no family)."""
    from llama_model import LLAMA, add_flags, build_model
    from megatron.families import decoder_lm
    from megatron.common.global_vars import get_args, get_tokenizer

    def model_provider(pipeline=False):
        return build_model(get_args(), pipeline)

    def dataset_provider(num_samples):
        return decoder_lm.build_datasets(get_args(), get_tokenizer(), num_samples)

    def forward_step(data_iterator, model):
        batch_fn = decoder_lm.make_batch_fn(get_args(), get_tokenizer())
        return LLAMA.forward_step(batch_fn)(data_iterator, model)

    return dict(train_valid_test_dataset_provider=dataset_provider,
                model_provider=model_provider, forward_step_func=forward_step,
                extra_args_provider=add_flags,
                args_defaults={"tokenizer_type": "GPT2BPETokenizer"})


def outside_family_runs(data, ckpt):
    """Rank body: the runs of the test below, in one process."""
    def argv(steps, *extra):
        return llama_argv(data, 1, 1, "--peak-tflops", "100", *extra, steps=steps)

    runs = {"first": _captured(argv(4, "--save", ckpt), _family())}
    runs["resume"] = _captured(argv(6, "--load", ckpt), _family())
    runs["theta"] = _captured(argv(6, "--load", ckpt, "--rope-theta", "500000"), _family())
    runs["recompute"] = _captured(argv(2, "--checkpoint-activations"), _family())
    runs["other family"] = _captured(argv(6, "--load", ckpt), dataclasses.replace(
        _family(), name="llama"))
    import torch

    # --compile takes the user's whole model (and the family's loss) as one region, whatever
    # compile_classes names (an empty tuple means "compile nothing": test_compile.py)
    # (two steps, a line each: the first's compile is said apart, a progress line each 0.5 s
    # of it)
    os.environ["MEGATRON_COMPILE_PROGRESS_INTERVAL"] = "0.5"
    runs["compile"] = _captured(argv(2, "--compile", "--log-interval", "1"),
                                _family(compile_classes=(torch.nn.GRU,)))
    runs["provider"] = _captured(argv(4), flops_per_step=my_flops, **_providers())
    runs["provider n/a"] = _captured(argv(4), **_providers())
    return runs


def test_a_family_from_a_test_file_is_first_class(gpt2_data, tmp_path):
    (runs,) = run_distributed(outside_family_runs, 1, gpt2_data, str(tmp_path / "ck"),
                              timeout=300)
    for name in ("first", "provider"):
        _logs_its_flops(*runs[name])
    losses, log = runs["provider n/a"]
    assert len(losses) == 4 and "TFLOP/s/device: n/a | MFU: n/a" in log, log
    assert "memory model: none for a model built by a model_provider" in log
    losses, log = runs["first"]
    assert "memory model: none for the 'mine' model family" in log
    losses, log = runs["resume"]
    assert len(losses) == 2 and "loaded checkpoint" in log, log  # its own checkpoint
    message, _ = runs["theta"]
    assert "rope_theta: checkpoint 10000.0, flags 500000.0" in message
    message, _ = runs["other family"]
    assert "holds a 'mine' model but this run trains 'llama'" in message
    message, log = runs["recompute"]
    assert "--checkpoint-activations is not supported by the 'mine' model family" in message
    assert "iteration" not in log  # refused before any step
    losses, log = runs["compile"]
    assert len(losses) == 2 and "--compile: the model as one region, its loss included" in log
    _compile_is_said_apart(log)


def _compile_is_said_apart(log):
    """While the first step compiles, progress lines; its compile time is said apart and left
    out of the first interval's step time, tokens/s and MFU (the first-step wall time of the
    start-up line, less the compile time, is what the first line's step time is)."""
    assert re.search(r"> compiling: \d+ graphs so far, \d+ s", log), log
    first = re.search(r"first step \(includes torch\.compile of 1 graph\(s\), ([0-9.]+) s\) "
                      r"([0-9.]+) s", log)
    assert first, log
    compiled, wall = float(first.group(1)), float(first.group(2))
    lines = [line for line in log.splitlines() if line.startswith("iteration")]
    said = re.search(r"compile \(not in the step time\): ([0-9.]+) s", lines[0])
    assert len(lines) == 2 and said and "compile" not in lines[1], lines
    assert float(said.group(1)) == pytest.approx(compiled, abs=0.051)
    ms = [float(re.search(r"per iteration \(ms\): ([0-9.]+)", x).group(1)) for x in lines]
    tokens = [float(re.search(r"tokens/s: ([0-9.]+)", x).group(1)) for x in lines]
    assert compiled > 1.0 and ms[0] / 1e3 < wall - compiled + 0.5, (compiled, wall, ms)
    assert tokens[0] == pytest.approx(8 * 32 / (ms[0] / 1e3), rel=0.02)  # batch 8 x 32 tokens
    tflops = float(re.search(r"TFLOP/s/device: ([0-9.e+-]+)", lines[0]).group(1))
    assert tflops == pytest.approx(FLOPS / (ms[0] / 1e3) / 1e12, rel=0.05)


def _logs_its_flops(losses, log):
    assert len(losses) == 4, log
    ms = [float(x) for x in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", log)]
    tflops = [float(x) for x in re.findall(r"TFLOP/s/device: ([0-9.e+-]+)", log)]
    mfu = [float(x) for x in re.findall(r"MFU: ([0-9.]+)%", log)]
    assert ms and len(tflops) == len(ms) == len(mfu), log
    for t, f, m in zip(ms, tflops, mfu):
        # its own count (the ms are printed to 0.1)
        assert f == pytest.approx(FLOPS / (t / 1e3) / 1e12, rel=0.05)
        assert m == pytest.approx(f, abs=0.06)  # percent of --peak-tflops 100


def test_names_go_through_the_registry_and_plan_layout_says_there_is_no_memory_model():
    from megatron.common.errors import ConfigError
    from megatron.families import get_family, register

    with pytest.raises(ConfigError, match=r"megatron.families.register\('mine_unregistered'"):
        get_family("mine_unregistered")
    from megatron import families

    register("mine", lambda: _family())
    try:
        assert get_family("mine").flops_per_step is my_flops
        _plan_mine()
    finally:
        families._FACTORIES.pop("mine")


def _plan_mine():
    import importlib.util
    import os

    from megatron.common.errors import ConfigError

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("plan_layout",
                                                  os.path.join(root, "tools", "plan_layout.py"))
    plan_layout = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plan_layout)
    with pytest.raises(ConfigError, match="family 'mine' has no memory model"):
        plan_layout.main(["--config", os.path.join(root, "configs", "gpt2", "gpt2_124m.yaml"),
                          "--family", "mine", "--gpus", "8"])

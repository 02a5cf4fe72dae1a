"""tools/plan_layout.py and megatron/memory/step_time.py: pure JSON on stdout, the memory
reserve, the config's own layout evaluated as every other, a step time that depends on the
micro-batch, the tensor-parallel width and the pipeline bubble."""
import json
import os
import random
import subprocess
import sys
from dataclasses import replace

import pytest

from megatron.memory import GIB, MemorySpec
from megatron.memory.planner import Hardware, evaluate

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _plan_json(*flags):
    """Run the CLI in a fresh process (DeepSpeed's import-time warning included)."""
    out = subprocess.run([sys.executable, os.path.join(REPO, "tools", "plan_layout.py"),
                          "--config", "configs/gpt2/gpt2_345m.yaml", "--json", *flags],
                         cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": REPO})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)  # the whole of stdout: nothing before or after the JSON


def test_json_is_pure_and_the_reserve_holds_and_the_config_row_is_a_ranked_row():
    reserve = random.choice([2, 4, 8])
    out = _plan_json("--gpus", "8", "--gpu-memory", "24GiB", "--reserve", f"{reserve}GiB",
                     "--global-batch", "512")
    assert out["usable_bytes"] == (24 - reserve) * GIB and out["gpu"] == "h100"
    layouts = out["layouts"]
    assert layouts
    for x in layouts:
        assert max(x["stage_peak_bytes"]) == x["peak_bytes"] <= out["usable_bytes"]
        assert x["micro_batch"] * x["num_micro_batches"] * x["dp"] == 512
    speeds = [x["tokens_per_gpu_s"] for x in layouts]
    assert speeds == sorted(speeds, reverse=True)
    mine = out["config_layout"]  # the YAML's tp 2 x dp 4, micro-batch 8, at batch 512
    assert mine["micro_batch"] * mine["num_micro_batches"] * mine["dp"] == 512
    same = [x for x in layouts if all(x[k] == mine[k] for k in (
        "tp", "pp", "dp", "micro_batch", "recompute", "zero_stage", "sequence_parallel"))]
    # the best rows also carry the line that runs them
    assert [{k: v for k, v in x.items() if k != "run"} for x in same] == [mine]


def test_text_header_names_the_gpu_preset(capsys):
    import importlib.util
    from types import SimpleNamespace

    spec = importlib.util.spec_from_file_location("plan_layout", os.path.join(
        REPO, "tools", "plan_layout.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    gpu = random.choice(sorted(tool.PRESETS))
    args = SimpleNamespace(config="x.yaml", gpus=8, gpu=gpu, top=1)
    hw = Hardware(gpus=8, gpu_memory=80 * GIB)
    tool._header(args, hw, SimpleNamespace(dtype="bf16"), 64, 17, None, "none")
    header = capsys.readouterr().out.splitlines()[0]
    assert f"17 layouts on 8 {gpu.upper()} GPUs x 80 GiB" in header, header


def _spec(**changes):
    base = dict(family="gpt2", num_layers=24, hidden=1024, heads=16, kv_channels=64,
                ffn=4096, vocab=51200, seq=1024, micro_batch=1, num_micro_batches=64,
                dp=8, dtype="fp16", backend="ddp")
    base.update(changes)
    return MemorySpec(**base)


def test_step_time_falls_with_the_micro_batch_at_a_fixed_global_batch():
    """GPT-2 345M on 8 GPUs, global batch 512: micro-batch 1 -> 8 runs faster without a
    pipeline; with one, fewer micro-batches mean a larger bubble, so 1 is still the slowest
    but the best is in between."""
    hw = Hardware(gpus=8, gpu_memory=80 * GIB)
    for layout in (dict(), dict(tp=2, dp=4), dict(pp=2, dp=4, backend="engine")):
        times = []
        for mb in (1, 2, 4, 8):
            spec = _spec(micro_batch=mb, **layout)
            spec = replace(spec, num_micro_batches=512 // (spec.dp * mb))
            times.append(evaluate(spec, hw, 1.0).step_time)
        assert times[0] == max(times) and min(times) < 0.97 * times[0], (layout, times)
        if "pp" not in layout:
            assert times == sorted(times, reverse=True), (layout, times)


def test_step_time_terms_move_the_right_way():
    hw = Hardware(gpus=8, gpu_memory=80 * GIB)
    one = evaluate(_spec(micro_batch=8, num_micro_batches=8), hw, 1.0).time
    wide = evaluate(_spec(micro_batch=8, num_micro_batches=16, tp=2, dp=4), hw, 1.0).time
    assert one.tp_comm == 0 < wide.tp_comm
    # half the work per GPU per micro-batch at tp 2, but thinner GEMMs: more than half
    assert wide.compute > one.compute
    few = evaluate(_spec(micro_batch=8, num_micro_batches=2, pp=4, dp=2, backend="engine"),
                   hw, 1.0).time
    many = evaluate(_spec(micro_batch=8, num_micro_batches=32, pp=4, dp=2, backend="engine"),
                    hw, 1.0).time
    # (p - 1) / (m + p - 1) = 0.6 for equal stages; here the last stage's head makes it
    # the slowest, which the steady state waits for, so the idle share is a little lower
    assert 0.6 > few.bubble > 0.4 > 0.1 > many.bubble > 0
    slow_net = evaluate(_spec(micro_batch=8, num_micro_batches=8),
                        replace(hw, nodes=8), 1.0).time  # one GPU per node: dp over IB
    assert slow_net.dp_comm >= one.dp_comm


def test_a_reserve_that_leaves_nothing_is_refused():
    sys.path.insert(0, os.path.join(REPO, "tools"))
    import plan_layout

    from megatron.common.errors import ConfigError

    with pytest.raises(ConfigError, match="--reserve 90GiB must be >= 0 and below"):
        plan_layout.main(["--config", "configs/gpt2/gpt2_345m.yaml", "--gpus", "8",
                          "--reserve", "90GiB"])

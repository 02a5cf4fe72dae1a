"""tools/plan_layout.py on every config the project ships (configs/: GPT-2 from the demo's
tiny one to 1T, T5-base, the Llama example's 7B), each at two GPU counts: a ranked table,
or a refusal that names its reason; the config's own values are planned (nothing forced over
them: the demo's tiny config plans), a GPU count the config's layout does not divide is still planned; and the line printed
for the best row, fed to its run script's settings check (``CHECK_ONLY=1``) or, for a family
without one, to the entry script's, is accepted."""
import contextlib
import glob
import io
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from megatron.common.errors import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tools"))

import plan_layout  # noqa: E402

#: (config, GPU count, what it gives): "table" or the refusal's reason. Each config at two
#: counts; the default run keeps the ones marked fast (the rest: -m exhaustive, 1-32 s each).
CASES = [
    ("gpt2/tiny_cpu", 8, "table", True), ("gpt2/tiny_cpu", 2, "table", False),
    ("gpt2/gpt2_124m", 8, "table", False), ("gpt2/gpt2_124m", 64, "table", True),
    ("gpt2/gpt2_345m", 8, "table", False), ("gpt2/gpt2_345m", 64, "table", False),
    ("gpt2/gpt2_1.3b", 8, "table", False), ("gpt2/gpt2_1.3b", 64, "table", False),
    ("gpt2/cpm_2.6b", 8, "table", False), ("gpt2/cpm_2.6b", 64, "table", False),
    ("gpt2/gpt2_13b", 8, "table", True), ("gpt2/gpt2_13b", 64, "table", True),
    ("gpt2/gpt3_175b", 8, "fits", True), ("gpt2/gpt3_175b", 512, "table", False),
    ("gpt2/gpt_1t", 64, "fits", True), ("gpt2/gpt_1t", 512, "table", False),
    ("t5/t5_base", 8, "table", True), ("t5/t5_base", 16, "table", False),
    ("llama/llama2_7b", 8, "table", False), ("llama/llama2_7b", 16, "table", False),
    # MoE, ep among the dimensions: 46.7B parameters at 16 bytes each (the project's step:
    # fp32 weights, gradients, Adam's moments) do not fit on 8 GPUs (87 GiB each); on 64
    # the ranking's ep column
    # (ep x the cp candidates: ~25 s of CPU, -m exhaustive)
    ("llama/mixtral_8x7b", 8, "fits", True), ("llama/mixtral_8x7b", 64, "table", False),
]
#: Where the best row's line is fed to the settings check in the default run (a pipeline
#: with ZeRO in fp16 through run_gpt2.sh; run_t5.sh and the flags of the Llama example's
#: entry: -m exhaustive, 5-30 s each).
CHECKED = {("gpt2/gpt2_13b", 64)}


def _case(config, gpus, want, fast):
    marks = [] if fast else [pytest.mark.exhaustive]
    return pytest.param(config, gpus, want, marks=marks, id=f"{config}@{gpus}")


def _plan(config, gpus):
    """plan_layout's JSON for ``config`` on ``gpus`` H100s, or the ConfigError it raised."""
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            assert plan_layout.main(["--config", f"configs/{config}.yaml", "--gpus",
                                     str(gpus), "--json"]) == 0
    except ConfigError as exc:
        return exc
    return json.loads(out.getvalue())


def test_every_shipped_config_is_in_the_cases():
    shipped = {os.path.relpath(p, os.path.join(REPO, "configs"))[:-5]
               for p in glob.glob(os.path.join(REPO, "configs", "*", "*.yaml"))}
    counts = {config: sum(1 for c, *_ in CASES if c == config) for config in shipped}
    assert counts and all(n == 2 for n in counts.values()), counts


@pytest.mark.parametrize("config,gpus,want", [_case(*c) for c in CASES])
def test_plan_layout_ranks_or_says_why(config, gpus, want, monkeypatch):
    monkeypatch.chdir(REPO)
    plan = _plan(config, gpus)
    if want == "fits":  # the refusal names the memory and what to change
        assert isinstance(plan, ConfigError), plan
        assert re.search(rf"none of the \d+ layouts of configs/{config}.yaml on {gpus} GPUs "
                         rf".* fits in 76\.0 GiB per GPU .* plan for more GPUs or more "
                         rf"memory per GPU", str(plan)), plan
        return
    assert not isinstance(plan, Exception), plan
    rows = plan["layouts"]
    speeds = [r["tokens_per_gpu_s"] for r in rows]
    assert rows and speeds == sorted(speeds, reverse=True)
    for r in rows[:20]:
        assert r["tp"] * r["cp"] * r["pp"] * r["dp"] == gpus, r
        assert r["peak_bytes"] <= plan["usable_bytes"], r
        assert r["micro_batch"] * r["num_micro_batches"] * r["dp"] == plan["global_batch"]
    if "num_experts" in open(os.path.join(REPO, "configs", f"{config}.yaml")).read():
        # ep a dimension: every ep that divides dp x cp and the 8 experts is planned
        eps = {r["ep"] for r in rows}
        assert len(eps) > 1 and all(r["dp"] * r["cp"] % r["ep"] == 0 and 8 % r["ep"] == 0
                                    for r in rows), eps
        assert not any(r["sequence_parallel"] for r in rows)  # the run refuses it with MoE
    mine, note = plan["config_layout"], plan["config_layout_note"]
    assert (mine is None) == bool(note), (mine, note)
    if mine is None:  # the config's layout is for another GPU count: said, and planned
        assert re.search(rf"needs (a multiple of )?\d+ GPUs, not {gpus}", note), note
    best = rows[0]
    _check_run_line(best, plan["family"], gpus, config)


def _check_run_line(row, family, gpus, config):
    """The best row's line names its layout (read back independently of how it was made)."""
    line = row["run"]
    words = shlex.split(line)
    if family not in ("gpt2", "t5"):
        flags = words[words.index("node(s):") + 1:]
        read = {flags[i]: flags[i + 1] for i in range(len(flags) - 1)
                if flags[i].startswith("--") and not flags[i + 1].startswith("--")}
        assert read["--tensor-model-parallel-size"] == str(row["tp"])
        assert read["--pipeline-model-parallel-size"] == str(row["pp"])
        assert read["--micro-batch-size"] == str(row["micro_batch"])
        assert read.get("--expert-model-parallel-size", "1") == str(row["ep"])
        yaml_text = open(os.path.join(REPO, "configs", f"{config}.yaml")).read()
        assert read["--num-layers"] == re.search(r"num_layers: (\d+)", yaml_text).group(1)
        assert ("--sequence-parallel" in flags) == row["sequence_parallel"]  # the row's
        return
    variables = dict(w.split("=", 1) for w in words[:words.index("bash")])
    assert words[-2:] == ["bash", f"examples/run_{family}.sh"], line
    assert int(variables["GPUS_PER_NODE"]) * int(variables["NNODES"]) == gpus
    assert (variables["mp_size"], variables["pp_size"], variables["BATCHSIZE"],
            variables["GAS"]) == tuple(str(row[k]) for k in ("tp", "pp", "micro_batch",
                                                             "num_micro_batches"))
    extra = variables.get("EXTRA_ARGS", "")
    yaml_text = open(os.path.join(REPO, "configs", f"{config}.yaml")).read()
    assert variables["NLAYERS"] == re.search(r"num_layers: (\d+)", yaml_text).group(1)
    assert ("--sequence-parallel" in extra) == row["sequence_parallel"]
    if row["pp"] > 1:
        assert variables["PIPELINE_SCHEDULE"] == row["pipeline_schedule"]
    if row["backend"] == "deepspeed":
        assert f"--zero-stage {row['zero_stage']}" in extra
    else:  # the project's step: ZeRO 1 is its distributed optimizer, planned overlapped
        assert ("--use-distributed-optimizer" in extra) == bool(row["zero_stage"]), extra
        assert "--overlap-grad-reduce" in extra and row["overlap_grad_reduce"], extra


#: A python that makes DeepSpeed's CPU accelerator report fp16 (tests/precision.py) before
#: running its module: a config planned for GPUs in fp16 is checked on this CPU as on them.
_FP16_PYTHON = r'''
import os, runpy, sys
os.environ["MEGATRON_TDS_TEST_CPU_FP16"] = "1"
sys.path.insert(0, {tests!r})
import precision  # noqa: F401 (emulates fp16 at import)
assert sys.argv[1] == "-m", sys.argv
sys.argv = [sys.argv[2], *sys.argv[3:]]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
'''


def _python_with_fp16(tmp_path):
    script = tmp_path / "fp16_python.py"
    script.write_text(_FP16_PYTHON.format(tests=os.path.join(REPO, "tests")))
    wrapper = tmp_path / "python"
    wrapper.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} {script} \"$@\"\n")
    wrapper.chmod(0o755)
    return str(wrapper)


def _data_env(family, gpt2_data, t5_data):
    if family == "t5":
        return {"DATA_PATH": t5_data["prefix"], "TOKENIZER_MODEL": t5_data["spm"]}
    return {"DATA_PATH": gpt2_data["prefix"], "VOCAB_FILE": gpt2_data["vocab"],
            "MERGE_FILE": gpt2_data["merges"]}


def _cases_checked():
    return [pytest.param(c, g, marks=[] if (c, g) in CHECKED else [pytest.mark.exhaustive],
                         id=f"{c}@{g}") for c, g, want, _ in CASES if want == "table"]


@pytest.mark.parametrize("config,gpus", _cases_checked())
def test_the_best_rows_line_passes_the_settings_check(config, gpus, gpt2_data, t5_data,
                                                      tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    plan = _plan(config, gpus)
    row, family = plan["layouts"][0], plan["family"]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS",)}
    env.update(PYTHON=_python_with_fp16(tmp_path), CHECKPOINT_PATH=str(tmp_path / "ckpt"),
               LOG_DIR=str(tmp_path / "logs"), PYTHONPATH=REPO,
               **_data_env(family, gpt2_data, t5_data))
    words = shlex.split(row["run"])
    if family in ("gpt2", "t5"):
        variables = dict(w.split("=", 1) for w in words[:words.index("bash")])
        cmd = ["bash", words[-1]]
        env.update(variables, CHECK_ONLY="1")
    else:  # the flags, to the entry script's check (as its launcher would run them)
        flags = words[words.index("node(s):") + 1:]
        cmd = [env["PYTHON"], "-m", "megatron.launch.check", "--world-size", str(gpus),
               "examples/llama/pretrain_llama.py", *flags, "--data-path", gpt2_data["prefix"],
               "--vocab-file", gpt2_data["vocab"], "--merge-file", gpt2_data["merges"]]
    proc = subprocess.run(cmd, cwd=REPO, env=env, text=True, capture_output=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, (row["run"], out[-3000:])
    assert f"> settings checked for a world of {gpus} processes" in out, out[-3000:]
    assert "torchrun" not in out and not os.path.exists(tmp_path / "logs"), out[-2000:]

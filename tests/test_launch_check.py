"""The run scripts' settings check and device defaults (examples/launch_common.sh,
megatron/launch/check.py): a bad setting is one message naming the flag and the script
variable, exit 2, before any launcher starts; PRECISION=auto and OMP_NUM_THREADS follow the
machine; the demo's YAML twin stays the demo's."""
import os
import re
import subprocess
import time

import pytest
import yaml

from gpt2_runs import REPO
from launch_runs import launch_env
from megatron.launch.check import SCRIPT_VARIABLES, annotate, script_variables

SCRIPTS = ("examples/run_gpt2.sh", "examples/run_t5.sh")
COMMON = "examples/launch_common.sh"


def _text(path):
    with open(os.path.join(REPO, path), encoding="utf-8") as handle:
        return handle.read()


def test_a_setting_error_is_one_message_and_exit_2_before_any_launcher(gpt2_data, tmp_path):
    """Two bad settings through run_gpt2.sh (heads not divisible by tp; fp16 stepped by
    DeepSpeed's engine, USE_DEEPSPEED=1 at pp_size 1, on a device whose DeepSpeed has none):
    both in one message, printed once, naming the script's variables;
    exit 2 in well under 30 s, and torchrun never started (no rendezvous, no restart)."""
    env = launch_env(gpt2_data, tmp_path, NHEADS="5", NHIDDEN="40", PRECISION="fp16",
                     pp_size="1", USE_DEEPSPEED="1", MEGATRON_TDS_DS_FP16="0")
    start = time.monotonic()
    proc = subprocess.run(["bash", "examples/run_gpt2.sh"], cwd=REPO, env=env, text=True,
                          capture_output=True, timeout=120)
    elapsed = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert elapsed < 30, elapsed
    assert out.count("error: ") == 1 and out.count("is not divisible by the tensor-model") == 1
    heads = next(line for line in out.splitlines() if "--num-attention-heads (5)" in line)
    assert heads.endswith("[run_gpt2.sh: mp_size, NHEADS]"), heads
    fp16 = next(line for line in out.splitlines() if "--fp16 is not supported" in line)
    assert fp16.endswith("[run_gpt2.sh: PRECISION]"), fp16
    for sign in ("waiting for", "torchrun", "restart", "Traceback", "ChildFailedError"):
        assert sign not in out, (sign, out[-3000:])
    # the node's log file has the message too
    logs = os.listdir(tmp_path / "logs")
    assert len(logs) == 1 and "--num-attention-heads (5)" in \
        (tmp_path / "logs" / logs[0]).read_text()


def _launch_common(tmp_path, body, gpu, **env):
    """Run ``body`` after sourcing launch_common.sh; ``gpu``: a stand-in nvidia-smi that
    lists one GPU is first on PATH (else one that lists none)."""
    bin_dir = tmp_path / ("gpu" if gpu else "cpu")
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + ("echo 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: x)'\n" if gpu
                                    else "exit 9\n"))
    smi.chmod(0o755)
    full = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS",
                                                             "CUDA_VISIBLE_DEVICES",
                                                             "MEGATRON_DEVICE")}
    full.update(PATH=f"{bin_dir}:{os.environ['PATH']}", config_json="ds.json", **env)
    script = f"set -euo pipefail\nsource {COMMON}\n{body}\n"
    return subprocess.run(["bash", "-c", script], cwd=REPO, env=full, text=True,
                          capture_output=True, timeout=60)


@pytest.mark.parametrize("gpu", [False, True])
def test_precision_auto_and_cpu_threads_follow_the_machine(tmp_path, gpu):
    body = ('megatron_precision_and_deepspeed_args fp16\nmegatron_cpu_threads\n'
            'echo "precision=[$precision_args] PRECISION=$PRECISION omp=$OMP_NUM_THREADS"')
    procs = 3
    out = _launch_common(tmp_path, body, gpu, PRECISION="auto", GPUS_PER_NODE=str(procs))
    assert out.returncode == 0, out.stderr
    cores = len(os.sched_getaffinity(0))
    want = ("precision=[--fp16] PRECISION=fp16 omp=1" if gpu else
            f"precision=[] PRECISION=fp32 omp={max(1, cores // procs)}")
    assert want in out.stdout, out.stdout
    # a value the user set is kept; a bad PRECISION is refused with the variable's name
    kept = _launch_common(tmp_path, body, gpu, PRECISION="bf16", GPUS_PER_NODE="2",
                          OMP_NUM_THREADS="7")
    assert "precision=[--bf16] PRECISION=bf16 omp=7" in kept.stdout, kept.stdout
    bad = _launch_common(tmp_path, body, gpu, PRECISION="fp8", GPUS_PER_NODE="2")
    assert bad.returncode == 2 and "PRECISION=fp8: use fp32, fp16, bf16 or auto" in bad.stderr


def test_annotation_names_only_the_scripts_variables():
    line = ("--hidden-size (30) is not divisible by --num-attention-heads (4); set "
            "--kv-hidden-size explicitly")
    gpt2 = annotate(line, os.path.join(REPO, "examples/run_gpt2.sh"))
    t5 = annotate(line, os.path.join(REPO, "examples/run_t5.sh"))
    assert gpt2.endswith("[run_gpt2.sh: NHIDDEN, NHEADS]"), gpt2  # run_gpt2 has no KV_HIDDEN
    assert t5.endswith("[run_t5.sh: NHIDDEN, NHEADS, KV_HIDDEN]"), t5
    # a flag that starts like another is not it; a line naming nothing stays as it was
    assert script_variables("--lr-decay-iters 3 and --save-interval 2") == []
    assert script_variables("--lr 3 and --save x") == ["LR", "CHECKPOINT_PATH"]
    assert annotate("the tokenizer file is broken", "run_gpt2.sh") == \
        "the tokenizer file is broken"


#: Table entries the scripts pass through a variable of launch_common.sh rather than as
#: ``--flag $VARIABLE``: what in the scripts shows the variable sets the flag.
_INDIRECT = {"PRECISION": r'case "\$PRECISION" in[\s\S]*fp16\) precision_args="--fp16"',
             "GAS": r"BATCHSIZE \* GAS \* dp_full[\s\S]*--global-batch-size \$GLOBAL_BATCH",
             "GPUS_PER_NODE x NNODES": r"--world-size \$\(\( GPUS_PER_NODE \* NNODES \)\)"}


def test_each_named_variable_sets_its_flag_in_the_scripts():
    """SCRIPT_VARIABLES may only name a variable for a flag the scripts set from it."""
    common = _text(COMMON)
    for script in SCRIPTS:
        text = _text(script) + common
        defined = set(re.findall(r"^\s*([A-Za-z_]\w*)=", _text(script), re.MULTILINE))
        for words, name in SCRIPT_VARIABLES:
            if not all(part in defined for part in name.split(" x ")):
                continue
            if name in _INDIRECT:
                assert re.search(_INDIRECT[name], text), (script, name)
                continue
            flags = [w for w in words.split("|") if w.startswith("--")]
            used = [f for f in flags if re.search(
                rf"{re.escape(f)}\s+\$\{{?{name}\b|\$\{{?{name}\b[^\n]*{re.escape(f)}", text)]
            assert used, (script, name, flags)


def _demo_defaults():
    text = _text("examples/demo_gpt2.sh")
    found = dict(re.findall(r"\b([A-Z_]+)=\$\{\1:-([^}]+)\}", text))
    found.update(re.findall(r"--(warmup|min-lr|log-interval|eval-interval|eval-iters) (\S+)",
                            text))
    return found


def test_the_tiny_cpu_config_is_the_demo():
    demo = _demo_defaults()
    cfg = yaml.safe_load(_text("configs/gpt2/tiny_cpu.yaml"))
    pairs = {"num_layers": "NLAYERS", "hidden_size": "NHIDDEN",
             "num_attention_heads": "NHEADS", "seq_length": "SEQLEN", "batch_size": "BATCHSIZE",
             "gas": "GAS", "train_iters": "TRAIN_ITERS", "lr": "LR", "min_lr": "min-lr",
             "warmup": "warmup", "log_interval": "log-interval",
             "eval_interval": "eval-interval", "eval_iters": "eval-iters"}
    for key, name in pairs.items():
        assert float(cfg[key]) == float(demo[name]), (key, cfg[key], demo[name])
    assert cfg["hidden_dropout"] == cfg["attention_dropout"] == 0.0
    assert float(demo["HIDDEN_DROPOUT"]) == float(demo["ATTENTION_DROPOUT"]) == 0.0


def test_the_demo_installs_the_tensorboard_it_writes_events_with():
    """The demo's install line takes the extra that holds tensorboard (setup.py), so the
    run's TensorBoard events, which it names at the end, are written."""
    import ast

    tree = ast.parse(_text("setup.py"))
    extras = next(ast.literal_eval(node.value) for node in ast.walk(tree)
                  if isinstance(node, ast.Assign) and
                  getattr(node.targets[0], "id", "") == "EXTRAS_REQUIRE")
    install = re.search(r'pip install -q -e "\.\[(\w+)\]"', _text("examples/demo_gpt2.sh"))
    assert install, "the demo installs the package with an extra"
    assert "tensorboard" in extras[install.group(1)]


def test_cp_size_2_with_the_scripts_defaults_is_refused_naming_the_variable(gpt2_data,
                                                                            tmp_path):
    """cp_size=2 with run_gpt2.sh's own dropout (0.1): refused before any launcher, the line
    naming ATTENTION_DROPOUT (context-parallel attention has no dropout); with
    ATTENTION_DROPOUT=0 the same settings pass the check (CHECK_ONLY=1: nothing launched)."""
    extra = "--log-interval 1 --make-vocab-size-divisible-by 64 --split 98,2,0 --eval-iters 0"
    env = launch_env(gpt2_data, tmp_path, cp_size="2", GPUS_PER_NODE="8", EXTRA_ARGS=extra)
    for name in ("HIDDEN_DROPOUT", "ATTENTION_DROPOUT", "CHECK_ONLY"):
        env.pop(name, None)
    proc = subprocess.run(["bash", "examples/run_gpt2.sh"], cwd=REPO, env=env, text=True,
                          capture_output=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    line = next(x for x in out.splitlines() if "does not implement attention dropout" in x)
    assert "(--attention-dropout 0.1)" in line, line
    assert line.endswith("[run_gpt2.sh: cp_size, ATTENTION_DROPOUT]"), line
    assert "torchrun" not in out
    env.update(ATTENTION_DROPOUT="0", CHECK_ONLY="1")
    proc = subprocess.run(["bash", "examples/run_gpt2.sh"], cwd=REPO, env=env, text=True,
                          capture_output=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "> settings checked for a world of 8 processes" in out, \
        out[-3000:]
    assert "torchrun" not in out

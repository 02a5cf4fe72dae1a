"""Faults a user meets, each run as the user would (the entry script, 1 or 2 ranks).

Every case asserts the exit status, the one ``error:`` line (on every rank), that the run
was over well within 60 s of the fault, and what is left on disk. Kernel-build locks are in
tests/test_fault_locks.py; corrupt ``.idx`` files in tests/test_data_indexed.py.
"""
import math
import os
import re
import stat
import time

import pytest

from gpt2_runs import gpt2_argv, run_script
from precision import EmulatedAccelerator

TRACKER = "latest_checkpointed_iteration.txt"


def _tiny(data, *extra, iters="2"):
    return ["pretrain_gpt2.py", *gpt2_argv(data, "--batch-size", "2", "--train-iters", iters,
                                           *extra)]


#: These runs are about faults, not kernels: no compiler, no shared build cache to wait on.
NO_NATIVE = {"MEGATRON_TDS_NO_FUSED_KERNELS": "1", "MEGATRON_TDS_DATA_HELPERS": "numpy"}


def _run(argv, nproc=1, env=None):
    start = time.monotonic()
    result = run_script(argv, nproc=nproc, timeout=240, env={**NO_NATIVE, **(env or {})})
    result.seconds = time.monotonic() - start
    return result


def _assert_user_error(result, *phrases, nproc=1, within=60):
    """Status 2, no traceback, an ``error:`` line from every rank with the phrases (a
    message may go on over a few indented lines: "invalid configuration:\n  - ...")."""
    err = result.stderr
    assert result.returncode != 0 and result.seconds < within, (result.returncode, err[-3000:])
    if nproc == 1:
        assert result.returncode == 2, (result.returncode, err[-3000:])
        assert "Traceback" not in err, err[-3000:]
    else:
        assert "exitcode  : 2" in err, err[-3000:]  # torchrun's report of the ranks' status
        # no traceback through our code (torchrun prints its own launcher traceback)
        assert not re.search(r'File "[^"]*(/megatron/|/tds/|pretrain_gpt2\.py)', err), err[-3000:]
    lines = [ln for ln in err.splitlines() if re.match(r"(\[rank \d+\] )?error: ", ln)]
    assert lines, err[-3000:]
    # torchrun stops the other ranks (SIGTERM) as soon as one exits, so a rank that reached
    # the error a few ms later may be stopped before it prints: under torchrun, at least one
    # line, and every line printed is the clear one (or says a peer stopped first).
    if nproc == 1 or len(lines) >= nproc:
        own = [ln for ln in lines if "another rank stopped" not in ln]
        for phrase in phrases:
            assert err.count(phrase) >= len(own), (phrase, err[-3000:])
    else:
        for phrase in phrases:
            assert phrase in err, (phrase, err[-3000:])


def _listing(root):
    return sorted(os.path.relpath(os.path.join(d, f), root)
                  for d, _, files in os.walk(root) for f in files)


# ---------------------------------------------------------------- divergence
@pytest.mark.slow
def test_diverging_run_names_a_checkpoint_that_resumes(gpt2_data, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    result = _run(_tiny(gpt2_data, "--lr", "1e6", "--min-lr", "0", "--clip-grad", "0",
                        "--save", ckpt, "--save-interval", "1", "--log-interval", "1",
                        iters="30"))
    _assert_user_error(result, "is not finite at iteration", "the newest good checkpoint is")
    line = next(ln for ln in result.stderr.splitlines() if "error: " in ln)
    good = int(re.search(r"newest good checkpoint is iteration (\d+)", line).group(1))
    bad = int(re.search(r"not finite (?:at|after) iteration (\d+)", line).group(1))
    assert good < bad
    with open(os.path.join(ckpt, TRACKER)) as handle:
        assert int(handle.read()) == good  # auto-resume picks the good one
    assert not os.path.exists(os.path.join(ckpt, f"iter_{bad:07d}"))  # never saved
    assert not os.listdir(os.path.join(ckpt, ".tmp"))  # nothing half-written
    resumed = _run(_tiny(gpt2_data, "--lr", "1e-4", "--min-lr", "0", "--load", ckpt,
                         "--log-interval", "1", iters=str(good + 3)))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"lm loss: ([0-9.eE+-]+|nan|inf)", resumed.stdout)]
    # lr 1e6 has blown the weights up long before they overflow: the point is that they are
    # finite and training goes on from them, step after step, without a non-finite loss.
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), resumed.stdout
    print(line)


@pytest.mark.slow
def test_skip_nonfinite_steps_keeps_training(gpt2_data, tmp_path):
    """fp32 with --skip-nonfinite-steps: an inf gradient norm skips the update, the run goes
    on and counts it (forced by a huge loss scale on the logits? no: by lr 1e30)."""
    result = _run(_tiny(gpt2_data, "--lr", "1e30", "--min-lr", "0", "--clip-grad", "0",
                        "--skip-nonfinite-steps", "--log-interval", "1", iters="12"))
    assert result.returncode == 0, result.stderr[-3000:]
    skipped = [int(x) for x in re.findall(r"skipped iterations:\s+(\d+)", result.stdout)]
    assert sum(skipped) >= 1, result.stdout


# ---------------------------------------------------------------- config cases
@pytest.mark.parametrize("extra, phrase", [
    (("--train-iters", "0"), "--train-iters must be >= 1, got 0"),
    (("--train-iters", "-5"), "--train-iters must be >= 1, got -5"),
    (("--split", "0,0,100"), "gives the training split no data"),
])
def test_bad_flags(gpt2_data, extra, phrase):
    result = _run([*_tiny(gpt2_data), *extra])
    _assert_user_error(result, phrase)
    assert "training from iteration" not in result.stdout


def test_save_dir_not_writable_fails_on_every_rank_before_training(gpt2_data, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        if os.access(locked, os.W_OK):  # root ignores permissions: use a path under a file
            target = str(tmp_path / "a_file" / "ckpt")
            (tmp_path / "a_file").write_text("")
        else:
            target = str(locked / "ckpt")
        result = _run([*_tiny(gpt2_data), "--save", target], nproc=2)
        _assert_user_error(result, f"--save {target}", nproc=2)
        assert "training from iteration" not in result.stdout
    finally:
        locked.chmod(stat.S_IRWXU)
    assert not os.listdir(locked)


def test_load_typo_is_an_error_unless_asked(gpt2_data, tmp_path):
    typo = str(tmp_path / "ckpt_typo")
    result = _run([*_tiny(gpt2_data), "--load", typo])
    _assert_user_error(result, f"--load {typo} does not exist", "--load-if-exists")
    same = _run([*_tiny(gpt2_data, iters="1"), "--load", typo, "--save", typo])
    assert same.returncode == 0, same.stderr[-3000:]
    assert os.path.isfile(os.path.join(typo, TRACKER))


@pytest.mark.parametrize("body, phrase", [
    ("parallel_config:\n  data_parallel: two\n", "'data_parallel' must be a whole number"),
    ("hidden_size: 64.9\n", "'hidden_size' must be a whole number, got 64.9"),
    ("num_layers: true\n", "'num_layers' must be a number (int), got True"),
    (b"num_layers: 2\n# \xff\xfe\x00garbage\n", "is not UTF-8 text"),
])
def test_bad_yaml_values(gpt2_data, tmp_path, body, phrase):
    path = tmp_path / "run.yaml"
    path.write_bytes(body if isinstance(body, bytes) else body.encode())
    result = _run([*_tiny(gpt2_data), "--config", str(path)])
    _assert_user_error(result, phrase, str(path))


def test_binary_files_in_place_of_text(gpt2_data, tmp_path):
    garbage = bytes(range(128, 256)) * 4
    merges = tmp_path / "merges.txt"
    merges.write_bytes(garbage)
    result = _run([*_tiny(gpt2_data), "--merge-file", str(merges)])
    _assert_user_error(result, f"{merges} is not UTF-8 text")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / TRACKER).write_bytes(garbage)
    result = _run([*_tiny(gpt2_data), "--load", str(ckpt)], nproc=2)
    _assert_user_error(result, f"{ckpt / TRACKER} is not UTF-8 text", nproc=2)
    assert _listing(ckpt) == [TRACKER]


# ---------------------------------------------------------------- precision support
@pytest.mark.parametrize("flags, fp16, bf16, expected", [
    (("--fp16",), False, True, "--fp16 is not supported by DeepSpeed on this device (cpu "
                               "accelerator"),
    (("--fp16",), False, True, "use --bf16 or fp32"),
    (("--bf16",), True, False, "--bf16 is not supported"),
    (("--fp16",), False, False, "use fp32 (no precision flag)"),
    (("--fp16",), True, True, None),
    (("--bf16",), True, True, None),
    (("--fp16", "--no-deepspeed"), False, False, None),  # the DDP path autocasts on any device
])
@pytest.mark.precision
def test_precision_capability_both_sides(flags, fp16, bf16, expected):
    from megatron.config import build_parser
    from megatron.config.preflight import check_precision

    ddp = "--no-deepspeed" in flags
    argv = [f for f in flags if f != "--no-deepspeed"] + ([] if ddp else ["--deepspeed"])
    args = build_parser().parse_args(argv)
    args.pipeline_model_parallel_size = 1
    problems = []
    check_precision(args, problems, EmulatedAccelerator(fp16, bf16))
    if expected is None:
        assert problems == []
    else:
        assert len(problems) == 1 and expected in problems[0], problems


@pytest.mark.precision
def test_precision_switches_take_a_capability_away(monkeypatch):
    """The switches act on this machine's device (here patched to report both) and never on
    an emulated device a test passes, which states its own capabilities."""
    import deepspeed.accelerator

    from megatron.config.preflight import deepspeed_precision_support

    device = EmulatedAccelerator(fp16=True, bf16=True)
    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", lambda: device)
    monkeypatch.delenv("MEGATRON_TDS_DS_FP16", raising=False)
    monkeypatch.delenv("MEGATRON_TDS_DS_BF16", raising=False)
    assert deepspeed_precision_support() == {"fp16": True, "bf16": True}
    monkeypatch.setenv("MEGATRON_TDS_DS_FP16", "0")
    assert deepspeed_precision_support() == {"fp16": False, "bf16": True}
    assert deepspeed_precision_support(device) == {"fp16": True, "bf16": True}
    monkeypatch.setenv("MEGATRON_TDS_DS_BF16", "0")
    assert deepspeed_precision_support() == {"fp16": False, "bf16": False}
    monkeypatch.setenv("MEGATRON_TDS_DS_FP16", "1")  # cannot add what the device lacks
    with pytest.raises(ValueError, match="MEGATRON_TDS_DS_FP16='1': only 0"):
        deepspeed_precision_support()


@pytest.mark.precision
def test_the_tests_cpu_fp16_emulation_adds_fp16_to_the_cpu_accelerator_only(monkeypatch):
    """MEGATRON_TDS_TEST_CPU_FP16=1 (tests/precision.py, .ci/run's pass on "a CPU with
    DeepSpeed fp16") makes DeepSpeed's CPU accelerator, and so DeepSpeed itself, report fp16;
    any other value, or another accelerator, is an error."""
    import deepspeed.accelerator

    import precision
    from megatron.config.preflight import deepspeed_precision_support

    cpu = deepspeed.accelerator.get_accelerator()
    assert cpu.device_name() == "cpu"
    monkeypatch.setattr(type(cpu), "is_fp16_supported", lambda self: False)  # restored after
    monkeypatch.delenv("MEGATRON_TDS_DS_FP16", raising=False)
    monkeypatch.delenv(precision.EMULATE_CPU_FP16, raising=False)
    assert not precision.emulate_cpu_fp16_if_asked()
    assert deepspeed_precision_support()["fp16"] is False
    monkeypatch.setenv(precision.EMULATE_CPU_FP16, "1")
    assert precision.emulate_cpu_fp16_if_asked()
    assert deepspeed_precision_support()["fp16"] is True
    assert __import__("torch").float16 in cpu.supported_dtypes()  # what DeepSpeed checks
    monkeypatch.setenv("MEGATRON_TDS_DS_FP16", "0")  # the switch still takes it away
    assert deepspeed_precision_support()["fp16"] is False
    monkeypatch.setenv(precision.EMULATE_CPU_FP16, "yes")
    with pytest.raises(ValueError, match="only 1"):
        precision.emulate_cpu_fp16_if_asked()
    monkeypatch.setenv(precision.EMULATE_CPU_FP16, "1")
    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator",
                        lambda: EmulatedAccelerator(fp16=False, bf16=True, name="cuda"))
    with pytest.raises(ValueError, match="this run's is 'cuda'"):
        precision.emulate_cpu_fp16_if_asked()


@pytest.mark.precision
def test_fp16_without_deepspeed_fp16_pipeline_trains_deepspeed_engine_refused(gpt2_data):
    """On a device whose DeepSpeed accelerator has no fp16: a pipeline run trains in fp16 (the
    project's step scales the loss itself; DeepSpeed's engine takes no part), while
    ``--deepspeed`` at pp 1 (DeepSpeed's engine steps) is refused on every rank, quickly."""
    from gpt2_runs import error_with_precision_support
    from harness import run_distributed

    base = gpt2_argv(gpt2_data, "--batch-size", "2", "--train-iters", "2", "--fp16")
    pipeline = run_distributed(error_with_precision_support, 2,
                               base + ["--pipe-parallel-size", "2"], fp16=False, bf16=True,
                               timeout=120, env=NO_NATIVE)
    assert pipeline == [None, None], pipeline
    start = time.monotonic()
    messages = run_distributed(error_with_precision_support, 2, base + ["--deepspeed"],
                               fp16=False, bf16=True, timeout=60, env=NO_NATIVE)
    assert time.monotonic() - start < 60
    assert all(m and "--fp16 is not supported by DeepSpeed on this device" in m
               and "--bf16" in m for m in messages), messages


# ---------------------------------------------------------------- kill -9 during a save
# A run killed at one moment of its second save (iteration 4; the first is iteration 2).
# The moments: while the model file is being written; with every file written but not yet
# moved into place; with the folder in place but the tracker not yet rewritten; with the new
# tracker written under its temporary name only.
_KILL_AT_SAVE = r'''
import os, signal, sys
import torch
import megatron.checkpoint.format as fmt
import megatron.training.checkpointing as ck

moment, argv = sys.argv[1], sys.argv[2:]
saves = []
die = lambda: os.kill(os.getpid(), signal.SIGKILL)
SECOND = 4  # the second save's iteration: with --async-save the first one's writer may still
            # be publishing when the second save is called, so the moments key on it

def second(fn, before=True):
    def wrapped(*args, **kwargs):
        if before and args[-1] == SECOND:
            die()
        out = fn(*args, **kwargs)
        if not before and args[-1] == SECOND:
            die()
        return out
    return wrapped

real_save, real_atomic = ck.save_checkpoint, fmt.write_atomic
def counting_save(*args, **kwargs):
    saves.append(1)
    return real_save(*args, **kwargs)
ck.save_checkpoint = counting_save
import megatron.training.loop
megatron.training.loop.save_checkpoint = counting_save

if moment == "model_file":
    real_torch_save = torch.save
    def half_save(obj, f, *a, **k):
        real_torch_save(obj, f, *a, **k)
        path = getattr(f, "name", f)  # the file object that hashes the bytes names its file
        if f"iter_{SECOND:07d}" in str(path):
            with open(path, "r+b") as f:
                f.truncate(os.path.getsize(path) // 2)
            die()
    torch.save = half_save
elif moment == "before_publish":
    ck.publish_iteration = second(ck.publish_iteration)
elif moment == "before_tracker":
    fmt.write_tracker = second(fmt.write_tracker)
elif moment == "tracker_tmp":
    def tracker_tmp(path, write):
        if path.endswith(fmt.TRACKER_FILENAME) and len(saves) == 2:
            write(path + ".tmp-" + os.uname().nodename + "-" + str(os.getpid()))
            die()
        return real_atomic(path, write)
    fmt.write_atomic = tracker_tmp
sys.argv = ["pretrain_gpt2.py", *argv]
import pretrain_gpt2
pretrain_gpt2.main(argv)
'''


@pytest.fixture(scope="module")
def uninterrupted(gpt2_data, tmp_path_factory):
    """Losses of an uninterrupted 4-step run (log every step)."""
    result = _run(_tiny(gpt2_data, "--log-interval", "1", "--hidden-dropout", "0",
                        "--attention-dropout", "0", iters="4"))
    assert result.returncode == 0, result.stderr[-3000:]
    return re.findall(r"lm loss: (\S+)", result.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("moment", [  # two moments in the default run, the four exhaustive
    "model_file", pytest.param("before_publish", marks=pytest.mark.exhaustive),
    pytest.param("before_tracker", marks=pytest.mark.exhaustive), "tracker_tmp"])
def test_kill_during_save_then_resume(gpt2_data, tmp_path, uninterrupted, moment):
    import subprocess
    import sys

    from gpt2_runs import REPO

    ckpt = str(tmp_path / "ckpt")
    argv = gpt2_argv(gpt2_data, "--batch-size", "2", "--train-iters", "4", "--log-interval",
                     "1", "--hidden-dropout", "0", "--attention-dropout", "0", "--save", ckpt,
                     "--save-interval", "2")
    killed = subprocess.run([sys.executable, "-c", _KILL_AT_SAVE, moment, *argv], cwd=REPO,
                            capture_output=True, text=True, timeout=240,
                            env=dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1",
                                     **NO_NATIVE))
    assert killed.returncode == -9, killed.stderr[-3000:]
    with open(os.path.join(ckpt, TRACKER)) as handle:
        assert handle.read() == "2"  # the tracker never points at the interrupted save
    resumed = _run(_tiny(gpt2_data, "--log-interval", "1", "--hidden-dropout", "0",
                         "--attention-dropout", "0", "--load", ckpt, "--save", ckpt, iters="4"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert re.findall(r"lm loss: (\S+)", resumed.stdout) == uninterrupted[2:]
    with open(os.path.join(ckpt, TRACKER)) as handle:
        assert handle.read() == "4"
    # leftovers of the killed writer are gone or unreachable: only complete checkpoints
    # are published, and a stale temporary tracker was swept by the next save
    assert sorted(d for d in os.listdir(ckpt) if d.startswith("iter_")) == \
        ["iter_0000002", "iter_0000004"]
    assert not [f for f in os.listdir(ckpt) if ".tmp-" in f]


# ---------------------------------------------------------------- kill -9 of one rank
_KILL_ONE_RANK = r'''
import os, signal, sys
import megatron.training.loop as training

real_step = training.train_step
calls = []
def step(*args, **kwargs):
    calls.append(1)
    if len(calls) == 3 and os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    return real_step(*args, **kwargs)
training.train_step = step
import pretrain_gpt2
from megatron.common.errors import run_main
run_main(pretrain_gpt2.main, sys.argv[1:])
'''


def test_kill_one_rank_ends_the_run(gpt2_data, tmp_path):
    script = tmp_path / "kill_one_rank.py"
    script.write_text(_KILL_ONE_RANK)
    ckpt = str(tmp_path / "ckpt")
    result = _run([str(script), *gpt2_argv(gpt2_data, "--batch-size", "2", "--train-iters",
                                           "50", "--save", ckpt, "--save-interval", "2")],
                  nproc=2, env={"PYTHONPATH": os.path.dirname(os.path.dirname(__file__))})
    assert result.returncode != 0 and result.seconds < 60, result.stderr[-3000:]
    assert "exitcode  : -9" in result.stderr, result.stderr[-3000:]  # the killed rank
    # the survivor says why in one line (unless torchrun's SIGTERM came first)
    assert "[rank0]: Traceback" not in result.stderr, result.stderr[-3000:]
    assert "[rank 0] error: another rank stopped" in result.stderr or \
        "exitcode  : -15" in result.stderr, result.stderr[-3000:]
    with open(os.path.join(ckpt, TRACKER)) as handle:
        assert handle.read() == "2"
    assert os.listdir(os.path.join(ckpt, ".tmp")) == []


# ---------------------------------------------------------------- divergence bookkeeping
@pytest.mark.parametrize("bad_loss_at, bad_norm_at, skipped_at, expected", [
    (9, None, None, ("loss is not finite at iteration 9", 7)),     # weights of 8 made it
    (None, 9, None, ("gradient norm is not finite at iteration 9", 8)),
    (9, 8, None, ("gradient norm is not finite at iteration 8", 7)),  # the first one wins
    (None, 9, 9, None),                               # --skip-nonfinite-steps skipped it
])
def test_divergence_names_the_newest_good_checkpoint(tmp_path, bad_loss_at, bad_norm_at,
                                                     skipped_at, expected):
    import torch

    from megatron.training.checkpointing import read_tracker, write_tracker
    from megatron.config import saved_run_config
    from megatron.common.errors import DivergenceError
    from megatron.training.divergence import check_pending

    save = tmp_path / "ckpt"
    for it in range(1, 10):  # saved every step up to 9 (a save made after the last check)
        (save / f"iter_{it:07d}").mkdir(parents=True)
    write_tracker(str(save), 9)
    args = saved_run_config(dict(compute_dtype=torch.float32, save=str(save), load=None))
    pending = [{"lm loss": torch.tensor(2.0 + 0.1 * it), "grad norm": 1.0,
                "skipped": it == skipped_at} for it in range(6, 11)]  # steps 6..10
    for p, it in zip(pending, range(6, 11)):
        if it == bad_loss_at:
            p["lm loss"] = torch.tensor(float("nan"))
        if it == bad_norm_at:
            p["grad norm"] = float("inf")
    if expected is None:
        check_pending(args, 10, pending)
        assert read_tracker(str(save)) == 9
        return
    with pytest.raises(DivergenceError) as info:
        check_pending(args, 10, pending)
    what, good = expected
    assert what in str(info.value)
    assert f"the newest good checkpoint is iteration {good} in {save}" in str(info.value)
    assert read_tracker(str(save)) == good
    check_pending(saved_run_config(dict(compute_dtype=torch.float16, save=str(save), load=None)),
                  10, pending)  # fp16: the loss scaler's business, not an error


def test_corrupt_index_entry_in_the_middle_fails_on_every_rank(gpt2_data, tmp_path):
    import shutil

    import numpy as np

    prefix = str(tmp_path / "corpus")
    for ext in (".bin", ".idx"):
        shutil.copy(gpt2_data["prefix"] + ext, prefix + ext)
    raw = bytearray(open(prefix + ".idx", "rb").read())
    n = int(np.frombuffer(raw, np.uint64, 1, 18)[0])
    middle = n // 2
    pointers = np.frombuffer(raw, np.int64, n, 34 + 4 * n).copy()
    pointers[middle] = 1 << 40  # far past the end; the last entry stays intact
    raw[34 + 4 * n:34 + 12 * n] = pointers.tobytes()
    open(prefix + ".idx", "wb").write(bytes(raw))
    result = _run([*_tiny(gpt2_data), "--data-path", prefix], nproc=2)
    _assert_user_error(result, f"corpus.idx: sequence {middle} is corrupt", nproc=2)
    assert sorted(os.listdir(tmp_path)) == ["corpus.bin", "corpus.idx"]  # no index cache


@pytest.mark.parametrize("flags, offered", [({}, True), ({"deepspeed": True}, False),
                                            ({"pipeline_model_parallel_size": 2}, True)])
def test_divergence_message_offers_only_what_the_backend_accepts(tmp_path, flags, offered):
    """--skip-nonfinite-steps is offered where the project's step runs (pp 1 and pipelines):
    validation refuses it where DeepSpeed's engine steps (--deepspeed at pp 1)."""
    import torch

    from megatron.config import saved_run_config
    from megatron.common.errors import DivergenceError
    from megatron.training.divergence import check_pending

    cfg = saved_run_config(dict(compute_dtype=torch.float32, save=str(tmp_path), load=None,
                                **flags))
    pending = [{"lm loss": torch.tensor(float("nan")), "grad norm": 1.0, "skipped": False}]
    with pytest.raises(DivergenceError) as info:
        check_pending(cfg, 1, pending)
    assert ("--skip-nonfinite-steps" in str(info.value)) == offered, str(info.value)
    assert "lower --lr" in str(info.value)

"""The watchdog's start-up allowance follows the checkpoint to load and ``--compile``.

Checkpoints here are real ones, written by the project's native writer (random GPT-2
weights, mp_rank folders, tracker); the expected byte counts are summed independently with
``os.path.getsize``. The watchdog itself runs in subprocesses with small numbers: a start-up
slower than the base allowance but within base + checkpoint read time finishes; one past it
is ended with status 4 and the phase named.
"""
import os
import subprocess
import sys
import time

import pytest

from gpt2_ckpt import random_checkpoint
from gpt2_runs import REPO
from megatron.checkpoint.native_writer import write_native
from megatron.config import parse_args
from megatron.common.errors import ConfigError
from megatron.resilience import startup_allowance as sa

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--batch-size", "2", "--train-iters", "10", "--lr", "1e-3",
        "--tokenizer-type", "GPT2BPETokenizer"]


def _cfg(*extra, world_size=1):
    return parse_args(BASE + list(extra), world_size=world_size, rank=0, check_files=False)


def _sizes(folder):
    """{relative path: bytes} of every file under ``folder``."""
    return {os.path.relpath(os.path.join(root, name), folder):
            os.path.getsize(os.path.join(root, name))
            for root, _, names in os.walk(folder) for name in names}


def _checkpoint(root, tp, hidden=64):
    ckpt = random_checkpoint(7, hidden=hidden, heads=4, tp=tp)
    return write_native(ckpt, str(root), tp=tp, pp=1)


def test_allowance_follows_a_real_checkpoint_and_compile(tmp_path):
    folder = _checkpoint(tmp_path / "ckpt", tp=1)
    nbytes = sum(_sizes(folder).values())
    assert nbytes > 100_000  # a real model file, not an empty folder
    run = ("--step-timeout", "2", "--load", str(tmp_path / "ckpt"))
    allowance = sa.startup_allowance(_cfg(*run))
    assert (allowance.checkpoint_bytes, allowance.checkpoint) == (nbytes, folder)
    assert allowance.base == sa.STARTUP_FLOOR_S == 300.0  # 10 x 2 s is below the floor
    assert allowance.seconds == pytest.approx(300.0 + nbytes / 100e6, rel=1e-12)
    compiled = sa.startup_allowance(_cfg(*run, "--compile"))
    assert compiled.seconds - allowance.seconds == pytest.approx(sa.COMPILE_S) == 600.0
    slow_steps = sa.startup_allowance(_cfg("--step-timeout", "60", "--load", str(tmp_path / "ckpt")))
    assert slow_steps.base == 600.0  # ten steps' worth
    line = compiled.describe()
    assert line.startswith(f"> watchdog: start-up allowance {compiled.seconds:.0f} s (300 s base")
    assert f"MB of {folder} at 100 MB/s" in line and "600 s for --compile" in line, line
    for fresh in ((), ("--load", str(tmp_path / "empty"), "--load-if-exists")):
        nothing = sa.startup_allowance(_cfg("--step-timeout", "2", *fresh))
        assert (nothing.checkpoint_bytes, nothing.seconds) == (0, 300.0), fresh


def test_a_rank_counts_its_own_shard_at_the_saved_layout_and_all_at_another(tmp_path):
    folder = _checkpoint(tmp_path / "ckpt", tp=2)
    sizes = _sizes(folder)
    shards = [sum(n for path, n in sizes.items() if path.startswith(f"mp_rank_0{tp}_000"))
              for tp in (0, 1)]
    outside = sum(n for path, n in sizes.items() if not path.startswith("mp_rank_"))
    assert len(sizes) == 3 and min(shards) > 0 and outside > 0  # two rank files, the manifest
    load = ("--step-timeout", "2", "--load", str(tmp_path / "ckpt"))
    same = sa.startup_allowance(_cfg(*load, "--model-parallel-size", "2", world_size=2))
    # its own folder, the largest to be safe, and what lies outside the rank folders
    assert same.checkpoint_bytes == max(shards) + outside
    other = sa.startup_allowance(_cfg(*load))  # tp = 1 from a tp = 2 checkpoint: both
    assert other.checkpoint_bytes == sum(shards) + outside


@pytest.mark.parametrize("fault", ["malformed", "unreadable"])
def test_a_tracker_this_rank_cannot_read_adds_nothing_and_raises_nothing(tmp_path, fault,
                                                                         monkeypatch):
    """The allowance is computed by each rank alone: a tracker it cannot read (malformed,
    permission denied) must not end this rank alone; load_checkpoint's agreed read says why
    on every rank."""
    write_native(random_checkpoint(0), str(tmp_path))
    tracker = tmp_path / "latest_checkpointed_iteration.txt"
    if fault == "malformed":
        tracker.write_text("garbage")
    else:
        def denied(root):
            raise PermissionError(13, "Permission denied", str(tracker))
        monkeypatch.setattr(sa, "read_tracker", denied)
    assert sa.checkpoint_read_bytes(str(tmp_path), 1, 1) == (0, None)


def test_the_flag_sets_the_allowance(tmp_path, capsys):
    _checkpoint(tmp_path / "ckpt", tp=1)
    load = ("--step-timeout", "2", "--load", str(tmp_path / "ckpt"))
    assert sa.startup_timeout(_cfg(*load, "--startup-timeout", "7.5", "--compile")) == 7.5
    assert "start-up allowance" not in capsys.readouterr().out
    computed = sa.startup_timeout(_cfg(*load))
    assert computed == sa.startup_allowance(_cfg(*load)).seconds > 300.0
    assert f"> watchdog: start-up allowance {computed:.0f} s" in capsys.readouterr().out
    assert sa.startup_timeout(_cfg()) is None  # no --step-timeout: no watchdog
    from megatron.resilience.watchdog import start_watchdog

    for given, expected in ((computed, computed), (None, 300.0)):  # None: the base alone
        dog = start_watchdog(_cfg(*load).faults, given)
        try:
            assert dog.timeouts == {"startup": expected, "step": 2.0, "save": 300.0,
                                    "evaluation": 300.0}
        finally:
            dog.stop()


@pytest.mark.parametrize("value", ["0", "-3", "nan", "inf"])
def test_a_bad_startup_timeout_is_refused(value):
    with pytest.raises(ConfigError) as info:
        _cfg("--step-timeout", "2", "--startup-timeout", value)
    assert f"--startup-timeout must be > 0 seconds, got {float(value)} (a finite number;" \
        in str(info.value), str(info.value)


def test_a_startup_timeout_needs_the_watchdog():
    with pytest.raises(ConfigError, match="--startup-timeout / --save-timeout need "
                                          "--step-timeout"):
        _cfg("--startup-timeout", "600")


_SLOW_STARTUP = r'''
import sys, time
from megatron.config import parse_args
from megatron.resilience import startup_allowance as sa
from megatron.resilience.watchdog import start_watchdog

load, startup = sys.argv[1], float(sys.argv[2])
sa.STARTUP_FLOOR_S, sa.STARTUP_STEPS = 0.0, 2  # small numbers: base = 2 x 0.5 s = 1 s
nbytes, _ = sa.checkpoint_read_bytes(load, 1, 1)
sa.READ_BYTES_PER_S = nbytes / 2.0  # reading this checkpoint "takes" 2 s
cfg = parse_args(%r + ["--step-timeout", "0.5", "--load", load], world_size=1, rank=0,
                 check_files=False)
limit = sa.startup_timeout(cfg)
print(f"watching from {time.time()}", flush=True)
dog = start_watchdog(cfg.faults, limit)
time.sleep(startup)             # model build, checkpoint load, first step
dog.enter("step", 1)
print("first step done", flush=True)
dog.stop()
''' % BASE


def test_watchdog_spares_a_slow_startup_within_the_allowance_and_ends_one_past_it(tmp_path):
    _checkpoint(tmp_path / "ckpt", tp=1)
    script = tmp_path / "slow_startup.py"
    script.write_text(_SLOW_STARTUP)
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    # 2 s: past the 1 s base, within base + 2 s of checkpoint; 8 s: past the 3 s allowance
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path / "ckpt"), seconds],
                              cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for seconds in ("2", "8")]
    (within_out, within_err), (past_out, past_err) = (p.communicate(timeout=60) for p in procs)
    ended = time.time()
    assert procs[0].returncode == 0, within_err[-2000:]
    assert "> watchdog: start-up allowance 3 s (1 s base + 2 s to read" in within_out
    assert "first step done" in within_out
    assert procs[1].returncode == 4, past_err[-2000:]
    assert "first step done" not in past_out
    assert "[rank 0] error: watchdog: no progress in phase 'startup' (iteration 0) for 3 s, " \
           "over its limit of 3 s" in past_err, past_err[-2000:]
    watched_from = float(past_out.split("watching from ")[1].split()[0])
    # ended at ~3 s (margin for 2 busy cores), not at its 8 s sleep's end
    assert ended - watched_from < 6.5, ended - watched_from

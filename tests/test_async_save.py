"""``--async-save``: the same losses and the same files as synchronous saves; a kill -9 at any
moment of a background write never leaves the tracker on an incomplete checkpoint; a failed
write stops the run with a clear error (tests/test_rank_faults.py)."""
import os
import re
import subprocess
import sys

import pytest
import torch

from gpt2_runs import REPO, gpt2_argv, run_script, train_gpt2
from harness import run_distributed
from test_faults import _KILL_AT_SAVE, NO_NATIVE, TRACKER

#: Settings that differ between the two runs by construction (the folder, the flag itself).
_RUN_KEYS = ("save", "async_save")


def _argv(data, *extra, iters=4):
    return gpt2_argv(data, "--batch-size", "2", "--train-iters", str(iters), "--log-interval",
                     "1", "--save-interval", "2", *extra)


def _assert_same(a, b, where):
    """Equal nested checkpoint contents: tensors bit for bit, everything else by value."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), (where, set(a) ^ set(b))
        for key in a:
            _assert_same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def _files(root):
    return sorted(os.path.relpath(os.path.join(d, f), root)
                  for d, _, names in os.walk(root) for f in names)


def test_snapshot_is_a_copy_and_refills_the_previous_one():
    from megatron.resilience.async_save import snapshot

    state = {"model": {"w": torch.randn(4, 3), "b": torch.randn(3)}, "step": 5,
             "rng": [torch.randint(0, 9, (6,)), (1.5, "x")]}
    first = snapshot(state, pin=False)
    _assert_same(first, state, "snapshot")
    state["model"]["w"].add_(1.0)  # training goes on: the snapshot must not see it
    assert not torch.equal(first["model"]["w"], state["model"]["w"])
    kept = first["model"]["w"]
    second = snapshot(state, pin=False, reuse=first)
    _assert_same(second, state, "refilled")
    assert second["model"]["w"] is kept  # the same host buffer, filled again
    state["model"]["b"] = torch.randn(5)  # a new shape gets a new buffer
    third = snapshot(state, pin=False, reuse=second)
    assert third["model"]["b"].shape == (5,) and torch.equal(third["model"]["b"],
                                                             state["model"]["b"])


@pytest.mark.slow
@pytest.mark.parametrize("layout", [(), ("--pipe-parallel-size", "2", "--gas", "2")],
                         ids=["ddp_dp2", "pipeline_engine_pp2"])
def test_async_save_gives_the_losses_and_files_of_sync_save(gpt2_data, tmp_path, layout):
    """dp 2 (DDP: one main file per save) and pp 2 (tds's engine: a main file and an
    optimizer file per stage)."""
    sync_dir, async_dir = str(tmp_path / "sync"), str(tmp_path / "async")
    sync = run_distributed(train_gpt2, 2, _argv(gpt2_data, *layout, "--save", sync_dir),
                           env=NO_NATIVE)
    asyn = run_distributed(train_gpt2, 2, _argv(gpt2_data, *layout, "--save", async_dir,
                                                "--async-save"), env=NO_NATIVE)
    assert sync[-1][0] == asyn[-1][0] and len(sync[-1][0]) == 4  # per-step losses, exactly
    assert _files(sync_dir) == _files(async_dir)
    assert "iter_0000002/mp_rank_00_000/model_optim_rng.pt" in _files(async_dir)
    with open(os.path.join(async_dir, TRACKER)) as handle:
        assert handle.read() == "4"
    for name in _files(sync_dir):
        if not name.endswith(".pt"):
            continue
        a = torch.load(os.path.join(sync_dir, name), weights_only=True)
        b = torch.load(os.path.join(async_dir, name), weights_only=True)
        args_a, args_b = a.pop("args", {}), b.pop("args", {})
        assert {k: v for k, v in args_a.items() if k not in _RUN_KEYS} == \
            {k: v for k, v in args_b.items() if k not in _RUN_KEYS}
        _assert_same(a, b, name)


#: A kill -9 while the background write of iteration 4 is still going and the training
#: thread has already run step 5 (the writer is held back until then).
_KILL_WHILE_TRAINING = r'''
import os, signal, sys, threading
import megatron.training.checkpointing as ck
import megatron.training.loop as training

argv = sys.argv[1:]
steps, step5 = [], threading.Event()
real_write, real_step = ck._write_file, training.train_step
def slow_write(path, state):
    if "iter_0000004" in path:
        step5.wait(60)
    return real_write(path, state)
def step(*args, **kwargs):
    steps.append(1)
    out = real_step(*args, **kwargs)
    if len(steps) == 5:
        step5.set()
        os.kill(os.getpid(), signal.SIGKILL)  # the writer has not written iteration 4 yet
    return out
ck._write_file, training.train_step = slow_write, step
import pretrain_gpt2
pretrain_gpt2.main(argv)
'''


@pytest.mark.slow
@pytest.mark.parametrize("moment", [  # before_tracker: also in test_faults (sync)
    "model_file", pytest.param("before_tracker", marks=pytest.mark.exhaustive),
    "while_training"])
def test_kill_during_background_write_then_resume(gpt2_data, tmp_path, moment):
    """The moments: half-way through writing the model file; files complete, folder in
    place, tracker not yet rewritten; the training thread already a step further. The
    resumed run's steps 3 and 4 must repeat the killed run's (it logged them before dying)."""
    ckpt, iters = str(tmp_path / "ckpt"), 6 if moment == "while_training" else 4
    argv = _argv(gpt2_data, "--hidden-dropout", "0", "--attention-dropout", "0", "--save",
                 ckpt, "--async-save", iters=iters)
    code = [_KILL_WHILE_TRAINING] if moment == "while_training" else [_KILL_AT_SAVE, moment]
    killed = subprocess.run([sys.executable, "-c", *code, *argv], cwd=REPO,
                            capture_output=True, text=True, timeout=240,
                            env=dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1",
                                     **NO_NATIVE))
    assert killed.returncode == -9, killed.stderr[-3000:]
    with open(os.path.join(ckpt, TRACKER)) as handle:
        assert handle.read() == "2"  # never the interrupted save
    before = re.findall(r"lm loss: (\S+)", killed.stdout)
    assert len(before) >= 4, killed.stdout[-3000:]
    published = sorted(d for d in os.listdir(ckpt) if d.startswith("iter_"))
    # the folder of iteration 4 is in place only when the kill came after its publication
    assert published == (["iter_0000002", "iter_0000004"] if moment == "before_tracker"
                         else ["iter_0000002"])
    resumed = run_script(["pretrain_gpt2.py", *argv, "--load", ckpt], env=NO_NATIVE)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert re.findall(r"lm loss: (\S+)", resumed.stdout)[:2] == before[2:4]
    with open(os.path.join(ckpt, TRACKER)) as handle:
        assert handle.read() == str(iters)
    assert "iter_0000004/mp_rank_00_000/model_optim_rng.pt" in _files(ckpt)

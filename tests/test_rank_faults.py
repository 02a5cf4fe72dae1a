"""Faults on one rank alone (a full disk on one node, less free memory on one device, a kernel
that builds on some ranks only): every rank ends, at once, with the same clear error.

The decisions are agreed by :func:`megatron.resilience.agreement.agree`; the end-to-end cases run the
entry script under torchrun (2 ranks, tp=2, so both ranks write checkpoint files) with the
fault injected in one rank, and assert the exit codes, every rank's message, the time to
exit and what is on disk.
"""
import errno
import os
import re
import time

import pytest
import torch

from gpt2_runs import REPO, gpt2_argv, run_script
from harness import run_distributed
from test_faults import NO_NATIVE, TRACKER


# ---------------------------------------------------------------- the agreement itself
def _agree_cases():
    """Rank body (3 ranks): the outcomes of agree() for one failing rank, several, none,
    and a bug; each rank returns what it raised."""
    import torch.distributed as dist

    from megatron.resilience.agreement import agree
    from megatron.common.errors import CheckpointError

    rank, seen = dist.get_rank(), []

    def outcome(error, **kwargs):
        try:
            agree(error, "writing the files", **kwargs)
        except Exception as exc:  # what this rank raised
            return type(exc).__name__, str(exc), type(exc.__cause__).__name__
        return None

    enospc = OSError(errno.ENOSPC, "No space left on device")
    seen.append(outcome(enospc if rank == 1 else None, error_type=CheckpointError,
                        hint="free some space"))
    seen.append(outcome(f"cause {rank}" if rank != 0 else None))
    seen.append(outcome(None))
    seen.append(outcome(KeyError("bug") if rank == 2 else None))
    sub = dist.new_group([1, 2])
    seen.append(outcome("sub" if rank == 2 else None, group=sub) if rank in (1, 2) else None)
    return seen


def test_agree_raises_the_same_error_on_every_rank_naming_rank_and_cause():
    results = run_distributed(_agree_cases, 3)
    disk = ("CheckpointError", "writing the files failed on rank 1: OSError: [Errno 28] No "
            "space left on device; free some space")
    assert [r[0][:2] for r in results] == [disk] * 3
    assert results[1][0][2] == "OSError"  # the failing rank chains its own error
    # ranks with different causes are each named; the message is the same everywhere
    assert {r[1][1] for r in results} == {"writing the files failed on rank 1: cause 1; "
                                          "rank 2: cause 2"}
    assert [r[2] for r in results] == [None] * 3  # nobody failed: nobody raises
    # a bug keeps its own type and traceback where it happened; the others are told
    assert results[2][3][0] == "KeyError"
    assert results[0][3][:2] == results[1][3][:2] == (
        "MegatronError", "writing the files failed on rank 2: KeyError: 'bug'")
    # a subgroup names global ranks
    assert results[1][4][1] == results[2][4][1] == "writing the files failed on rank 2: sub"
    assert results[0][4] is None


# ---------------------------------------------------------------- a full disk on one rank
#: First in every script run here: an exit hook registered before the project's own, so it
#: runs after them (atexit is last in, first out) and says whether any process group was
#: left for interpreter finalization to destroy (the cause of the teardown abort).
_GROUPS_AT_EXIT = r'''
import atexit, os, torch.distributed as dist
# one write of the whole line: two ranks share the pipe, and print's separate writes of its
# arguments interleaved once ("...at exit:process groups left at exit: False \nFalse")
atexit.register(lambda: os.write(1, f"process groups left at exit: {dist.is_initialized()}\n"
                                    .encode()))
'''
LEFT_NONE = "process groups left at exit: False"

_RESUME = _GROUPS_AT_EXIT + r'''
import sys
import pretrain_gpt2
from megatron.common.errors import run_main
run_main(pretrain_gpt2.main, sys.argv[1:])
'''

_FULL_DISK_ON_RANK_1 = _GROUPS_AT_EXIT + r'''
import errno, os, sys
import megatron.training.checkpointing as ck

real_write = ck._write_file
def full_disk(path, state):
    if os.environ["RANK"] == "1" and "iter_0000004" in path:
        raise OSError(errno.ENOSPC, "No space left on device")
    return real_write(path, state)
ck._write_file = full_disk
import pretrain_gpt2
from megatron.common.errors import run_main
run_main(pretrain_gpt2.main, sys.argv[1:])
'''


def _tp2(data, *extra, iters):
    return gpt2_argv(data, "--model-parallel-size", "2", "--batch-size", "2", "--train-iters",
                     str(iters), "--log-interval", "1", "--hidden-dropout", "0",
                     "--attention-dropout", "0", "--eval-iters", "0", *extra)


def _assert_user_error_on_both_ranks(err):
    """torchrun's report: a user error (2), and the other rank 2 as well or stopped by
    torchrun (-15) after it printed; no traceback through the project's code."""
    codes = re.findall(r"exitcode  : (-?\d+)", err)
    assert "2" in codes and set(codes) <= {"2", "-15"}, err[-3000:]
    assert not re.search(r'File "[^"]*(/megatron/|/tds/|pretrain_gpt2\.py)', err), err[-3000:]


def _losses(text):
    return [float(x) for x in re.findall(r"lm loss: (\S+)", text)]


def _fault_run(gpt2_data, tmp_path, name, body, ckpt, mode):
    """A tp=2 run of the fault script ``body`` saving every 2 steps to ``ckpt`` (``mode``
    "async": --async-save): it ends non-zero within 60 s with the user error on both ranks.
    Returns the finished process (its stdout and stderr)."""
    script = tmp_path / name
    script.write_text(body)
    extra = ("--save", ckpt, "--save-interval", "2") + (("--async-save",) if mode == "async"
                                                         else ())
    start = time.monotonic()
    result = run_script([str(script), *_tp2(gpt2_data, *extra, iters=8)], nproc=2,
                        env=dict(NO_NATIVE, PYTHONPATH=REPO))
    seconds = time.monotonic() - start
    err = result.stderr
    assert result.returncode != 0 and seconds < 60, (result.returncode, seconds, err[-3000:])
    _assert_user_error_on_both_ranks(err)
    return result


@pytest.mark.slow
@pytest.mark.parametrize("mode", [  # sync's writer is the same, in the training thread
    pytest.param("sync", marks=pytest.mark.exhaustive), "async"])
def test_full_disk_on_one_rank_ends_every_rank_and_the_previous_checkpoint_resumes(
        gpt2_data, tmp_path, mode):
    ckpt = str(tmp_path / "ckpt")
    result = _fault_run(gpt2_data, tmp_path, "full_disk.py", _FULL_DISK_ON_RANK_1, ckpt, mode)
    err = result.stderr
    what = ("the background write of the checkpoint" if mode == "async"
            else "writing the files of the checkpoint")
    cause = (f"{what} of iteration 4 to {ckpt} failed on rank 1: OSError: [Errno 28] No "
             f"space left on device; the tracker still names the previous complete checkpoint")
    for rank in (0, 1):
        assert f"[rank {rank}] error: {cause}" in err, err[-3000:]
    with open(os.path.join(ckpt, TRACKER)) as handle:
        assert handle.read() == "2"
    assert sorted(d for d in os.listdir(ckpt) if d.startswith("iter_")) == ["iter_0000002"]
    # an error exit too (the rank torchrun stops first may not get to say it)
    assert LEFT_NONE in result.stdout and "left at exit: True" not in result.stdout, \
        result.stdout[-2000:]
    logged = _losses(result.stdout)
    # sync: stops in the save of iteration 4; async: at the step boundary after the writers
    # finished, well before the next save (iteration 6)
    assert len(logged) == 4 if mode == "sync" else 4 <= len(logged) < 6, result.stdout[-2000:]
    script = tmp_path / "resume.py"
    script.write_text(_RESUME)
    resumed = run_script([str(script), *_tp2(gpt2_data, "--load", ckpt, iters=4)], nproc=2,
                         env=dict(NO_NATIVE, PYTHONPATH=REPO))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _losses(resumed.stdout) == logged[2:4]  # exactly the steps the failed run took
    # the teardown abort's cause is gone: no group is left for finalization
    assert resumed.stdout.count(LEFT_NONE) == 2, resumed.stdout[-2000:]


# ---------------------------------------------------------------- rank 0's publication fails
_TRACKER_WRITE_FAILS_ON_RANK_0 = _GROUPS_AT_EXIT + r'''
import errno, os, sys
import megatron.checkpoint.format as fmt

real_tracker = fmt.write_tracker
def failing_tracker(root, iteration):
    if os.environ["RANK"] == "0" and iteration == 4:
        raise OSError(errno.EIO, "Input/output error")
    return real_tracker(root, iteration)
fmt.write_tracker = failing_tracker  # what publish_iteration calls, in both save paths
import pretrain_gpt2
from megatron.common.errors import run_main
run_main(pretrain_gpt2.main, sys.argv[1:])
'''


@pytest.mark.slow
@pytest.mark.parametrize("mode", [  # the default run: sync here, async for the full disk
    "sync", pytest.param("async", marks=pytest.mark.exhaustive)])
def test_publication_failing_on_rank_0_ends_every_rank_and_keeps_the_tracker(
        gpt2_data, tmp_path, mode):
    """Rank 0 alone publishes (folder renamed into place, then the tracker rewritten): its
    tracker write fails at the save of iteration 4; every rank stops with its cause."""
    ckpt = str(tmp_path / "ckpt")
    result = _fault_run(gpt2_data, tmp_path, "tracker_fails.py",
                        _TRACKER_WRITE_FAILS_ON_RANK_0, ckpt, mode)
    err = result.stderr
    cause = (f"publishing the checkpoint of iteration 4 to {ckpt} failed on rank 0: OSError: "
             f"[Errno 5] Input/output error; the tracker still names the previous complete "
             f"checkpoint")
    for rank in (0, 1):
        assert f"[rank {rank}] error: {cause}" in err, err[-3000:]
    with open(os.path.join(ckpt, TRACKER)) as handle:
        assert handle.read() == "2"
    assert os.path.isfile(os.path.join(ckpt, "iter_0000002", "mp_rank_01_000",
                                       "model_optim_rng.pt"))
    logged = _losses(result.stdout)
    # sync: stops in the save of iteration 4; async: at a step boundary before the next save
    assert len(logged) == 4 if mode == "sync" else 4 <= len(logged) < 6, result.stdout[-2000:]
    assert LEFT_NONE in result.stdout and "left at exit: True" not in result.stdout, \
        result.stdout[-2000:]


# ---------------------------------------------------------------- less memory on one rank
_SMALL_DEVICE_ON_RANK_1 = _GROUPS_AT_EXIT + r'''
import os, sys
import megatron.memory.check as check

real_free = check.free_device_memory
check.free_device_memory = lambda device: 4096 if os.environ["RANK"] == "1" else real_free(device)
import pretrain_gpt2
from megatron.common.errors import run_main
run_main(pretrain_gpt2.main, sys.argv[1:])
'''


def test_memory_check_failing_on_one_rank_ends_every_rank(gpt2_data, tmp_path):
    script = tmp_path / "small_device.py"
    script.write_text(_SMALL_DEVICE_ON_RANK_1)
    start = time.monotonic()
    result = run_script([str(script), *_tp2(gpt2_data, iters=2)], nproc=2,
                        env=dict(NO_NATIVE, PYTHONPATH=REPO))
    seconds = time.monotonic() - start
    err = result.stderr
    assert result.returncode != 0 and seconds < 60, err[-3000:]
    _assert_user_error_on_both_ranks(err)
    for rank in (0, 1):
        assert re.search(rf"\[rank {rank}\] error: the start-up memory check failed on rank 1: "
                         r"pipeline stage 0 is predicted to need [0-9.]+ GiB per GPU but the "
                         r"device has 0\.00 GiB free", err), err[-3000:]
    assert "training from iteration" not in result.stdout  # before any compute
    assert LEFT_NONE in result.stdout and "left at exit: True" not in result.stdout, \
        result.stdout[-2000:]


# ---------------------------------------------------------------- kernels on some ranks only
def _kernels_fail_on_rank_1():
    """Rank body: rank 1 cannot build the fused kernels; every rank's status after the
    start-up agreement."""
    import types

    import torch.distributed as dist

    from megatron import fused_kernels, initialize
    from megatron.fused_kernels import build

    if dist.get_rank() == 1:
        build._MODULES["cpu"] = None
        build._ERRORS["cpu"] = "g++: fatal error: no input files"
    else:  # built (a stand-in: compiling is another test's business)
        build._MODULES["cpu"] = types.SimpleNamespace(target=lambda: "x86-64")
    cfg = types.SimpleNamespace(kernels=types.SimpleNamespace(masked_softmax_fusion=True,
                                                              layernorm_fusion=True))
    initialize._load_kernels(cfg)
    status = fused_kernels.status()
    return status.layer_norm, status.masked_softmax, fused_kernels.get_module("cpu") is None


def test_kernels_built_on_some_ranks_only_are_used_on_none():
    results = run_distributed(_kernels_fail_on_rank_1, 2,
                              env={"MEGATRON_TDS_NO_FUSED_KERNELS": "0"})
    assert all(r[2] for r in results), results  # nobody uses the kernels
    assert "build failed: g++: fatal error" in results[1][0], results
    assert results[0][0] == results[0][1] and "building the fused kernels failed on rank 1: " \
        "build failed: g++: fatal error: no input files" in results[0][0], results


# ---------------------------------------------------------------- a finished run exits 0
@pytest.mark.slow
@pytest.mark.stress
def test_twenty_consecutive_tp2_runs_exit_0(gpt2_data, tmp_path):
    """The teardown abort: gloo's worker threads destroying finished work (tensors with
    Python references) during interpreter finalization; about 1 run in 30 before the fix.
    7 minutes on the shared 2-core machine at a load average of 5-9 (11 under heavier load),
    so outside the default run (``-m stress`` runs it); the default run checks the cause
    instead (no process group left at exit, above)."""
    argv = _tp2(gpt2_data, iters=1)
    for run in range(20):
        result = run_script(["pretrain_gpt2.py", *argv], nproc=2, env=NO_NATIVE)
        assert result.returncode == 0, (run, result.stderr[-3000:])
        assert "terminate called" not in result.stderr, (run, result.stderr[-3000:])

"""A stop signal (SIGTERM / SIGUSR1) to one rank: every rank saves the same iteration at the
next step boundary, exits 0 with one line saying so, and the resumed run (``--load`` =
``--save``) continues with the losses of an uninterrupted run (fp32, no dropout).

The runs go through torchrun with 2 ranks, as a user's would; one rank signals itself from
inside a step (at a known step, so "within two steps" can be asserted).
"""
import os
import re
import signal
import time

import pytest

from gpt2_runs import REPO, gpt2_argv, run_script

TRACKER = "latest_checkpointed_iteration.txt"
NO_NATIVE = {"MEGATRON_TDS_NO_FUSED_KERNELS": "1", "MEGATRON_TDS_DATA_HELPERS": "numpy"}

#: Rank 1 sends itself a signal as its 3rd step starts, and notes the time on disk.
_SIGNAL_ONE_RANK = r'''
import os, signal, sys, time
import megatron.training.loop as training

real_step = training.train_step
calls = []
def step(*args, **kwargs):
    calls.append(1)
    if len(calls) == 3 and os.environ["RANK"] == "1":
        with open(os.environ["SIGNAL_TIME_FILE"], "w") as f:
            f.write(str(time.time()))
        os.kill(os.getpid(), getattr(signal, os.environ["STOP_SIGNAL"]))
    return real_step(*args, **kwargs)
training.train_step = step
import pretrain_gpt2
from megatron.common.errors import run_main
run_main(pretrain_gpt2.main, sys.argv[1:])
'''


def _argv(data, iters, *extra):
    return gpt2_argv(data, "--batch-size", "2", "--train-iters", str(iters), "--log-interval",
                     "1", "--hidden-dropout", "0", "--attention-dropout", "0", *extra)


def _losses(text):
    return {int(i): float(x) for i, x in
            re.findall(r"iteration\s+(\d+)/.*?lm loss: ([0-9.eE+-]+)", text)}


@pytest.mark.slow
def test_sigterm_to_one_rank_saves_exits_0_and_resumes_exactly(gpt2_data, tmp_path):
    """SIGTERM (torchrun's and scancel's signal; SIGUSR1 takes the same path, see the
    in-process test below) to rank 1 of 2 as its step 3 begins."""
    from harness import run_distributed
    from gpt2_runs import train_gpt2

    script = tmp_path / "signal_one_rank.py"
    script.write_text(_SIGNAL_ONE_RANK)
    ckpt, stamp = str(tmp_path / "ckpt"), tmp_path / "signal_time"
    env = dict(NO_NATIVE, PYTHONPATH=REPO, SIGNAL_TIME_FILE=str(stamp), STOP_SIGNAL="SIGTERM")
    stopped = run_script([str(script), *_argv(gpt2_data, 6, "--save", ckpt, "--save-interval",
                                               "100", "--exit-signal-handler")],
                         nproc=2, env=env)
    ended = time.time()
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    # the signal came as step 3 began: the stop is at step 3 (within two steps), on time
    line = re.search(r"> preempted: (\w+) received by rank (\d+); stopped at iteration (\d+), "
                     r"checkpoint saved to (\S+); resume with --load", stopped.stdout)
    assert line, stopped.stdout[-3000:]
    assert line.group(1) == "SIGTERM" and line.group(2) == "1" and line.group(4) == ckpt
    at = int(line.group(3))
    assert 3 <= at <= 4, at
    assert ended - float(stamp.read_text()) < 60  # generous: 2 shared cores
    assert max(_losses(stopped.stdout)) == at  # no step ran after the agreed one
    with open(os.path.join(ckpt, TRACKER)) as handle:
        assert int(handle.read()) == at
    # one checkpoint, complete: the (single) rank folder of tp=1 x pp=1, nothing half-written
    assert sorted(os.listdir(ckpt)) == sorted([".tmp", TRACKER, f"iter_{at:07d}",
                                               "preempted.txt"])
    assert sorted(os.listdir(os.path.join(ckpt, f"iter_{at:07d}"))) == ["manifest.json",
                                                                       "mp_rank_00_000"]
    assert not os.listdir(os.path.join(ckpt, ".tmp"))
    assert (tmp_path / "ckpt" / "preempted.txt").read_text().split() == \
        ["iteration", str(at), "signal", "SIGTERM", "rank", "1"]

    # the uninterrupted reference and the resumed run (exact per-step losses from the
    # harness ranks, which start faster than torchrun's)
    full = run_distributed(train_gpt2, 2, _argv(gpt2_data, 6), timeout=240, env=NO_NATIVE)[0][0]
    later = run_distributed(train_gpt2, 2, _argv(gpt2_data, 6, "--load", ckpt, "--save", ckpt),
                            timeout=240, env=NO_NATIVE)[0][0]
    assert len(full) == 6 and len(later) == 6 - at
    for got, want in zip(later, full[at:]):
        assert abs(got - want) <= 1e-6 * abs(want), (later, full)
    with open(os.path.join(ckpt, TRACKER)) as handle:
        assert int(handle.read()) == 6


def test_exit_signal_flags_are_checked():
    from megatron.config import build_parser
    from megatron.config.validation import _faults

    args = build_parser().parse_args(["--exit-signal-handler", "--exit-signal-check-interval",
                                      "0", "--async-save", "--step-timeout", "-1"])
    args.save = None
    problems = []
    _faults(args, problems)
    text = "\n".join(problems)
    assert "--exit-signal-check-interval must be >= 1, got 0" in text
    assert "--exit-signal-handler needs --save" in text
    assert "--async-save needs --save" in text
    assert "--step-timeout must be > 0 seconds, got -1.0" in text


def test_handler_agrees_on_one_signal_in_a_single_process():
    """In one process: no signal, no stop; a signal, the stop names it and this rank; the
    previous handler is back after uninstall."""
    from megatron.resilience.preemption import PreemptionHandler

    before = signal.getsignal(signal.SIGUSR1)
    handler = PreemptionHandler(check_interval=2).install()
    try:
        assert not handler.should_stop(1) and not handler.should_stop(2)  # arms it
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.01)  # Python runs the handler between bytecodes of the main thread
        assert not handler.should_stop(3)  # not a check step
        assert handler.should_stop(4) and handler.stopped_by == ("SIGUSR1", 0)
        assert "SIGUSR1 received by rank 0; stopped at iteration 4" in \
            handler.message(4, "/ckpt")
    finally:
        handler.uninstall()
    assert signal.getsignal(signal.SIGUSR1) is before


def test_signal_during_start_up_acts_as_without_the_handler(tmp_path):
    """Before the first step ends there is nothing to save: SIGTERM ends the process."""
    import subprocess
    import sys

    code = ("import os, signal, time\n"
            "from megatron.resilience.preemption import PreemptionHandler\n"
            "handler = PreemptionHandler().install()\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n"
            "time.sleep(5)\n"
            "print('not reached')\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                            text=True, timeout=60, env=dict(os.environ, PYTHONPATH=REPO))
    assert result.returncode == -signal.SIGTERM and "not reached" not in result.stdout

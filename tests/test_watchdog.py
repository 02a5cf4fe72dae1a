"""``--step-timeout``: a rank that stops making progress ends the job, named, with stacks.

End to end: rank 1 of a 2-rank torchrun job SIGSTOPs itself as its third step begins; rank 0
blocks in that step's collective, its watchdog fires after the step timeout, names rank 1
(whose heartbeat went stale) and the phase, prints its stacks, ends the frozen rank (it is on
this host) and exits 4; torchrun then ends the job.
"""
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from gpt2_runs import REPO, gpt2_argv

NO_NATIVE = {"MEGATRON_TDS_NO_FUSED_KERNELS": "1", "MEGATRON_TDS_DATA_HELPERS": "numpy"}

_STOP_ONE_RANK = r'''
import os, signal, sys, time
import megatron.training.loop as training

real_step = training.train_step
calls = []
def step(*args, **kwargs):
    calls.append(1)
    if len(calls) == 3 and os.environ["RANK"] == "1":
        with open(os.environ["STOP_TIME_FILE"], "w") as f:
            f.write(str(time.time()))
        os.kill(os.getpid(), signal.SIGSTOP)
    return real_step(*args, **kwargs)
training.train_step = step
import pretrain_gpt2
from megatron.common.errors import run_main
run_main(pretrain_gpt2.main, sys.argv[1:])
'''

STEP_TIMEOUT = 8


@pytest.mark.slow
def test_stopped_rank_ends_the_job_within_the_timeout_named(gpt2_data, tmp_path):
    script, stamp = tmp_path / "stop_one_rank.py", tmp_path / "stop_time"
    script.write_text(_STOP_ONE_RANK)
    argv = gpt2_argv(gpt2_data, "--batch-size", "2", "--train-iters", "50", "--log-interval",
                     "1", "--step-timeout", str(STEP_TIMEOUT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--standalone", str(script), *argv]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO, STOP_TIME_FILE=str(stamp),
               **NO_NATIVE)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=240)
    finally:  # never leave a stopped rank behind
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    ended = time.time()
    assert proc.returncode != 0, err[-3000:]
    stopped_at = float(stamp.read_text())
    # the step timeout plus a margin for 2 busy cores (torchrun alone would give the frozen
    # rank 30 s more after its SIGTERM)
    within = STEP_TIMEOUT + 15
    assert ended - stopped_at < within, (ended - stopped_at, err[-3000:])
    line = re.search(r"\[rank 0\] error: watchdog: no progress in phase 'step' \(iteration "
                     r"(\d+)\) for (\d+) s, over its limit of (\d+) s; rank\(s\) \[1\] stopped "
                     r"answering", err)
    assert line, err[-3000:]
    assert int(line.group(1)) == 2 and int(line.group(3)) == STEP_TIMEOUT
    assert int(line.group(2)) >= STEP_TIMEOUT
    assert "Thread " in err and "in train_step" in err  # rank 0's stacks: stuck in the step
    assert "[rank 0] watchdog: ended frozen rank 1" in err
    assert "exitcode  : 4" in err, err[-3000:]  # torchrun's report of rank 0's status


def test_watchdog_fires_on_a_stuck_phase_only(tmp_path):
    """A subprocess whose 'save' phase outlasts its limit is ended with status 4 and a
    report; one that keeps entering new steps in time is not."""
    code = r'''
import sys, time
from megatron.resilience.watchdog import Watchdog
dog = Watchdog({"startup": 5, "step": 0.6, "save": 1.0}).start()
for i in range(6):              # steps of 0.2 s: well within 0.6 s
    time.sleep(0.2)
    dog.enter("step", i + 1)
print("steps ok", flush=True)
dog.enter("save", 6)
time.sleep(10)                  # a stuck save
print("not reached", flush=True)
'''
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                            text=True, timeout=60, env=dict(os.environ, PYTHONPATH=REPO))
    seconds = time.monotonic() - start
    assert result.returncode == 4, result.stderr[-2000:]
    assert "steps ok" in result.stdout and "not reached" not in result.stdout
    assert "[rank 0] error: watchdog: no progress in phase 'save' (iteration 6) for 1 s, " \
           "over its limit of 1 s" in result.stderr, result.stderr
    assert "in <module>" in result.stderr  # the stuck thread's stack
    assert seconds < 8  # fired after ~1 s of the save, not at the 10 s sleep's end

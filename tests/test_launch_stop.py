"""Stopping a run as people do: Ctrl-C (SIGINT) or SIGTERM to the run scripts' torchrun
(megatron/launch/torchrun.py) and to the training processes (megatron/resilience/preemption.py).

- The agent passes the first signal on and exits 0 once its workers saved and exited 0; a
  second aborts at once (130). A worker's second SIGINT ends it where it is.
- Ctrl-C during start-up is one line and status 130, no traceback.
- Through examples/run_gpt2.sh: SIGINT to the script's process group (what a terminal's
  Ctrl-C does) mid-run saves, exits 0, and the resumed run continues with the losses of an
  uninterrupted one.
"""
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from gpt2_runs import REPO
from launch_runs import finish, free_port, launch_env, log_losses

#: A stand-in worker: starts torch.distributed, arms the stop handler, then either checks
#: for a stop every 0.2 s and exits 0 on one ("check"), or never checks again ("hang").
_WORKER = r'''
import os, sys, time
import torch.distributed as dist
from megatron.resilience.preemption import PreemptionHandler
sys.stdout.reconfigure(line_buffering=True, write_through=False)  # a line is one write
dist.init_process_group("gloo")
print(f"STARTED {dist.get_rank()}", flush=True)
if sys.argv[1] == "error" and dist.get_rank() == 1:
    print("error: a bad setting", file=sys.stderr, flush=True)
    dist.destroy_process_group()
    sys.exit(2)
handler = PreemptionHandler().install()
handler.should_stop(0)  # arms it (the first step has ended)
print(f"READY {dist.get_rank()}", flush=True)
step = 0
while True:
    step += 1
    time.sleep(0.2)
    if sys.argv[1] == "check" and handler.should_stop(step):
        print(f"STOPPED {dist.get_rank()} {handler.stopped_by[0]}", flush=True)
        dist.destroy_process_group()  # as a run does at exit (docs/fault_tolerance.md)
        sys.exit(0)
'''


def _agent(tmp_path, mode, nproc=2):
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    cmd = [sys.executable, "-m", "megatron.launch.torchrun", "--nproc_per_node", str(nproc),
           "--nnodes", "1:1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
           f"127.0.0.1:{free_port()}", "--max-restarts", "2", str(script), mode]
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


class _Output:
    """Everything ``proc`` prints, read by a thread that alone owns the pipe.

    Reading lines here and then ``proc.communicate()`` would lose output: readline reads ahead
    into the pipe object's buffer, and communicate reads the raw descriptor, so the lines
    already buffered vanish (under load a stopped run's steps 4-7 did).
    """

    def __init__(self, proc):
        self.proc, self.lines = proc, []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)

    def text(self):
        return "".join(self.lines)

    def wait_for(self, pattern, count, timeout=120):
        """Wait until ``pattern`` was printed ``count`` times; the text so far."""
        deadline = time.monotonic() + timeout
        while len(re.findall(pattern, self.text())) < count:
            assert self._thread.is_alive() and time.monotonic() < deadline, self.text()[-3000:]
            time.sleep(0.05)
        return self.text()

    def finish(self, timeout):
        """Wait for the process to exit and the pipe to close; the whole text."""
        self.proc.wait(timeout=timeout)
        self._thread.join(timeout=30)
        return self.text()


def test_agent_passes_the_first_ctrl_c_on_and_exits_0(tmp_path):
    proc = _agent(tmp_path, "check")
    output = _Output(proc)
    try:
        output.wait_for(r"READY \d", 2)
        os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: the agent's process group
        text = output.finish(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, text[-3000:]
    assert "SIGINT received: the workers save at the next step boundary" in text
    assert sorted(re.findall(r"STOPPED (\d) (\w+)", text)) == [("0", "SIGINT"), ("1", "SIGINT")]
    assert "stopped on SIGINT; every worker exited 0" in text
    assert "Traceback" not in text and "SignalException" not in text, text[-3000:]


def test_a_second_ctrl_c_aborts_at_once(tmp_path):
    proc = _agent(tmp_path, "hang")
    output = _Output(proc)
    try:
        output.wait_for(r"READY \d", 2)
        os.killpg(proc.pid, signal.SIGINT)
        output.wait_for(r"SIGINT received", 1)
        time.sleep(0.5)
        second = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        text = output.finish(timeout=60)
        took = time.monotonic() - second
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGINT, text[-3000:]
    # the workers died of the second SIGINT: torchrun did not have to SIGKILL them after its
    # 30 s shutdown wait
    assert "forcefully exiting" not in text and took < 60, (took, text[-3000:])
    assert "aborted by SIGINT" in text and "Traceback" not in text, text[-3000:]
    assert "restart" not in text  # a stopped run is not restarted
    # the abort is said once, not again by torch elastic's agent and per worker
    assert "death signal" not in text and "closing signal" not in text, text[-3000:]


def test_a_user_error_is_not_restarted(tmp_path):
    """A worker exiting 2 after start-up (an input error found late): one attempt, not
    --max-restarts more, and the agent exits 2."""
    proc = _agent(tmp_path, "error")
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 2, out[-3000:]
    assert out.count("STARTED 1") == 1 and out.count("error: a bad setting") == 1, out[-3000:]
    assert "the run is not restarted" in out and "rank 1 failed (exit code 2)" in out
    assert "Traceback" not in out and "ChildFailedError" not in out, out[-3000:]


def test_failure_status_tells_user_errors_from_crashes():
    from megatron.launch.torchrun import failure_status

    assert failure_status({0: 2, 1: 2})[0] == 2
    assert failure_status({0: 2, 1: 3})[0] == 2  # rank 1 stopped because rank 0 did
    assert failure_status({0: 1, 1: 2})[0] == 1
    assert failure_status({0: -9})[0] == 1
    assert failure_status({0: -int(signal.SIGTERM), 1: 2})[0] == 2  # the agent ended rank 0
    assert failure_status({0: -int(signal.SIGTERM)})[0] == 1
    status, lines = failure_status({1: -int(signal.SIGINT)}, signal.SIGINT)
    assert status == 130 and lines == ["rank 1 failed (killed by SIGINT)"]


def _run_python(code):
    """``code`` in a fresh interpreter that imports this checkout, its output captured;
    SIGINT at its default (a suite started in the background inherits it ignored, and
    Python then never turns it into KeyboardInterrupt)."""
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=60, env=dict(os.environ, PYTHONPATH=REPO),
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def test_worker_records_the_first_ctrl_c_and_dies_on_the_second():
    code = ("import os, signal, time\n"
            "from megatron.resilience.preemption import PreemptionHandler\n"
            "h = PreemptionHandler().install()\n"
            "h.should_stop(1)\n"  # armed
            "os.kill(os.getpid(), signal.SIGINT); time.sleep(0.05)\n"
            "assert h.should_stop(2) and h.stopped_by == ('SIGINT', 0), h.stopped_by\n"
            "print('FIRST RECORDED', flush=True)\n"
            "os.kill(os.getpid(), signal.SIGINT); time.sleep(5)\n"
            "print('not reached', flush=True)\n")
    out = _run_python(code)
    assert out.returncode == -signal.SIGINT, out.stderr
    assert "FIRST RECORDED" in out.stdout and "not reached" not in out.stdout
    assert "Traceback" not in out.stderr and "KeyboardInterrupt" not in out.stderr


def test_ctrl_c_during_start_up_is_one_line_and_130():
    code = ("import os, signal, time\n"
            "from megatron.common.errors import run_main\n"
            "def main():\n"
            "    os.kill(os.getpid(), signal.SIGINT)\n"
            "    time.sleep(5)\n"
            "run_main(main)\n")
    out = _run_python(code)
    assert out.returncode == 130, out.stderr
    assert out.stderr.strip() == ("interrupted (Ctrl-C) before the first step ended: nothing to "
                                  "save"), out.stderr


@pytest.mark.slow
def test_ctrl_c_through_run_gpt2_saves_exits_0_and_resumes_exactly(gpt2_data, tmp_path):
    iters = 24
    env = launch_env(gpt2_data, tmp_path / "stop", TRAIN_ITERS=str(iters))
    proc = subprocess.Popen(["bash", "examples/run_gpt2.sh"], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    output = _Output(proc)
    try:
        output.wait_for(r"iteration\s+3/", 1, timeout=300)
        os.killpg(proc.pid, signal.SIGINT)  # the terminal's Ctrl-C: bash (exec'd: the agent)
        text = output.finish(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, text[-4000:]
    stop = re.search(r"> preempted: SIGINT received by rank \d+; stopped at iteration (\d+), "
                     r"checkpoint saved to ([^;\s]+);", text)
    assert stop and stop.group(2) == env["CHECKPOINT_PATH"], text[-4000:]
    at = int(stop.group(1))
    steps = [int(i) for i in re.findall(r"iteration\s+(\d+)/", text)]
    assert 3 <= at < iters and max(steps) == at, (at, steps)  # no step after the agreed one
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-4000:]
    assert "stopped on SIGINT; every worker exited 0" in text
    # no requeue marker after a user's stop
    assert not os.path.exists(os.path.join(env["CHECKPOINT_PATH"], "preempted.txt"))
    first = log_losses([text])
    resumed = log_losses(finish([subprocess.Popen(
        ["bash", "examples/run_gpt2.sh"], cwd=REPO, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)]))
    full = log_losses(finish([subprocess.Popen(
        ["bash", "examples/run_gpt2.sh"], cwd=REPO, text=True, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, env=launch_env(gpt2_data, tmp_path / "full",
                                                 TRAIN_ITERS=str(iters)))]))
    assert len(first) == at and len(resumed) == iters - at and len(full) == iters
    assert first + resumed == full  # the losses as printed: identical

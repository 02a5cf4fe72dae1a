"""Automatic restart at a smaller size: examples/run_gpt2.sh under torchrun's elastic agent.

Two agents on this machine act as two nodes (``NNODES=2 MIN_NODES=1``, one process each: dp
2). Once the run has saved a checkpoint, one "node" dies: its agent and its worker get
SIGKILL. The other agent's worker loses its peer and fails; the agent restarts the job on the
one node left, which resumes from the latest checkpoint at dp 1 with twice the gradient
accumulation (the global batch unchanged) and trains to the end, with nobody stepping in.
"""
import os
import re
import signal
import subprocess
import time

import pytest
import torch

from gpt2_runs import REPO
from launch_runs import free_port, launch_env

TRACKER = "latest_checkpointed_iteration.txt"
ITERS, MICRO, GLOBAL = 12, 2, 8


def _children(pid):
    """Processes whose parent is ``pid`` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    fields = handle.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry))
    return found


def _tracker(ckpt):
    try:
        with open(os.path.join(ckpt, TRACKER)) as handle:
            return int(handle.read())
    except (OSError, ValueError):
        return None


@pytest.mark.slow
def test_lost_node_restarts_at_half_the_data_parallel_size(gpt2_data, tmp_path):
    port = str(free_port())
    env = launch_env(gpt2_data, tmp_path, GPUS_PER_NODE="1", NNODES="2", MIN_NODES="1",
                     MASTER_PORT=port, mp_size="1", pp_size="1", BATCHSIZE=str(MICRO),
                     GAS=str(GLOBAL // (2 * MICRO)), TRAIN_ITERS=str(ITERS),
                     MAX_RESTARTS="2")
    env["EXTRA_ARGS"] += " --save-interval 2"
    ckpt = env["CHECKPOINT_PATH"]
    logs = [open(tmp_path / f"node{i}.log", "w") for i in (0, 1)]
    agents = []
    try:
        for i in (0, 1):  # node 0's agent hosts the rendezvous store (node 1 is the one lost)
            # 10 s for both agents (started together) to join the first round on 2 busy
            # cores; it is also how long the survivor waits for node 1 after the kill
            conf = f"last_call_timeout=10,is_host={int(i == 0)}"
            agents.append(subprocess.Popen(["bash", "examples/run_gpt2.sh"], cwd=REPO,
                                           env=dict(env, RDZV_CONF=conf),
                                           stdout=logs[i], stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 240
        while (_tracker(ckpt) or 0) < 2:  # the job has saved once
            assert time.monotonic() < deadline and agents[0].poll() is None, \
                (tmp_path / "node0.log").read_text()[-3000:]
            time.sleep(0.2)
        saved = _tracker(ckpt)
        workers = _children(agents[1].pid)
        os.kill(agents[1].pid, signal.SIGKILL)  # node 1 dies: its agent, then its worker
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        agents[0].wait(timeout=300)
    finally:
        for proc in agents:
            if proc.poll() is None:
                proc.kill()
        for handle in logs:
            handle.close()
    out = (tmp_path / "node0.log").read_text()
    assert agents[0].returncode == 0, out[-4000:]
    assert workers, "node 1's worker was not found"
    # before: dp 2; after the restart: dp 1, resumed from a checkpoint at least as new as
    # the one on disk at the kill, to the last step
    inits = re.findall(r"> initialized: world (\d+) = tp 1 x pp 1 x dp (\d+)", out)
    assert inits[0] == ("2", "2") and inits[-1] == ("1", "1"), inits
    # the restart says it goes on with fewer nodes than asked (megatron/launch/torchrun.py)
    assert re.search(r"> restart 1 of 2: \S+ waiting for 1 to 2 nodes", out), out[-3000:]
    assert "> 1 of 2 nodes joined; this is node 0: ranks 0-0 of 1 -- fewer nodes than asked " \
           "(MIN_NODES 1)" in out, out[-3000:]
    loaded = [int(x) for x in re.findall(r"> loaded checkpoint from \S+ at iteration (\d+)", out)]
    assert loaded and loaded[-1] >= saved, (loaded, saved)
    assert _tracker(ckpt) == ITERS
    final = torch.load(os.path.join(ckpt, f"iter_{ITERS:07d}", "mp_rank_00_000",
                                    "model_optim_rng.pt"), weights_only=True)
    args = final["args"]
    assert args["data_parallel_size"] == 1 and args["global_batch_size"] == GLOBAL
    assert args["gas"] == GLOBAL // MICRO  # twice the accumulation of the 2-node run
    assert final["consumed_train_samples"] == ITERS * GLOBAL  # every step a full batch
    steps = [int(x) for x in re.findall(r"iteration\s+(\d+)/", out)]
    assert steps[-1] == ITERS
    print(f"restarted at dp 1 {time.monotonic() - killed_at:.0f} s after the kill")

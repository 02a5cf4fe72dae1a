"""Helpers for tests that launch examples/run_gpt2.sh as users do (torchrun, the DeepSpeed
launcher, Slurm): the environment of a tiny run, starting it, and reading its losses."""
import os
import re
import socket
import subprocess

from gpt2_runs import REPO

LOSS = re.compile(r"iteration\s+(\d+)/.*?lm loss: ([0-9.E+-]+)")


def free_port():
    """A TCP port nobody listens on now (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_env(data, tmp_path, **overrides):
    """Environment of a tiny fp32 run_gpt2.sh run (4 processes, tp 2 x pp 2, 6 steps) on the
    gpt2_data fixture, its checkpoints, log file and TensorBoard events under ``tmp_path``;
    ``overrides`` replace any variable."""
    env = dict(os.environ, OMP_NUM_THREADS="1", GPUS_PER_NODE="4", NNODES="1", NODE_RANK="0",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), mp_size="2",
               pp_size="2", NLAYERS="2", NHIDDEN="32", NHEADS="4", SEQLEN="32",
               BATCHSIZE="2", GAS="2", TRAIN_ITERS="6", LR="5e-3", PRECISION="fp32",
               DATA_PATH=data["prefix"], VOCAB_FILE=data["vocab"], MERGE_FILE=data["merges"],
               CHECKPOINT_PATH=str(tmp_path / "ckpt"), LOG_DIR=str(tmp_path / "logs"),
               EXTRA_ARGS="--log-interval 1 --hidden-dropout 0 --attention-dropout 0 "
                          "--make-vocab-size-divisible-by 64 --split 98,2,0 --eval-iters 0")
    env.update(overrides)
    return env


def log_losses(outputs):
    """The per-iteration losses in the training logs ``outputs``, in iteration order."""
    found = {}
    for text in outputs:
        for it, loss in LOSS.findall(text):
            found[int(it)] = float(loss)
    return [found[i] for i in sorted(found)]


def launch(env):
    """Start examples/run_gpt2.sh with ``env``; returns the process (output piped)."""
    return subprocess.Popen(["bash", "examples/run_gpt2.sh"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(procs, timeout=300):
    """Wait for ``procs``; assert each exited 0; return their outputs."""
    outs = []
    for proc in procs:
        out, _ = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, out[-4000:]
        outs.append(out)
    return outs

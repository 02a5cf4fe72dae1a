"""examples/run_gpt2.sh as users run it: one node, two nodes on one machine, DeepSpeed launcher."""
import os
import re
import socket
import subprocess

import pytest

from gpt2_runs import REPO

LOSS = re.compile(r"iteration\s+(\d+)/.*?lm loss: ([0-9.E+-]+)")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(data, tmp_path, **overrides):
    env = dict(os.environ, OMP_NUM_THREADS="1", GPUS_PER_NODE="4", NNODES="1", NODE_RANK="0",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), mp_size="2",
               pp_size="2", NLAYERS="2", NHIDDEN="32", NHEADS="4", SEQLEN="32",
               BATCHSIZE="2", GAS="2", TRAIN_ITERS="6", LR="5e-3", PRECISION="fp32",
               DATA_PATH=data["prefix"], VOCAB_FILE=data["vocab"], MERGE_FILE=data["merges"],
               CHECKPOINT_PATH=str(tmp_path / "ckpt"),
               EXTRA_ARGS="--log-interval 1 --hidden-dropout 0 --attention-dropout 0 "
                          "--make-vocab-size-divisible-by 64 --split 98,2,0 --eval-iters 0")
    env.update(overrides)
    return env


def _losses(outputs):
    found = {}
    for text in outputs:
        for it, loss in LOSS.findall(text):
            found[int(it)] = float(loss)
    return [found[i] for i in sorted(found)]


def _launch(env):
    return subprocess.Popen(["bash", "examples/run_gpt2.sh"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(procs, timeout=300):
    outs = []
    for proc in procs:
        out, _ = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, out[-4000:]
        outs.append(out)
    return outs


@pytest.mark.slow
def test_two_nodes_on_one_machine_match_one_node(gpt2_data, tmp_path):
    one = _losses(_finish([_launch(_env(gpt2_data, tmp_path / "one"))]))
    port = str(_free_port())
    nodes = [_launch(_env(gpt2_data, tmp_path / "two", GPUS_PER_NODE="2", NNODES="2",
                          NODE_RANK=str(rank), MASTER_PORT=port)) for rank in (0, 1)]
    two = _losses(_finish(nodes))
    assert len(one) == 6 and one[-1] < one[0]
    assert two == one  # same layout, same seeds: identical losses


@pytest.mark.slow
def test_deepspeed_launcher_matches_torchrun(gpt2_data, tmp_path):
    # One node: the DeepSpeed launcher starts the ranks itself (a hostfile needs ssh).
    env = _env(gpt2_data, tmp_path, LAUNCHER="deepspeed")
    torchrun = _losses(_finish([_launch(_env(gpt2_data, tmp_path / "t"))]))
    assert _losses(_finish([_launch(env)])) == torchrun

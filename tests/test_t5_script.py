"""examples/run_t5.sh as users run it (torchrun, 2 CPU processes): pp_size=1, pp_size=2, and
pp_size=2 with vpp_size=2 (interleaved 1F1B, 4 chunks of one layer)."""
import math
import os
import re
import socket
import subprocess

import pytest

from t5_runs import REPO

LOSS = re.compile(r"iteration\s+(\d+)/.*?lm loss: ([0-9.E+-]+|nan|inf)")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("pp,vpp", [
    pytest.param(1, 1, marks=pytest.mark.exhaustive),
    pytest.param(2, 1, marks=pytest.mark.exhaustive), (2, 2)])  # (2, 2): pp 2 and vpp 2
def test_run_t5_sh_trains_at_pp(t5_data, tmp_path, pp, vpp):
    env = dict(os.environ, OMP_NUM_THREADS="1", GPUS_PER_NODE="2", NNODES="1", NODE_RANK="0",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), mp_size="1",
               pp_size=str(pp), vpp_size=str(vpp), NLAYERS="2", NHIDDEN="32", NHEADS="4",
               KV_HIDDEN="8", FF_HIDDEN="64", ENC_SEQLEN="32", DEC_SEQLEN="8", BATCHSIZE="2", GAS="2",
               TRAIN_ITERS="3", LR="5e-3", PRECISION="fp32", DATA_PATH=t5_data["prefix"],
               TOKENIZER_MODEL=t5_data["spm"], CHECKPOINT_PATH=str(tmp_path / "ckpt"),
               LOG_DIR=str(tmp_path / "logs"),
               EXTRA_ARGS="--log-interval 1 --make-vocab-size-divisible-by 64 "
                          "--split 98,2,0 --eval-iters 0")
    result = subprocess.run(["bash", "examples/run_t5.sh"], cwd=REPO, env=env, timeout=300,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert result.returncode == 0, result.stdout[-4000:]
    losses = {int(i): float(v) for i, v in LOSS.findall(result.stdout)}
    assert sorted(losses) == [1, 2, 3], result.stdout[-4000:]
    assert all(math.isfinite(v) and 0 < v < 20 for v in losses.values()), losses
    # dp = 2 without a pipeline; with pp_size=2 the DeepSpeed pipeline engine runs.
    assert f"tp 1 x pp {pp} x dp {2 // pp}" in result.stdout
    assert os.path.isfile(tmp_path / "ckpt" / "latest_checkpointed_iteration.txt")

"""No host-device synchronisation inside a training step on CUDA (issue 22).

The CPU tests (tests/test_step_syncs.py) count value reads and host copies with a dispatch
mode; on a GPU the device says it itself: steps N+1..2N of the real ``pretrain()`` (neither
the first, lazy step nor the last, logging one) run under
``torch.cuda.set_sync_debug_mode("error")``, which raises on any synchronising call (a value
read, a copy to the host, a host-to-device copy from pageable memory). One process at tp = 1:
torch DDP fp32 / bf16 / fp16 (fp16: the loss scaler's overflow check stays on the device), and
DeepSpeed's ZeRO-1 in fp32 / bf16 (stepped by tds.sync_free; the cases
tests/test_step_syncs.py holds on the CPU). Skipped without a CUDA device. On an H100
(2026-11-27) the DDP cases passed; the ZeRO-1 cases found DeepSpeed's norm masking copying a
host-made tensor every step (now replaced by tds.sync_free, checked on the CPU by
tests/test_sync_free.py and the CPU counter, not yet again on a GPU).
"""
import os
import subprocess
import sys

import pytest
import torch

from gpt2_runs import REPO, gpt2_argv

N = 2
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

BODY = """
import torch

import pretrain_gpt2
from megatron.training import loop

N, argv = {n}, {argv!r}
original, calls = loop.train_step, [0]


def step(*args, **kwargs):
    calls[0] += 1
    if calls[0] == N + 1:  # from the start of step N + 1 ...
        torch.cuda.set_sync_debug_mode("error")
    elif calls[0] == 2 * N + 1:  # ... to the start of the logging step
        torch.cuda.set_sync_debug_mode("default")
    return original(*args, **kwargs)


loop.train_step = step
pretrain_gpt2.main(argv)
assert calls[0] == 2 * N + 1, calls
print("NO SYNCS IN STEPS", N + 1, "TO", 2 * N)
"""


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("precision", [(), ("--bf16",), ("--fp16",),
                                       ("--deepspeed", "--zero-stage", "1"),
                                       ("--bf16", "--deepspeed", "--zero-stage", "1")],
                         ids=["fp32", "bf16", "fp16", "zero1-fp32", "zero1-bf16"])
def test_no_syncs_in_a_cuda_step(gpt2_data, precision):
    argv = gpt2_argv(gpt2_data, "--batch-size", "2", "--gas", "2", "--train-iters",
                     str(2 * N + 1), "--log-interval", "1000", "--hidden-dropout", "0",
                     "--attention-dropout", "0", *precision, seq=16)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    out = subprocess.run([sys.executable, "-c", BODY.format(n=N, argv=argv)], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "NO SYNCS" in out.stdout, out.stderr[-4000:]

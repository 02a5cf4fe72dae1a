"""No host-device synchronisation inside a training step, outside logging steps.

Each case runs the real ``pretrain()`` (pretrain_gpt2.py) for 2N + 1 steps with the log line
only at the end (``--log-interval`` large) and counts, per step, the value reads and host
copies made on the training thread (tests/sync_count.py). The syncs of the first N steps and
of the first 2N must be the same: the steps N+1..2N, neither the first (lazy start-up) nor the
last (the log line), read nothing, in this project's code or in DeepSpeed's (its ZeRO and
bf16 optimizers step through tds.sync_free; tests/test_sync_free.py shows DeepSpeed's own
step reading 3-4 values per step).
"""
import threading

import pytest
import torch

from gpt2_runs import gpt2_argv
from harness import run_distributed
from precision import requires_ds_bf16
from sync_count import SyncCounter, gpt2_step_syncs

N = 2


def _argv(data, tp, pp, dp, *extra):
    return gpt2_argv(data, "--model-parallel-size", str(tp), "--pipe-parallel-size", str(pp),
                     "--batch-size", "2", "--gas", "2", "--train-iters", str(2 * N + 1),
                     "--log-interval", "1000", "--hidden-dropout", "0",
                     "--attention-dropout", "0", *extra, seq=16)


def _check(per_rank):
    for rank, steps in enumerate(per_rank):
        assert len(steps) == 2 * N + 1, (rank, len(steps))
        first_n = sum(len(s) for s in steps[:N])
        first_2n = sum(len(s) for s in steps[:2 * N])
        assert first_2n == first_n, (rank, steps[N:2 * N])
        # the counter is live: the final (logging) step reads the losses
        assert steps[-1], rank


def test_counter_sees_value_reads_and_host_copies_on_its_thread_only():
    x = torch.randn(4, 3) + 10.0
    seen = []
    with SyncCounter() as counter:
        x.sum().item()
        float(x[0, 0])
        bool(x[0, 0] > 0)
        x.cpu()
        x.tolist()
        x.numpy()
        x.nonzero()
        y = x * 2  # no read: not counted
        thread = threading.Thread(target=lambda: seen.append(x.sum().item()))
        thread.start()
        thread.join()
    names = [name for name, _ in counter.events]
    assert len(names) == 7, names
    assert names.count("aten._local_scalar_dense.default") >= 2
    assert {"Tensor.cpu", "Tensor.tolist", "Tensor.numpy", "aten.nonzero.default"} <= set(names)
    assert torch.equal(y, x * 2) and seen  # the other thread ran, uncounted
    assert torch.Tensor.cpu is not None and x.cpu() is x  # methods restored


def test_no_syncs_ddp_tp1_fp32(gpt2_data):
    _check(run_distributed(gpt2_step_syncs, 1, _argv(gpt2_data, 1, 1, 1), timeout=300))


def test_no_syncs_ddp_tp2_bf16(gpt2_data):
    _check(run_distributed(gpt2_step_syncs, 2, _argv(gpt2_data, 2, 1, 1, "--bf16"),
                           timeout=300))


def test_no_syncs_pipeline_pp2_fp32(gpt2_data):
    _check(run_distributed(gpt2_step_syncs, 2, _argv(gpt2_data, 1, 2, 1), timeout=300))


@pytest.mark.slow
@pytest.mark.parametrize("extra", [("--fp16",), ("--sequence-parallel",)])
def test_no_syncs_ddp_tp2_other_modes(gpt2_data, extra):
    """fp16 through the DDP backend (autocast + our loss scaler, overflow handled on the
    device) and sequence parallelism."""
    _check(run_distributed(gpt2_step_syncs, 2, _argv(gpt2_data, 2, 1, 1, *extra), timeout=300))


@pytest.mark.slow
@pytest.mark.precision
@requires_ds_bf16
def test_no_syncs_pipeline_pp2_bf16(gpt2_data):
    _check(run_distributed(gpt2_step_syncs, 2, _argv(gpt2_data, 1, 2, 1, "--bf16"),
                           timeout=300))


@pytest.mark.slow
@pytest.mark.parametrize("precision", [(), pytest.param(
    ("--bf16",), marks=[pytest.mark.precision, requires_ds_bf16])])
def test_no_syncs_deepspeed_zero1(gpt2_data, precision):
    """DeepSpeed's ZeRO-1 optimizer, stepped by tds.sync_free: no read in DeepSpeed's code
    either (its own step reads the norm's validity and the clip decision, 3-4 values)."""
    _check(run_distributed(gpt2_step_syncs, 2, _argv(gpt2_data, 1, 1, 2, "--deepspeed",
                                                     "--zero-stage", "1", *precision),
                           timeout=300))

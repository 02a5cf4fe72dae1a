"""fp16 through the DDP backend with the overflow handled on the device.

A large initial loss scale (2^19) makes the first steps overflow (2 of 6 here); each is
skipped by the fused AdamW on its ``found_inf`` flag and the scale lowered on the device,
with no host read (see tests/test_step_syncs.py). The reference is the same run with the flag read on the host every
step (the previous behaviour, still used by optimizers that cannot skip on the device). The
steps skipped are counted at log time; with a log line every step both runs are the same to
the step (losses, skipped count, learning rate). With a longer log interval the LR schedule
runs ahead by the steps skipped since the last log line until that line takes them back
(docs/training.md): the counts and the final learning rate still agree.
"""
import pytest

from gpt2_runs import gpt2_argv
from harness import run_distributed

STEPS = 6


def _train(argv, on_device):
    import pretrain_gpt2
    from megatron.optimizer import MegatronOptimizer

    if not on_device:
        MegatronOptimizer.skips_on_device = property(lambda self: False)
    state = pretrain_gpt2.main(argv)
    return state.losses, state.skipped_iters, state.lr, state.loss_scale


def _argv(data, log_interval):
    return gpt2_argv(data, "--batch-size", "2", "--train-iters", str(STEPS), "--fp16",
                     "--initial-scale-power", "19", "--hysteresis", "1",
                     "--log-interval", str(log_interval), "--hidden-dropout", "0",
                     "--attention-dropout", "0", seq=16)


@pytest.mark.slow
def test_fp16_overflow_skips_on_the_device_like_the_host_path(gpt2_data):
    host = run_distributed(_train, 1, _argv(gpt2_data, 1), False)[0]
    device = run_distributed(_train, 1, _argv(gpt2_data, 1), True)[0]
    losses, skipped, lr, scale = device
    assert skipped == host[1] and 1 <= skipped < STEPS, (device, host)  # some overflowed
    assert lr == pytest.approx(host[2], rel=1e-12) and scale == host[3]
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, host[0])) < 1e-3, (losses, host)
    late = run_distributed(_train, 1, _argv(gpt2_data, 1000), True)[0]
    assert late[1] == skipped and late[2] == pytest.approx(lr, rel=1e-12) and late[3] == scale

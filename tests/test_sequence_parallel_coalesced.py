"""Sequence-parallel gradients summed over tensor-parallel ranks in one all-reduce per step.

Each rank computes a partial gradient for the replicated LayerNorm weights/biases and
row-parallel biases (it saw only its slice of the sequence). The DDP backend and tds's
pipeline engine (fp32) sum them once per step, coalesced, after the last micro-batch's
backward; before, each use in each micro-batch ran its own all-reduce. The runs here count
the all-reduces issued by the sequence-parallel gradient code per step (a wrapper around
``torch.distributed.all_reduce``) and compare the losses with a serial run; the final
weights equal to the serial run's are checked by tests/test_sequence_parallel_training.py.
"""
import sys

import pytest

from gpt2_runs import gpt2_argv, relative_error, train_gpt2
from harness import run_distributed

STEPS = 3


def _argv(data, tp, pp, dp, *extra):
    return gpt2_argv(data, "--model-parallel-size", str(tp), "--pipe-parallel-size", str(pp),
                     "--batch-size", "2", "--gas", str(4 // dp), "--train-iters", str(STEPS),
                     "--hidden-dropout", "0", "--attention-dropout", "0", *extra, seq=16)


def _count_sp_allreduces(argv):
    """Rank body: train, counting per step the all-reduces called from the sequence-parallel
    gradient code (mpu/sequence_parallel.py: the per-use backward or the coalesced sum)."""
    import torch.distributed as dist

    import pretrain_gpt2
    from megatron.training import loop

    counts, original, original_step = [], dist.all_reduce, loop.train_step

    def counting(tensor, *args, **kwargs):
        caller = sys._getframe(1).f_code
        if caller.co_filename.endswith("sequence_parallel.py") and \
                caller.co_name in ("backward", "allreduce_sequence_parallel_grads"):
            counts[-1] += 1
        return original(tensor, *args, **kwargs)

    def step(*args, **kwargs):
        counts.append(0)
        return original_step(*args, **kwargs)

    dist.all_reduce, loop.train_step = counting, step
    try:
        losses = pretrain_gpt2.main(argv).losses
    finally:
        dist.all_reduce, loop.train_step = original, original_step
    return losses, counts


@pytest.fixture(scope="module")
def serial(gpt2_data):
    return run_distributed(train_gpt2, 1, _argv(gpt2_data, 1, 1, 1), timeout=300)[0][0]


@pytest.mark.parametrize("layout", [(2, 1, 1), pytest.param((2, 1, 2), marks=pytest.mark.slow),
                                    pytest.param((2, 2, 1), marks=pytest.mark.slow)])
def test_one_coalesced_sequence_parallel_allreduce_per_step(gpt2_data, serial, layout):
    tp, pp, dp = layout
    per_rank = run_distributed(_count_sp_allreduces, tp * pp * dp,
                               _argv(gpt2_data, tp, pp, dp, "--sequence-parallel"), timeout=300)
    for rank, (losses, counts) in enumerate(per_rank):
        assert counts == [1] * STEPS, (layout, rank, counts)
        assert relative_error(losses, serial) < 1e-5, (layout, rank, losses, serial)

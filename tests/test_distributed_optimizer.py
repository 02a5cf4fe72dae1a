"""The gradient buffers and the distributed optimizer against plain PyTorch.

Reference: the same model in one process, torch's AdamW and ``clip_grad_norm_`` on the mean
loss of the whole global batch. Data-parallel ranks each take their slice of it (two
micro-batches each); the gradient buffers reduce them (all-reduce, or reduce-scatter with
the distributed optimizer), the optimizer clips (the clip binds: max norm 0.05) and steps.
Buckets of a few dozen elements make every parameter cross bucket and rank-slice
boundaries, so the distributed optimizer updates most parameters in parts on two ranks.
The optimizer's memory is measured, not computed (tests/peak_tracker.py): the bytes the
first step leaves alive (Adam's moments, made there) and the most it holds at once, replicated
against distributed.
"""
import pytest
import torch
from torch import nn

from harness import run_distributed

LR, CLIP, STEPS, MICRO = 1e-2, 0.05, 4, 2


def _model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 4))


def _deep_model(seed, width=64, depth=8):
    """Equal layers: the optimizer step's temporaries (a parameter's, or a slice's, at a
    time) stay small beside the moments of all of them."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, width, bias=False),
                         *[nn.Linear(width, width, bias=False) for _ in range(depth - 2)],
                         nn.Linear(width, 4, bias=False))


def _batches(seed, dp):
    g = torch.Generator().manual_seed(seed + 1)
    return [(torch.randn(dp * 2 * MICRO, 8, generator=g), torch.randn(dp * 2 * MICRO, 4,
                                                                      generator=g))
            for _ in range(STEPS)]


def _adam(model):
    from megatron.optimizer import get_param_groups

    return torch.optim.AdamW(get_param_groups([model], 0.1), lr=LR, weight_decay=0.1)


def _serial(seed, dp):
    model = _model(seed)
    adam = _adam(model)
    for x, y in _batches(seed, dp):
        adam.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        adam.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _data_parallel(seed, distributed, bucket_size, overlap):
    """This rank's two micro-batches of each global batch, through DataParallel and the
    project's optimizer; the final weights (all-gathered) and the optimizer's kind."""
    import torch.distributed as dist

    from megatron import mpu
    from megatron.distributed import DataParallel, DDPConfig
    from megatron.optimizer import build_optimizer

    mpu.initialize_model_parallel(1, 1)
    dp, rank = dist.get_world_size(), dist.get_rank()
    model = _model(seed)
    grads = DataParallel(model, DDPConfig(use_distributed_optimizer=distributed,
                                          overlap_grad_reduce=overlap, bucket_size=bucket_size))
    opt = build_optimizer(_adam(model), None, CLIP, False, grads)
    for x, y in _batches(seed, dp):
        opt.zero_grad()
        for mb in range(2):
            rows = slice((rank * 2 + mb) * MICRO, (rank * 2 + mb + 1) * MICRO)
            with grads.grad_sync(mb == 1):
                (nn.functional.mse_loss(model(x[rows]), y[rows]) / 2).backward()
        grads.finish_grad_sync()
        opt.step()
    grads.finish_param_sync()
    return ({k: v.detach().clone() for k, v in model.state_dict().items()},
            type(opt).__name__, len(grads.buffers[0].buckets))


@pytest.mark.parametrize("dp,distributed,bucket_size,overlap", [
    (2, False, None, False), (2, True, 12, False), (4, True, 20, True), (3, True, 10, False)])
def test_data_parallel_steps_equal_one_process(seed, dp, distributed, bucket_size, overlap):
    reference = _serial(seed, dp)
    results = run_distributed(_data_parallel, dp, seed, distributed, bucket_size, overlap)
    for rank, (weights, kind, buckets) in enumerate(results):
        assert kind == ("DistributedOptimizer" if distributed else "MegatronOptimizer")
        assert bucket_size is None or buckets >= 3, buckets  # parameters cross buckets
        for name, expected in reference.items():
            assert torch.allclose(weights[name], expected, rtol=1e-5, atol=1e-6), \
                (rank, name, (weights[name] - expected).abs().max())


def _optimizer_peak(seed, distributed):
    """Bytes the first optimizer step leaves alive (Adam's moments are made there) and the
    most it adds at once."""
    from peak_tracker import LivePeak

    from megatron import mpu
    from megatron.distributed import DataParallel, DDPConfig
    from megatron.optimizer import build_optimizer

    mpu.initialize_model_parallel(1, 1)
    model = _deep_model(seed)
    grads = DataParallel(model, DDPConfig(use_distributed_optimizer=distributed))
    opt = build_optimizer(torch.optim.AdamW(model.parameters(), lr=LR, foreach=False),
                          None, 0.0, False, grads)
    x, y = _batches(seed, 1)[0]
    nn.functional.mse_loss(model(x), y).backward()
    grads.finish_grad_sync()
    with LivePeak() as tracker:
        opt.step()
    return tracker.now - tracker.baseline, tracker.peak - tracker.baseline


@pytest.mark.parametrize("dp", [2, 4])
def test_distributed_optimizer_holds_one_dp_th_of_the_optimizer(seed, dp):
    replicated = run_distributed(_optimizer_peak, dp, seed, False)
    distributed = run_distributed(_optimizer_peak, dp, seed, True)
    for rank in range(dp):
        (state, peak), (state_1, peak_1) = distributed[rank], replicated[rank]
        assert abs(state / state_1 - 1 / dp) < 0.02 / dp, (rank, state, state_1)
        # on top, the step's own temporaries (one parameter's or slice's at a time): never
        # more than the replicated step's
        assert peak - state <= peak_1 - state_1, (rank, peak, state, peak_1, state_1)
        assert peak < peak_1 * (1 / dp + 0.25), (rank, peak, peak_1)

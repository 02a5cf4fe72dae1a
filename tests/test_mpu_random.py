"""RNG tracker streams and activation checkpointing with dropout."""
import torch
import torch.nn.functional as F

from harness import run_distributed
from megatron import mpu


def _draws(seed):
    mpu.initialize_model_parallel(2, 1)
    mpu.model_parallel_cuda_manual_seed(seed)
    tracker = mpu.get_cuda_rng_tracker()
    outside = torch.rand(8)
    with tracker.fork():
        inside = torch.rand(8)
    with tracker.fork():
        inside_next = torch.rand(8)  # the stream advances across forks
    after = torch.rand(8)            # ... and the default stream is untouched by them
    return outside, inside, inside_next, after


def test_tracker_streams(seed):
    results = run_distributed(_draws, 4, seed)
    (o0, i0, n0, a0), (o1, i1, n1, a1) = results[0], results[1]
    # Outside the fork every tp rank draws the same numbers ...
    assert torch.equal(o0, o1) and torch.equal(a0, a1)
    # ... inside it they differ, and a stream does not repeat itself.
    assert not torch.equal(i0, i1) and not torch.equal(n0, n1)
    assert not torch.equal(i0, n0)
    # The default stream continues as if the forks had not happened.
    g = torch.Generator().manual_seed(seed)
    torch.rand(8, generator=g)
    assert torch.equal(a0, torch.rand(8, generator=g))
    # Data-parallel replicas (ranks 2, 3) draw the same as their tp peers (same seed).
    assert torch.equal(results[2][1], i0) and torch.equal(results[3][1], i1)


class _Block(torch.nn.Module):
    """Two linears with dropout on both streams, as in a transformer layer."""

    def __init__(self):
        super().__init__()
        self.fc1 = mpu.ColumnParallelLinear(16, 32, gather_output=False)
        self.fc2 = mpu.RowParallelLinear(32, 16, input_is_parallel=True)

    def forward(self, x, mask):
        h, _ = self.fc1(x)
        with mpu.get_cuda_rng_tracker().fork():
            h = F.dropout(F.gelu(h), p=0.3, training=True)  # split activation
        out, _ = self.fc2(h)
        return F.dropout(out, p=0.3, training=True) * mask  # replicated activation


def _grads(block, x, mask, seed, recompute):
    mpu.model_parallel_cuda_manual_seed(seed + 1)
    block.zero_grad()
    x = x.clone().requires_grad_()
    out = 0
    for _ in range(2):  # two blocks in a row, the RNG advancing between them
        out = out + (mpu.checkpoint(block, x, mask) if recompute else block(x, mask))
    (out * torch.arange(out.numel()).view_as(out)).sum().backward()
    return [x.grad] + [p.grad.clone() for p in block.parameters()], out.detach()


def _checkpoint_equivalence(tp, seed):
    mpu.initialize_model_parallel(tp, 1)
    mpu.model_parallel_cuda_manual_seed(seed)
    block = _Block()
    x = torch.randn(4, 3, 16)
    mask = (torch.rand(4, 3, 1) > 0.2).float()
    plain, out_plain = _grads(block, x, mask, seed, recompute=False)
    again, out_again = _grads(block, x, mask, seed, recompute=True)
    bit_identical = all(torch.equal(a, b) for a, b in zip(plain, again))
    # Different seeds give different masks, so equality above is not vacuous.
    other, _ = _grads(block, x, mask, seed + 7, recompute=True)
    return bit_identical, torch.equal(out_plain, out_again), torch.equal(plain[0], other[0])


def test_checkpoint_with_dropout_gives_bit_identical_grads(seed):
    for tp in (1, 2):
        for identical, same_out, same_as_other_seed in run_distributed(
                _checkpoint_equivalence, tp, tp, seed):
            assert identical and same_out
            assert not same_as_other_seed

"""The NCCL branch of sequence parallelism's column-linear backward, on CPU (issue 36).

``_LinearWithSequenceParallelGather.backward`` (megatron/mpu/sequence_parallel_linear.py)
overlaps its two collectives with its two GEMMs as Megatron-LM does: the all-gather of the
saved shard runs under the input-gradient GEMM, the reduce-scatter of the input gradient
under the weight-gradient GEMM. Only NCCL takes that path (gloo has no reduce-scatter), so
here two gloo ranks play NCCL: the module sees ``get_backend() == "nccl"``, its all-gather
and ``reduce_scatter_tensor`` are gloo's asynchronous collectives behind handles that log
their launch and their wait (the reduce-scatter is an async all-reduce whose slice lands in
the output at ``wait()``, so reading it early reads garbage), and a dispatch mode logs
every GEMM. The test checks the order (launch, GEMM, wait; twice), that each collective
carries what it should, and that the gradients equal the gloo path's and those of one
plain ``F.linear`` over the whole sequence.
"""
import random

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from harness import run_distributed

S, B, IN, OUT = 8, 3, 16, 12  # per-rank OUT (column-parallel), whole sequence S


class _Log(TorchDispatchMode):
    """Logs each GEMM the backward runs, with its output shape."""

    def __init__(self, events):
        super().__init__()
        self.events = events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default,
                    torch.ops.aten.addmm.default):
            self.events.append(("gemm", tuple(out.shape)))
        return out


class _Handle:
    def __init__(self, name, work, events, finish=None):
        self.name, self.work, self.events, self.finish = name, work, events, finish

    def wait(self):
        self.work.wait()
        if self.finish is not None:
            self.finish()
        self.events.append((self.name, "wait"))
        return True


class _FakeNccl:
    """``torch.distributed`` for the module under test: NCCL by name, gloo underneath."""

    def __init__(self, events):
        self.events = events

    def __getattr__(self, name):
        return getattr(dist, name)

    def get_backend(self, group=None):
        return "nccl"

    def reduce_scatter_tensor(self, output, input_, group=None, async_op=False):
        assert async_op, "the backward launches its reduce-scatter asynchronously"
        summed = input_.clone()
        work = dist.all_reduce(summed, group=group, async_op=True)
        part = output.size(0)
        self.events.append(("reduce_scatter", "launch", tuple(input_.shape)))
        output.fill_(float("nan"))  # what a read before wait() would see

        def land():
            output.copy_(summed.narrow(0, dist.get_rank(group) * part, part))

        return _Handle("reduce_scatter", work, self.events, land)


def _all_gather(events, real):
    def gather(output, input_, group=None, async_op=False):
        if not async_op:  # the forward's gather
            return real(output, input_, group=group)
        events.append(("all_gather", "launch", tuple(output.shape)))
        return _Handle("all_gather", real(output, input_, group=group, async_op=True), events)
    return gather


def _grads(shard, weight, bias, grad_out):
    from megatron.mpu.sequence_parallel_linear import linear_with_sequence_parallel_gather

    shard = shard.clone().requires_grad_()
    weight, bias = weight.clone().requires_grad_(), bias.clone().requires_grad_()
    out = linear_with_sequence_parallel_gather(shard, weight, bias, group=dist.group.WORLD)
    out.backward(grad_out)
    return out.detach(), shard.grad, weight.grad, bias.grad


def _nccl_order_and_values(seed):
    """Rank body: this rank's backward under the faked NCCL branch and under gloo's, and
    the reference gradients from the whole sequence."""
    import megatron.mpu.sequence_parallel_linear as spl

    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(seed)
    full = torch.randn(S, B, IN, generator=gen)  # the same on every rank
    weights = torch.randn(world, OUT, IN, generator=gen)
    biases = torch.randn(world, OUT, generator=gen)
    grad_outs = torch.randn(world, S, B, OUT, generator=gen)
    part = S // world
    shard = full[rank * part:(rank + 1) * part]
    args = (shard, weights[rank], biases[rank], grad_outs[rank])

    gloo = _grads(*args)
    events = []
    real_dist, real_gather = spl.dist, spl._all_gather_single
    spl.dist, spl._all_gather_single = _FakeNccl(events), _all_gather(events, real_gather)
    try:
        with _Log(events):
            nccl = _grads(*args)
    finally:
        spl.dist, spl._all_gather_single = real_dist, real_gather

    # reference: one F.linear per rank over the whole sequence; the input gradient is the
    # sum over ranks of each rank's, sliced to this rank's part of the sequence
    x = full.clone().requires_grad_()
    w, b = weights.clone().requires_grad_(), biases.clone().requires_grad_()
    outs = [torch.nn.functional.linear(x, w[r], b[r]) for r in range(world)]
    torch.autograd.backward(outs, list(grad_outs))
    reference = (outs[rank].detach(), x.grad[rank * part:(rank + 1) * part], w.grad[rank],
                 b.grad[rank])
    return events, gloo, nccl, reference


def test_nccl_branch_overlaps_each_collective_with_a_gemm_and_matches_gloo():
    results = run_distributed(_nccl_order_and_values, 2, random.randrange(2**31), timeout=120)
    for rank, (events, gloo, nccl, reference) in enumerate(results):
        backward = events[next(i for i, e in enumerate(events) if e[:2] == ("all_gather",
                                                                            "launch")):]
        gemms = [e for e in backward if e[0] == "gemm"]
        expected = [("all_gather", "launch", (S, B, IN)),
                    ("gemm", (S * B, IN)),  # input gradient dY W: needs no input
                    ("all_gather", "wait"),
                    ("reduce_scatter", "launch", (S, B, IN)),
                    ("gemm", (OUT, IN)),  # weight gradient dY^T X, X the gathered input
                    ("reduce_scatter", "wait")]
        assert backward == expected, (rank, events)
        assert len(gemms) == 2, (rank, events)
        for name, got, want in zip(("output", "input grad", "weight grad", "bias grad"),
                                   nccl, gloo):
            assert torch.equal(got, want), (rank, name, "nccl branch vs gloo branch")
        for name, got, want in zip(("output", "input grad", "weight grad", "bias grad"),
                                   nccl, reference):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5,
                                       msg=f"rank {rank} {name} vs F.linear")

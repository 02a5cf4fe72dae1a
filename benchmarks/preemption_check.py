#!/usr/bin/env python
"""Cost of the per-step stop-signal agreement (``--exit-signal-handler``) against a step.

    python benchmarks/preemption_check.py [--ranks 2] [--calls 500]

Each of ``--ranks`` CPU processes (gloo) times ``--calls`` calls of
``PreemptionHandler.should_stop`` (one all-reduce of one int64 on the host group, no signal
pending: the cost paid at every step), and, in the same processes, the tiny GPT-2 layer stack
step that the test suite trains (hidden 32, 2 layers, seq 32, micro-batch 2: forward,
backward, gradient all-reduce, AdamW), the smallest step this framework runs. The ratio is
check / step; on a GPU the step is asynchronous and the check (host memory, gloo) adds no
device sync, so there it costs its latency only where the host is the bottleneck.
"""
import argparse
import os
import platform
import shlex
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _step_fn():
    """A tiny transformer step with a data-parallel gradient all-reduce (the suite's size)."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoder(
        torch.nn.TransformerEncoderLayer(32, 4, 128, dropout=0.0, batch_first=True), 2)
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-3)
    x = torch.randn(2, 32, 32)

    def step():
        opt.zero_grad()
        layer(x).square().mean().backward()
        for p in layer.parameters():
            dist.all_reduce(p.grad)
        opt.step()
    return step


def _rank(rank, world, port, calls, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.resilience.preemption import PreemptionHandler

    handler = PreemptionHandler(check_interval=1)
    handler.armed = True
    step = _step_fn()
    for i in range(20):  # warm up both
        step()
        handler.should_stop(i)
    checks, steps = [], []
    for i in range(calls):
        dist.barrier()
        start = time.perf_counter()
        stop = handler.should_stop(i)
        checks.append(time.perf_counter() - start)
        assert not stop
    for _ in range(max(20, calls // 10)):
        dist.barrier()
        start = time.perf_counter()
        step()
        steps.append(time.perf_counter() - start)
    if rank == 0:
        out.put((statistics.median(checks), statistics.median(steps)))
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--calls", type=int, default=500)
    args = parser.parse_args()
    print("command: python " + " ".join(shlex.quote(a) for a in sys.argv))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"machine: {platform.processor() or platform.machine()}, {cores} cores available, "
          f"torch {torch.__version__}, {args.ranks} gloo ranks")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args.ranks, port, args.calls, out))
             for r in range(args.ranks)]
    for p in procs:
        p.start()
    check, step = out.get(timeout=600)
    for p in procs:
        p.join()
    print(f"median stop check: {check * 1e6:.0f} us; median tiny step: {step * 1e3:.2f} ms; "
          f"check / step = {check / step:.4f}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""When ``--overlap-grad-reduce`` starts each bucket's reduction, against the backward.

    python benchmarks/grad_reduce_overlap.py [--layers 12 --width 1024 --bucket-layers 2]

Two data-parallel ranks (gloo on the CPU, torch.distributed on one machine) train a stack of
``--layers`` linear layers (``--width`` square, GeLU between) through megatron's
``DataParallel`` with buckets of ``--bucket-layers`` layers, one backward per step. Per step,
on rank 0: the backward's start, the moment each bucket's reduction is launched (the
bucket's ``start_reduce``, called from the parameters' post-accumulate-grad hooks), the
backward's last op (the first layer's weight gradient: the last one autograd produces) and
the end of ``finish_grad_sync`` (every reduction waited for). The same step without the
flag is timed in the same run (every bucket launched after the backward). What is claimed
is the order (buckets launched while the backward still runs) and the ratio of the two step
times on this machine; CPU timings are no GPU figure.
"""
import argparse
import os
import shlex
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from benchmarks.machine import cpu_model  # noqa: E402
sys.path.insert(0, os.path.join(REPO, "tests"))


def machine():
    import torch

    model = cpu_model()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{model}, {cores} cores available, {gpu}, torch {torch.__version__}"


def _both(args):
    """Rank body: :func:`_steps` without the flag, then with it, in this process."""
    return {overlap: _steps(args, overlap) for overlap in (False, True)}


def _steps(args, overlap):
    """Per step the event times (seconds from the backward's start)."""
    import torch
    from torch import nn

    from megatron import mpu
    from megatron.distributed import DataParallel, DDPConfig
    from megatron.distributed import grad_buffer

    torch.set_num_threads(1)
    if not mpu.model_parallel_is_initialized():
        mpu.initialize_model_parallel(1, 1)
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.width, args.width), nn.GELU()]
    model = nn.Sequential(*layers)
    per_layer = args.width * (args.width + 1)
    grads = DataParallel(model, DDPConfig(overlap_grad_reduce=overlap,
                                          bucket_size=args.bucket_layers * per_layer))
    launches, marks = [], {}
    start_reduce = grad_buffer.GradBuffer.start_reduce

    def timed_start(self, bucket):
        if bucket.work is None:
            launches.append(time.perf_counter())
        return start_reduce(self, bucket)

    grad_buffer.GradBuffer.start_reduce = timed_start
    model[0].weight.register_post_accumulate_grad_hook(
        lambda p: marks.__setitem__("last_grad", time.perf_counter()))
    x = torch.randn(args.batch, args.width)
    steps = []
    for step in range(args.warmup + args.steps):
        grads.zero_grad()
        del launches[:]
        loss = model(x).square().mean()
        begin = time.perf_counter()
        loss.backward()
        returned = time.perf_counter()
        grads.finish_grad_sync()
        done = time.perf_counter()
        if step >= args.warmup:
            steps.append({"launches": [t - begin for t in launches],
                          "last_grad": marks["last_grad"] - begin,
                          "backward": returned - begin, "synced": done - begin,
                          "buckets": len(grads.buffers[0].buckets)})
    grad_buffer.GradBuffer.start_reduce = start_reduce
    return steps


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--bucket-layers", type=int, default=2, help="layers per bucket")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args(argv)
    from harness import run_distributed

    print("command: python benchmarks/grad_reduce_overlap.py " +
          " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])))
    print(f"machine: {machine()}; 2 data-parallel ranks, gloo")
    results = run_distributed(_both, 2, args, timeout=900)[0]
    on, off = results[True], results[False]
    first = [s["launches"][0] for s in on]
    before = [sum(t < s["last_grad"] for t in s["launches"]) for s in on]
    buckets = on[0]["buckets"]
    ms = 1000.0
    print(f"buckets: {buckets} ({args.bucket_layers} layers of {args.width}x{args.width} each); "
          f"median over {args.steps} steps, ms from the backward's start:")
    print(f"  overlap on : first bucket launched {statistics.median(first) * ms:.1f}, backward's "
          f"last op {statistics.median(s['last_grad'] for s in on) * ms:.1f}, buckets "
          f"launched before it {statistics.median(before):.0f} of {buckets}, all reduced "
          f"{statistics.median(s['synced'] for s in on) * ms:.1f}")
    print(f"  overlap off: first bucket launched "
          f"{statistics.median(s['launches'][0] for s in off) * ms:.1f}, backward's last op "
          f"{statistics.median(s['last_grad'] for s in off) * ms:.1f}, all reduced "
          f"{statistics.median(s['synced'] for s in off) * ms:.1f}")
    ratio = statistics.median(s["synced"] for s in on) / \
        statistics.median(s["synced"] for s in off)
    print(f"RESULT first_launch_ms={statistics.median(first) * ms:.2f} "
          f"last_grad_ms={statistics.median(s['last_grad'] for s in on) * ms:.2f} "
          f"launched_before={statistics.median(before):.0f} buckets={buckets} "
          f"backward_and_reduce_ratio={ratio:.3f}")


if __name__ == "__main__":
    main()

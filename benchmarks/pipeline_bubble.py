"""Pipeline bubble: tds's engine against the 1F1B ideal, and the schedule runner's schedules.

Each of the ``pp`` stages is one layer whose forward and backward take a fixed time
(a sleep), so the ratio reflects scheduling and communication, not the 2-core CPU.
With ``m`` micro-batches, 1F1B finishes a step in ``(m + pp - 1) * (t_f + t_b)``, i.e.
``(m + pp - 1) / m`` times the single-stage time per micro-batch multiplied by ``m``. The
baseline, the single-stage time per micro-batch, is measured in the same run (pp = 1, same
layer). Target: measured / ideal <= 1.10.

    python benchmarks/pipeline_bubble.py [--pp 4] [--micro-batches 4 8 16]

``--runner`` measures ``tds.pipe.runner`` instead: every chunk's forward sleeps
``--forward-ms`` / v and its backward twice that (ZB-H1: half each for the input and the
weight pass), so all stages cost the same; the step time of 1F1B, interleaved (v = 2, 4)
and ZB-H1 is compared with the discrete-event simulator's prediction for the same costs
and the p2p latency measured in the same run, and with 1F1B measured (the baseline).

    python benchmarks/pipeline_bubble.py --runner [--pp 4] [--micro-batches 4 8] [--steps 5]
"""
import argparse
import os
import platform
import sys
import time

import torch
from torch import nn

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
sys.path.insert(0, REPO)

FORWARD_S, BACKWARD_S = 0.020, 0.040
HIDDEN, SEQ, MICRO = 64, 16, 2


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        time.sleep(FORWARD_S)
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):
        time.sleep(BACKWARD_S)
        return grad


class FixedCostLayer(nn.Module):
    """``(hidden, mask) -> (hidden, mask)`` taking FORWARD_S / BACKWARD_S seconds."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(HIDDEN))

    def forward(self, inputs):
        hidden, mask = inputs
        return _Sleep.apply(hidden * self.scale), mask


class Head(nn.Module):
    def forward(self, inputs):
        return inputs[0]


def _loss(output, labels):
    return (output.float() - labels).pow(2).mean()


def _batch_fn(raw):
    hidden = torch.randn(SEQ, MICRO, HIDDEN)
    return (hidden, torch.ones(SEQ, MICRO, dtype=torch.bool)), torch.zeros(SEQ, MICRO, HIDDEN)


def _time_steps(pp, micro_batches, steps=3):
    import tds as deepspeed
    from megatron import mpu
    from tds.pipe import LayerSpec, PipelineModule, PipeModelDataParallelTopology

    mpu.initialize_model_parallel(1, pp)
    deepspeed.init_distributed(dist_backend="gloo")
    layers = [LayerSpec(FixedCostLayer) for _ in range(pp)] + [LayerSpec(Head)]
    model = PipelineModule(layers=layers, loss_fn=_loss, partition_method="type:FixedCostLayer",
                           topology=PipeModelDataParallelTopology(num_pp=pp, num_mp=1, num_dp=1))
    model._input_type, model._input_grad = ["float", "bool"], [True, False]
    model._input_pipe_partitioned = [False, False]
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": micro_batches,
              "train_batch_size": MICRO * micro_batches, "steps_per_print": 10**9,
              "gradient_clipping": 0.0}
    engine, *_ = deepspeed.initialize(model=model, config=config, batch_fn=_batch_fn,
                                      optimizer=torch.optim.SGD(model.parameters(), lr=0.0))
    data = iter(lambda: None, 1)  # endless Nones; the batch function makes the tensors
    engine.train_batch(data)  # warmup (also learns the stage shapes)
    start = time.perf_counter()
    for _ in range(steps):
        engine.train_batch(data)
    return (time.perf_counter() - start) / steps


class SleepChunks:
    """Runner callbacks whose chunks only sleep: forward forward_s / v, backward 2x that."""

    def __init__(self, vpp, forward_s):
        self.forward_s, self.backward_s = forward_s / vpp, 2 * forward_s / vpp
        self.hidden = torch.zeros(SEQ, MICRO, HIDDEN)

    def load(self, mb):
        return (self.hidden,)

    def forward(self, chunk, mb, inputs):
        time.sleep(self.forward_s)
        return (inputs[0].detach(),)

    def backward(self, chunk, mb, output_grads):
        time.sleep(self.backward_s)
        return (self.hidden,)

    def backward_input(self, chunk, mb, output_grads):
        time.sleep(self.backward_s / 2)
        return (self.hidden,)

    def backward_weight(self, chunk, mb):
        time.sleep(self.backward_s / 2)


def _p2p_latency(pp, repeats=50):
    """Seconds per one-way message of the stage tuple (ping-pong between ranks 0 and 1)."""
    import torch.distributed as dist

    buf = torch.zeros(SEQ, MICRO, HIDDEN)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        if dist.get_rank() == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        elif dist.get_rank() == 1:
            dist.recv(buf, 0)
            dist.send(buf, 0)
    elapsed = (time.perf_counter() - start) / (2 * repeats)
    dist.barrier()
    return elapsed


def _time_runner(pp, cases, steps, forward_s):
    """On every rank: per (schedule, v, m), the wall time of each step (after one warm-up)."""
    import torch.distributed as dist
    from pipeline_simulator import build
    from tds.pipe.contract import StageContract
    from tds.pipe.p2p import StageLink
    from tds.pipe.runner import Boundary, ScheduleRunner

    groups = [dist.new_group([r]) for r in range(pp)]
    link = StageLink(groups[dist.get_rank()], torch.device("cpu"))
    boundary = Boundary(StageContract.build(["float"], [True], None),
                        (((SEQ, MICRO, HIDDEN), torch.float32),))
    latency = _p2p_latency(pp)
    times, overhead = {}, {}
    for name, vpp, m in cases:
        runner = ScheduleRunner(build(name, pp, vpp, m), vpp, m, list(range(pp)), link,
                                boundary)
        for cost, out in ((forward_s, times), (0.0, overhead)):
            chunks, per_step = SleepChunks(vpp, cost), []
            for _ in range(steps + 1):
                dist.barrier()
                start = time.perf_counter()
                runner.run(chunks)
                per_step.append(time.perf_counter() - start)
            out[(name, vpp, m)] = per_step[1:]
    return latency, times, overhead


def runner_main(args):
    from harness import run_distributed
    from pipeline_simulator import Costs, build, formula, simulate

    cases = [(name, vpp, m) for m in args.micro_batches
             for name, vpp in (("1f1b", 1), ("interleaved", 2), ("interleaved", 4),
                               ("zb-h1", 1))]
    forward_s = args.forward_ms / 1e3
    per_rank = run_distributed(_time_runner, args.pp, args.pp, cases, args.steps, forward_s,
                               timeout=600)
    latency = per_rank[0][0]
    print(f"p2p latency (one message, ping-pong): {latency * 1e3:.2f} ms; {args.steps} steps "
          f"per schedule after one warm-up; step time = slowest rank")
    print(f"{'schedule':>11} {'v':>2} {'m':>3} {'measured ms':>11} {'+-sd':>5} "
          f"{'sleep 0':>7} {'predicted':>9} {'meas/pred':>9} {'bubble':>6} {'pred':>5} "
          f"{'formula':>7} {'/1F1B meas':>10} {'/1F1B pred':>10}")
    base = {}
    for name, vpp, m in cases:
        mean, sd = _step_stats([rank[1][(name, vpp, m)] for rank in per_rank])
        idle, _ = _step_stats([rank[2][(name, vpp, m)] for rank in per_rank])
        costs = Costs(forward_s, 2 * forward_s, forward_s, forward_s, latency)
        predicted = simulate(build(name, args.pp, vpp, m), vpp, costs).step_time
        if name == "1f1b":
            base[m] = (mean, predicted)
        work = 3 * forward_s * m  # one rank's sleeping per step
        print(f"{name:>11} {vpp:>2} {m:>3} {mean * 1e3:>11.1f} {sd * 1e3:>5.1f} "
              f"{idle * 1e3:>7.1f} {predicted * 1e3:>9.1f} {mean / predicted:>9.3f} "
              f"{1 - work / mean:>6.3f} {1 - work / predicted:>5.3f} "
              f"{formula(name, args.pp, vpp, m):>7.3f} "
              f"{mean / base[m][0]:>10.3f} {predicted / base[m][1]:>10.3f}")
    print("sleep 0: the same schedule with zero-cost chunks (p2p and Python overhead only); "
          "predicted: simulator, same costs and the measured latency; bubble = 1 - sleeping "
          "time / step time (measured, predicted, textbook formula)")


def _step_stats(per_rank_steps):
    """Mean and standard deviation over steps of the slowest rank's time per step."""
    steps = [max(times) for times in zip(*per_rank_steps)]
    mean = sum(steps) / len(steps)
    return mean, (sum((s - mean) ** 2 for s in steps) / max(len(steps) - 1, 1)) ** 0.5


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=None)
    parser.add_argument("--runner", action="store_true",
                        help="time tds.pipe.runner's schedules against the simulator")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--forward-ms", type=float, default=40.0,
                        help="--runner: forward sleep of a whole stage (backward: twice)")
    args = parser.parse_args()
    from harness import run_distributed

    forward_ms, backward_ms = (args.forward_ms, 2 * args.forward_ms) if args.runner else \
        (FORWARD_S * 1e3, BACKWARD_S * 1e3)
    print(f"command: python {' '.join(sys.argv)}")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}; stages sleep {forward_ms:.0f} ms forward, "
          f"{backward_ms:.0f} ms backward")
    if args.runner:
        args.micro_batches = args.micro_batches or [4, 8]
        return runner_main(args)
    args.micro_batches = args.micro_batches or [4, 8, 16]
    single = run_distributed(_time_steps, 1, 1, 4, timeout=300)[0] / 4
    print(f"baseline: single stage, per micro-batch: {single * 1e3:.1f} ms "
          f"(fixed cost {(FORWARD_S + BACKWARD_S) * 1e3:.0f} ms)")
    print(f"{'pp':>3} {'m':>4} {'measured ms':>12} {'ideal ms':>10} {'ratio':>7}")
    worst = 0.0
    for m in args.micro_batches:
        measured = max(run_distributed(_time_steps, args.pp, args.pp, m, timeout=600))
        ideal = (m + args.pp - 1) / m * single * m
        worst = max(worst, measured / ideal)
        print(f"{args.pp:>3} {m:>4} {measured * 1e3:>12.1f} {ideal * 1e3:>10.1f} "
              f"{measured / ideal:>7.3f}")
    print(f"worst ratio {worst:.3f} (target <= 1.10): {'met' if worst <= 1.10 else 'NOT met'}")


if __name__ == "__main__":
    main()

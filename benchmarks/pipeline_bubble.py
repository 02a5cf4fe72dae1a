"""Pipeline bubble of tds's engine: measured step time against the 1F1B ideal.

Each of the ``pp`` stages is one layer whose forward and backward take a fixed time
(a sleep), so the ratio reflects scheduling and communication, not the 2-core CPU.
With ``m`` micro-batches, 1F1B finishes a step in ``(m + pp - 1) * (t_f + t_b)``, i.e.
``(m + pp - 1) / m`` times the single-stage time per micro-batch multiplied by ``m``. The
baseline, the single-stage time per micro-batch, is measured in the same run (pp = 1, same
layer). Target: measured / ideal <= 1.10.

    python benchmarks/pipeline_bubble.py [--pp 4] [--micro-batches 4 8 16]
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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16])
    args = parser.parse_args()
    from harness import run_distributed

    print(f"command: python {' '.join(sys.argv)}")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}; layers sleep {FORWARD_S * 1e3:.0f} ms forward, "
          f"{BACKWARD_S * 1e3:.0f} ms backward")
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

#!/usr/bin/env python
"""The MoE layer's step (forward + backward) on the CPU against a dense FFN of the same active
FLOPs, and the share of the step the dispatch takes.

    python benchmarks/moe_layer.py [--hidden 256] [--ffn 512] [--experts 8] [--topk 2] \\
        [--tokens 2048] [--dtype bf16] [--repeats 15]

In one process, one rank (ep 1: the dispatch is the sort by expert, the gather of the rows
and the weighted combine; no all-to-all), the same tokens each time:

- dense: ``h -> topk x ffn -> h`` (GeLU, no bias): the FLOPs a token's k experts do;
- moe grouped / moe loop: mpu.moe.MoELayer (top-k softmax router, dropless) with
  ``torch._grouped_mm`` (``--moe-grouped-gemm``) and with the per-expert loop;
- moe capacity 1.25: the static form (``[E, C, h]`` buffers, batched GEMM);
- dispatch share: the same layer with each expert's GEMMs replaced by a copy of its rows,
  over the full layer's step (router, sort, gather, combine and their backward).

Medians of ``--repeats`` rounds after 3 warm-up rounds, each round running every variant once
in a rotating order (a shared machine's load then slows all alike); ratios against dense from
the same run.
Absolute CPU times are not quoted in the docs (a GPU's come from the GPU issue).
"""
import argparse
import os
import shlex
import statistics
import sys
import time

import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from benchmarks.machine import cpu_model  # noqa: E402


def machine():
    model = cpu_model()
    return f"{model}, {torch.get_num_threads()} threads, torch {torch.__version__}"


def one_step(fn, x, g, dtype):
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        out = fn(x)
    out.backward(g)
    return time.perf_counter() - start


def median_steps(fns, x, g, repeats, dtype):
    """Each variant's median step; every round runs every variant once, in a rotating order,
    so a machine whose load changes slows them all alike."""
    names = list(fns)
    times = {name: [] for name in names}
    for i in range(3 + repeats):
        order = names[i % len(names):] + names[:i % len(names)]
        for name in order:
            t = one_step(fns[name], x, g, dtype)
            if i >= 3:
                times[name].append(t)
    return {name: statistics.median(ts) for name, ts in times.items()}


class NoGemmExperts(torch.nn.Module):
    """The experts' place with no GEMM: each row copied (its gradient flows back)."""

    def forward(self, rows, sizes, sizes_host=None):
        return rows * 1.0

    def forward_padded(self, buffer):
        return buffer * 1.0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16")
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args(argv)
    from megatron.mpu import moe

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    h, f, k = args.hidden, args.ffn, args.topk
    torch.manual_seed(0)
    x = torch.randn(args.tokens, 1, h, requires_grad=True)
    g = torch.randn(args.tokens, 1, h)
    w1 = torch.nn.Parameter(torch.randn(k * f, h) * 0.02)
    w2 = torch.nn.Parameter(torch.randn(h, k * f) * 0.02)
    dense = lambda t: F.linear(F.gelu(F.linear(t, w1), approximate="tanh"), w2)  # noqa: E731

    def layer(**kw):
        torch.manual_seed(0)
        return moe.MoELayer(moe.MoEConfig(num_experts=args.experts, topk=k, hidden_size=h,
                                          ffn_hidden_size=f, **kw), layer_number=1)

    rows = {"dense FFN (topk x ffn)": dense,
            "moe, grouped GEMM": layer(grouped_gemm=True),
            "moe, per-expert loop": layer(grouped_gemm=False),
            "moe, capacity 1.25 (static)": layer(capacity_factor=1.25)}
    no_gemm = layer(grouped_gemm=True)
    no_gemm.experts = NoGemmExperts()
    times = median_steps({**rows, "no gemm": no_gemm}, x, g, args.repeats, dtype)
    dispatch = times.pop("no gemm")
    command = ["benchmarks/moe_layer.py"] + list(sys.argv[1:] if argv is None else argv)
    print(f"command: python {' '.join(shlex.quote(a) for a in command)}")
    print(f"machine: {machine()}; load average {os.getloadavg()[0]:.1f} at the end")
    print(f"shape: tokens {args.tokens}, hidden {h}, ffn {f}, experts {args.experts}, top-{k}, "
          f"{args.dtype}; forward + backward")
    base = times["dense FFN (topk x ffn)"]
    for name, t in times.items():
        print(f"  {name:32s} {t * 1e3:8.1f} ms   x{t / base:5.2f} of dense")
    grouped = times["moe, grouped GEMM"]
    print(f"  router + dispatch + combine, no expert GEMM: {dispatch * 1e3:.1f} ms = "
          f"{100 * dispatch / grouped:.0f}% of the grouped-GEMM MoE step")


if __name__ == "__main__":
    main()

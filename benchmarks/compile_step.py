#!/usr/bin/env python
"""``--compile`` on CPU: GPT2Model's training step compiled layer by layer against eager, one run.

    python benchmarks/compile_step.py [--layers 4 --hidden 64 --heads 4 --seq 64 --batch 8]

Three copies of the same GPT2Model (tp = dp = 1, same weights, fp32, AdamW) take steps in
turn, so they share the machine's noise:

- ``eager``: the model as built;
- ``compiled``: every transformer layer through ``megatron.model.compile.compile_layers``
  (what ``--compile`` does; inductor), one graph per layer;
- ``compiled, forks``: the same, with the attention modules told that the heads are split
  across ranks (``tp_size = 2``), so the attention dropout runs in a fork of the RNG tracker,
  as it does at tp > 1: the graph breaks around it (5 per layer, docs/training.md). Only
  with ``--dropout`` > 0, where the fork exists; its cost against ``compiled`` is the cost of
  those breaks and forks.

The figures are ratios of median step times to eager's in the same run (the compiled copies
are warmed up first, so compilation is not timed). Absolute CPU times are not claims.
"""
import argparse
import os
import shlex
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from gpt2_step import build_megatron, machine, make_step, megatron_loss  # noqa: E402


def build_variants(args):
    """name -> step function, three models with the same weights."""
    from megatron.model.compile import compile_layers
    from megatron.model.gpt2_model import GPT2Model

    models = {"eager": build_megatron(args)[0]}
    names = ["compiled"] + (["compiled, forks"] if args.dropout > 0 else [])
    for name in names:
        model = GPT2Model(models["eager"].config, args.vocab, args.seq)
        model.load_state_dict(models["eager"].state_dict())  # the same weights
        if name.endswith("forks"):
            for layer in model.transformer.layers:
                # the tp > 1 RNG path at tp = 1: attention dropout in a tracker fork
                layer.attention.tp_size = 2
        compile_layers(model)
        models[name] = model
    return {name: make_step(model, megatron_loss) for name, model in models.items()}


def run(args):
    """name -> [(wall s, process CPU s)] per measured step, in rotating order."""
    steps = build_variants(args)
    g = torch.Generator().manual_seed(args.seed)
    text = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
    ids, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()
    start = time.perf_counter()
    for _ in range(args.warmup):  # compiles (first call) and recompiles (none expected)
        for step in steps.values():
            step(ids, labels)
    print(f"warm-up (compilation included): {time.perf_counter() - start:.1f} s")
    names, times = list(steps), {name: [] for name in steps}
    for i in range(args.steps):
        for name in names[i % len(names):] + names[:i % len(names)]:
            wall, cpu = time.perf_counter(), time.process_time()
            steps[name](ids, labels)
            times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    return times


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8000, help="already padded")
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30, help="measured steps per variant")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print("command: python " + " ".join(shlex.quote(a) for a in sys.argv))
    print(f"machine: {machine()}")
    print(f"model: GPT2Model, {args.layers} layers, hidden {args.hidden}, {args.heads} heads, "
          f"seq {args.seq}, batch {args.batch}, vocab {args.vocab}, dropout {args.dropout}, "
          "fp32, AdamW")
    times = run(args)
    medians = {}
    for name, values in times.items():
        medians[name] = [statistics.median(v[i] for v in values) for i in (0, 1)]
        print(f"{name:16s}: median {medians[name][0] * 1e3:8.2f} ms/step wall, "
              f"{medians[name][1] * 1e3:8.2f} ms CPU ({len(values)} steps)")
    base = medians["eager"]
    for name, (wall, cpu) in medians.items():
        if name != "eager":
            print(f"ratio {name} / eager: wall {wall / base[0]:.3f}, CPU {cpu / base[1]:.3f}")
    if "compiled, forks" in medians:
        wall, cpu = medians["compiled, forks"]
        ref = medians["compiled"]
        print(f"ratio compiled, forks / compiled: wall {wall / ref[0]:.3f}, "
              f"CPU {cpu / ref[1]:.3f}")
    return medians


if __name__ == "__main__":
    main()

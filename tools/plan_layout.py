"""Every (tp, pp, dp, micro-batch, recompute, ZeRO, SP) layout of a config that fits.

    python tools/plan_layout.py --config configs/gpt2/gpt2_345m.yaml --gpus 64 \
        --gpu-memory 80GiB [--nodes 8] [--json]

Memory per stage from megatron/memory (docs/memory.md), step time from the family's FLOP
count at --efficiency of --peak-tflops, communication over --intra-node-gbps /
--inter-node-gbps, the schedule's bubble; fastest first.
"""
import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.errors import ConfigError, run_main  # noqa: E402

UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 1e3, "mb": 1e6,
         "gb": 1e9}


def parse_bytes(text: str) -> int:
    """``80GiB`` / ``80GB`` / ``85899345920`` -> bytes."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in UNITS:
        raise ConfigError(f"--gpu-memory {text!r}: give a number with GiB, GB, MiB or MB")
    return int(float(match.group(1)) * UNITS[match.group(2).lower()])


def _args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="a run config YAML (configs/)")
    p.add_argument("--family", default="gpt2",
                   help="a registered model family with a memory model (gpt2, t5, or one "
                        "registered by megatron.families.register)")
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--gpu-memory", default="80GiB", help="per GPU, e.g. 80GiB")
    p.add_argument("--nodes", type=int, default=None, help="default: gpus / 8")
    p.add_argument("--vocab-size", type=int, default=50257,
                   help="tokenizer vocabulary (padded as the run would)")
    p.add_argument("--global-batch", type=int, default=None,
                   help="samples per step (default: the config's micro-batch x gas x dp)")
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--efficiency", type=float, default=0.4)
    p.add_argument("--intra-node-gbps", type=float, default=450.0, help="NVLink, GB/s")
    p.add_argument("--inter-node-gbps", type=float, default=50.0, help="InfiniBand, GB/s")
    p.add_argument("--top", type=int, default=20, help="layouts printed (text output)")
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


class _PlannedGPU:
    """The accelerator the plan is for (a GPU with fp16 and bf16), so the configuration's
    precision is checked against it rather than against this machine."""

    def device_name(self):
        return "cuda"

    def is_fp16_supported(self):
        return True

    def is_bf16_supported(self):
        return True


def _base(args):
    from megatron.config import build_run_config
    from megatron.families import get_family
    from megatron.memory.spec import spec_from_run_config

    family = get_family(args.family)
    if family.memory_model is None:
        raise ConfigError(f"family {family.name!r} has no memory model, so no layout can be "
                          f"planned for it; set its memory_model ('gpt2' for a decoder-only "
                          f"transformer) to describe it (docs/memory.md)")
    argv = ["--config", args.config, "--lr", "1e-4", "--train-iters", "1"]
    cfg, _ = build_run_config(argv, family, world_size=args.gpus, rank=0, check_files=False,
                              accelerator=_PlannedGPU())
    divisible = cfg.model.make_vocab_size_divisible_by * 8  # padded for tp up to 8
    vocab = -(-args.vocab_size // divisible) * divisible
    cfg = cfg.replace(padded_vocab_size=vocab, true_vocab_size=args.vocab_size)
    return cfg, family, spec_from_run_config(cfg, device="cuda")


def _check(args):
    """Every bad planner flag in one error, before the config is read."""
    problems = []
    if args.gpus < 1:
        problems.append(f"--gpus must be >= 1, got {args.gpus}")
    if args.nodes is not None and (args.nodes < 1 or args.gpus % args.nodes):
        problems.append(f"--nodes {args.nodes} must be >= 1 and divide --gpus {args.gpus}")
    if not 0 < args.efficiency <= 1:
        problems.append(f"--efficiency is a share of the peak in (0, 1], got {args.efficiency}")
    for flag in ("peak_tflops", "intra_node_gbps", "inter_node_gbps"):
        if getattr(args, flag) <= 0:
            problems.append(f"--{flag.replace('_', '-')} must be > 0")
    if args.global_batch is not None and args.global_batch < 1:
        problems.append(f"--global-batch must be >= 1, got {args.global_batch}")
    if parse_bytes(args.gpu_memory) <= 0:
        problems.append(f"--gpu-memory must be > 0, got {args.gpu_memory}")
    if problems:
        raise ConfigError("plan_layout: " + "; ".join(problems))


def main(argv=None):
    from megatron.memory.planner import Hardware, evaluate, plan
    from megatron.memory.report import GIB

    args = _args(argv)
    _check(args)
    cfg, family, base = _base(args)
    nodes = args.nodes or max(1, args.gpus // 8)
    hw = Hardware(gpus=args.gpus, gpu_memory=parse_bytes(args.gpu_memory), nodes=nodes,
                  peak_tflops=args.peak_tflops, efficiency=args.efficiency,
                  intra_gbps=args.intra_node_gbps, inter_gbps=args.inter_node_gbps)
    batch = args.global_batch or cfg.batch.global_batch_size
    flops = family.flops_per_step(cfg.replace(global_batch_size=batch))
    plans = plan(base, hw, batch, flops)
    # the config's own layout, at its own global batch (micro-batch x gas x dp)
    mine = evaluate(base, hw, family.flops_per_step(cfg)) if base.world == args.gpus else None
    if args.json:
        print(json.dumps({"config": args.config, "gpus": args.gpus, "nodes": nodes,
                          "gpu_memory_bytes": hw.gpu_memory, "global_batch": batch,
                          "dtype": base.dtype, "efficiency": hw.efficiency,
                          "peak_tflops": hw.peak_tflops,
                          "config_layout": mine.to_dict() if mine else None,
                          "layouts": [p.to_dict() for p in plans]}, indent=1))
        return 0
    print(f"{args.config}: {len(plans)} layouts fit on {args.gpus} GPUs x "
          f"{hw.gpu_memory / GIB:.0f} GiB ({nodes} nodes), global batch {batch}, "
          f"{base.dtype}, {hw.efficiency:.0%} of {hw.peak_tflops:g} TFLOP/s")
    rows = [("config", mine)] if mine else []
    if mine:
        print(f"  config: the YAML's own layout at its global batch "
              f"{cfg.batch.global_batch_size}; then the {min(args.top, len(plans))} fastest")
    for label, p in rows + [("", p) for p in plans[:args.top]]:
        stages = " ".join(f"{s.peak / GIB:.1f}" for s in p.stages)
        fits = "" if p.fits(hw.gpu_memory) else "  DOES NOT FIT"
        print(f"  {label:6s} {p.step_time:8.3f} s/step  {p.layout():66s} bubble {p.bubble:.2f}  "
              f"comm {p.comm_bytes / GIB:.2f} GiB  peak/stage GiB: {stages}{fits}")
    return 0


if __name__ == "__main__":
    run_main(main)

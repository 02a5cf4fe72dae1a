"""Every (tp, pp, dp, micro-batch, recompute, ZeRO, SP) layout of a config that fits.

    python tools/plan_layout.py --config configs/gpt2/gpt2_345m.yaml --gpus 64 \
        --gpu-memory 80GiB [--reserve 4GiB] [--nodes 8] [--global-batch 512] [--gpu a100] [--json]

Memory per stage from megatron/memory (docs/memory.md) against the GPU's memory less
--reserve; step time from megatron/memory/step_time.py (shape-dependent GEMM efficiency,
attention, tensor/pipeline/data-parallel communication, bubble, optimizer); ranked by
tokens per second per GPU at the global batch. The config's own layout is evaluated the
same way, at the same global batch. ``--json`` writes only JSON on stdout (logs go to stderr).

    python tools/plan_layout.py --paper narayanan2021 [--json]
    python tools/plan_layout.py --paper korthikanti2022 [--json]

evaluates instead the layouts of Narayanan et al. 2021's Table 1 (GPT 1.7B-1T on A100s)
with the A100 preset and prints predicted against published TFLOP/s per GPU
(megatron/memory/published.py), or Korthikanti et al. 2022's Tables 3-5 (full recompute
against sequence parallelism + selective recompute, megatron/memory/korthikanti.py).
"""
import argparse
import contextlib
import json
import math
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.common.errors import ConfigError, run_main  # noqa: E402
from megatron.memory.step_time import A100, H100  # noqa: E402

PRESETS = {"h100": H100, "a100": A100}

UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 1e3, "mb": 1e6,
         "gb": 1e9}


def parse_bytes(text: str) -> int:
    """``80GiB`` / ``80GB`` / ``85899345920`` -> bytes."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in UNITS:
        raise ConfigError(f"--gpu-memory {text!r}: give a number with GiB, GB, MiB or MB")
    return int(float(match.group(1)) * UNITS[match.group(2).lower()])


#: What each column of the table means (printed under it, and by --help).
LEGEND = """\
columns: tok/s/GPU: tokens per second per GPU at the global batch; s/step: seconds per step;
  TFLOP/s: model TFLOP/s per GPU; then the layout: tp / cp / pp: tensor-, context- and
  pipeline-parallel sizes (pp with its schedule: 1f1b, zb-h1, zbv, interleaved/vN = N model
  chunks per stage); dp: data-parallel size; mb: micro-batch size; m: micro-batches per step
  on each data-parallel rank (gradient accumulation: global batch = mb x m x dp);
  recompute: none, full (whole layers) or selective (the attention core); zero: DeepSpeed
  ZeRO stage (0: none); sp: sequence parallelism (1: on); bubble: the share of the step a
  pipeline stage idles; peak/stage GiB: the predicted peak memory of each pipeline stage.
run: the run-script variables (or, for a family without a run script, the flags) that
  start a row's layout; CHECK_ONLY=1 in front checks the settings without launching."""


def _args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=LEGEND,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="a run config YAML (configs/); required unless --paper")
    p.add_argument("--paper", choices=["narayanan2021", "korthikanti2022"], default=None,
                   help="evaluate a published table's own layouts instead (A100 preset)")
    p.add_argument("--family", default=None,
                   help="the model family: a registered name (gpt2, t5, or one registered by "
                        "megatron.families.register) or an import path package.module:OBJECT "
                        "(a ModelFamily with a memory model; docs/memory.md); default: by "
                        "the config's folder (configs/t5/: t5, configs/llama/: the Llama "
                        "example), else gpt2")
    p.add_argument("--gpus", type=int, default=None, help="required unless --paper")
    p.add_argument("--gpu-memory", default="80GiB", help="per GPU, e.g. 80GiB")
    p.add_argument("--reserve", default="4GiB",
                   help="per GPU memory tensors cannot use: CUDA context, NCCL buffers, "
                        "allocator fragmentation (e.g. 4GiB)")
    p.add_argument("--nodes", type=int, default=None, help="default: gpus / 8")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="tokenizer vocabulary (padded as the run would); default: GPT-2's "
                        "50257, T5's 32100 (32000 sentencepiece pieces and 100 sentinels)")
    p.add_argument("--global-batch", type=int, default=None,
                   help="samples per step (default: the config's micro-batch x gas x dp)")
    p.add_argument("--gpu", choices=sorted(PRESETS), default="h100",
                   help="hardware preset for the next four flags (megatron/memory/step_time.py)")
    p.add_argument("--peak-tflops", type=float, default=None, help="default: the preset's")
    p.add_argument("--efficiency", type=float, default=0.75,
                   help="share of the peak a large GEMM reaches")
    p.add_argument("--hbm-gbps", type=float, default=None, help="HBM bandwidth, GB/s")
    p.add_argument("--intra-node-gbps", type=float, default=None, help="NVLink, GB/s")
    p.add_argument("--inter-node-gbps", type=float, default=None, help="InfiniBand, GB/s")
    p.add_argument("--top", type=int, default=20, help="layouts printed (text output)")
    p.add_argument("--run-lines", type=int, default=3,
                   help="the best rows whose run-script line (or flags) is printed")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.family is None:
        args.family = default_family(args.config)
    if args.vocab_size is None:
        args.vocab_size = 32100 if args.family == "t5" else 50257
    dev = PRESETS[args.gpu]
    for flag, value in (("peak_tflops", dev.peak_tflops), ("hbm_gbps", dev.hbm_gbps),
                        ("intra_node_gbps", dev.intra_gbps), ("inter_node_gbps", dev.inter_gbps)):
        if getattr(args, flag) is None:
            setattr(args, flag, value)
    return args


class _PlannedGPU:
    """The accelerator the plan is for (a GPU with fp16 and bf16), so the configuration's
    precision is checked against it rather than against this machine."""

    def device_name(self):
        return "cuda"

    def is_fp16_supported(self):
        return True

    def is_bf16_supported(self):
        return True


#: The planner's defaults for what a config may leave out (its own values win).
PLAN_DEFAULTS = {"lr": 1e-4, "train_iters": 1}

#: configs/<folder>/ -> the family its YAML files describe (the --family default).
CONFIG_FOLDERS = {"gpt2": "gpt2", "t5": "t5", "llama": "examples.llama.llama_model:LLAMA"}


def default_family(config):
    """The family of a config by its folder (configs/t5/... -> t5), else gpt2."""
    folder = os.path.basename(os.path.dirname(os.path.abspath(config or "")))
    return CONFIG_FOLDERS.get(folder, "gpt2")


def _own_world(args, family):
    """``(world to validate the config at, why the config's own layout is not evaluated on
    --gpus or "")``: --gpus when the config's layout divides it, else the layout's own size
    (the plan is for --gpus all the same)."""
    from megatron.config import read_flags

    ns = read_flags(["--config", args.config], family, PLAN_DEFAULTS)
    tp, pp = max(ns.tensor_model_parallel_size, 1), max(ns.pipeline_model_parallel_size, 1)
    cp = max(getattr(ns, "context_parallel_size", 1) or 1, 1)
    dp = getattr(ns, "expected_data_parallel_size", None)
    # the expert-parallel group is carved out of dp x cp: dp a multiple of ep / cp
    ep = max(getattr(ns, "expert_model_parallel_size", 1) or 1, 1)
    need = ep // math.gcd(ep, cp)
    size = tp * cp * pp
    if args.gpus % (size * need) == 0 and dp in (None, args.gpus // size):
        return args.gpus, ""
    own = size * (dp or need)
    ep_text = f" (ep {ep} out of dp x cp)" if ep > 1 else ""
    return own, (f"its layout tp {tp} x cp {cp} x pp {pp}"
                 f"{f' x dp {dp}' if dp else ''}{ep_text} needs "
                 f"{f'{own}' if dp else f'a multiple of {size * need}'} GPUs, not {args.gpus}")


def _base(args):
    """``(cfg, family, base spec, why the config's layout is not evaluated or "")``."""
    from megatron.config import build_run_config
    from megatron.families import load_family
    from megatron.memory.spec import spec_from_run_config

    family = load_family(args.family)
    if family.memory_model is None:
        raise ConfigError(f"family {family.name!r} has no memory model, so no layout can be "
                          f"planned for it; set its memory_model ('decoder' for GPT-2-like "
                          f"layers, or a megatron.memory.LayerDescription of its layers) to "
                          f"describe it (docs/memory.md)")
    world, why = _own_world(args, family)
    cfg, _ = build_run_config(["--config", args.config], family, defaults=PLAN_DEFAULTS,
                              world_size=world, rank=0, check_files=False,
                              accelerator=_PlannedGPU())
    divisible = cfg.model.make_vocab_size_divisible_by * 8  # padded for tp up to 8
    vocab = -(-args.vocab_size // divisible) * divisible
    cfg = cfg.replace(padded_vocab_size=vocab, true_vocab_size=args.vocab_size)
    return cfg, family, spec_from_run_config(cfg, device="cuda"), why


def _check(args):
    """Every bad planner flag in one error, before the config is read."""
    problems = []
    if args.gpus is None or args.config is None:
        problems.append("give --config and --gpus (or --paper)")
    elif args.gpus < 1:
        problems.append(f"--gpus must be >= 1, got {args.gpus}")
    if args.nodes is not None and (args.nodes < 1 or (args.gpus or 1) % args.nodes):
        problems.append(f"--nodes {args.nodes} must be >= 1 and divide --gpus {args.gpus}")
    if not 0 < args.efficiency <= 1:
        problems.append(f"--efficiency is a share of the peak in (0, 1], got {args.efficiency}")
    for flag in ("peak_tflops", "intra_node_gbps", "inter_node_gbps", "hbm_gbps"):
        if getattr(args, flag) <= 0:
            problems.append(f"--{flag.replace('_', '-')} must be > 0")
    if args.global_batch is not None and args.global_batch < 1:
        problems.append(f"--global-batch must be >= 1, got {args.global_batch}")
    if parse_bytes(args.gpu_memory) <= 0:
        problems.append(f"--gpu-memory must be > 0, got {args.gpu_memory}")
    elif not 0 <= parse_bytes(args.reserve) < parse_bytes(args.gpu_memory):
        problems.append(f"--reserve {args.reserve} must be >= 0 and below --gpu-memory")
    if problems:
        raise ConfigError("plan_layout: " + "; ".join(problems))


def _config_plan(base, hw, batch, flops, why):
    """The config's own layout at ``batch`` (None when it is for another GPU count, ``why``,
    or the batch does not split into its micro-batches), and why not."""
    from dataclasses import replace

    from megatron.memory.planner import evaluate

    if why or base.world != hw.gpus:
        return None, why or f"the config's layout uses {base.world} GPUs"
    per_replica = batch // base.dp if batch % base.dp == 0 else 0
    if not per_replica or per_replica % base.micro_batch:
        return None, (f"global batch {batch} does not split into dp {base.dp} x micro-batch "
                      f"{base.micro_batch}")
    # planned as the ranked rows are: the project's step with its reduction overlapped
    spec = replace(base, num_micro_batches=per_replica // base.micro_batch,
                   overlap_grad_reduce=base.backend == "ddp")
    return evaluate(spec, hw, flops), ""


def _setup(args):
    """``(cfg, family, base spec, hardware, global batch, step FLOPs)`` of the flags."""
    from megatron.memory.planner import Hardware

    _check(args)
    cfg, family, base, why = _base(args)
    nodes = args.nodes or max(1, args.gpus // 8)
    hw = Hardware(gpus=args.gpus, gpu_memory=parse_bytes(args.gpu_memory), nodes=nodes,
                  peak_tflops=args.peak_tflops, efficiency=args.efficiency,
                  intra_gbps=args.intra_node_gbps, inter_gbps=args.inter_node_gbps,
                  hbm_gbps=args.hbm_gbps, reserve=parse_bytes(args.reserve))
    batch = args.global_batch or cfg.batch.global_batch_size
    flops = family.flops_per_step(cfg.replace(global_batch_size=batch)) \
        if family.flops_per_step else 1.0
    return cfg, family, base, hw, batch, flops, why


def _header(args, hw, base, batch, candidates, mine, why):
    from megatron.memory.report import GIB

    print(f"{args.config}: {candidates} layouts on {args.gpus} {args.gpu.upper()} GPUs x "
          f"{hw.gpu_memory / GIB:.0f} GiB less {hw.reserve / GIB:.1f} GiB reserve "
          f"({hw.nodes} nodes), global batch {batch}, {base.dtype}, {hw.peak_tflops:g} TFLOP/s "
          f"peak, GEMMs at up to {hw.efficiency:.0%}")
    print("  config: the YAML's own layout at the same global batch" if mine else
          f"  config: not evaluated ({why})")
    print(f"  {'':6s} {'tok/s/GPU':>9s} {'s/step':>8s} {'TFLOP/s':>7s}  layout "
          f"(the columns: under the table, or --help)")
    if mine:
        _row("config", mine, hw)
    sys.stdout.flush()  # the configured layout's row before the ranking runs


def _row(label, p, hw):
    from megatron.memory.report import GIB

    peaks = [s.peak / GIB for s in p.stages]
    stages = " ".join(f"{x:.1f}" for x in peaks) if len(peaks) <= 8 else \
        (f"max {max(peaks):.1f} (stage {peaks.index(max(peaks))}), "
         f"min {min(peaks):.1f} (stage {peaks.index(min(peaks))})")
    fits = "" if p.fits(hw.usable) else "  DOES NOT FIT"
    print(f"  {label:6s} {p.tokens_per_gpu_s:9.0f} {p.step_time:8.3f} "
          f"{p.tflops_per_gpu:7.1f}  {p.layout():66s} bubble {p.bubble:.2f}  "
          f"peak/stage GiB: {stages}{fits}")


def _config_flags(args, family):
    """The config's settings as command-line words (the non-script families' run lines)."""
    from megatron.config import build_parser, config_file_flags

    return config_file_flags(build_parser(family=family), args.config)


def _nothing_fits(args, hw, base, batch, candidates):
    """The refusal when no layout fits, with its reason."""
    from megatron.memory.report import GIB

    where = f"{args.config} on {args.gpus} GPUs at global batch {batch}"
    if not candidates:
        return (f"plan_layout: no layout of {where}: no data-parallel size splits the global "
                f"batch into whole micro-batches with the model's heads, vocabulary and "
                f"layers; give --global-batch (a multiple of the GPU count) or another "
                f"--gpus")
    return (f"plan_layout: none of the {len(candidates)} layouts of {where} fits in "
            f"{hw.usable / GIB:.1f} GiB per GPU (--gpu-memory {args.gpu_memory} less "
            f"--reserve {args.reserve}): the {base.dtype} model's weights, gradients and "
            f"optimizer state with its activations need more; plan for more GPUs or more "
            f"memory per GPU")


def _paper(args, real_stdout):
    """--paper: the published rows' own layouts, predicted against published."""
    if args.paper == "korthikanti2022":
        return _korthikanti(args, real_stdout)
    from megatron.memory.published import format_table, predict_table

    with contextlib.redirect_stdout(sys.stderr):
        preds = predict_table()
    if not args.json:
        print("Narayanan et al. 2021, Table 1: the paper's layouts through the planner's "
              "step-time model (A100 preset), TFLOP/s per GPU by the paper's Eq. 3")
        print(format_table(preds))
        return 0
    json.dump([{"params_b": p.row.params_b, "published_tflops": p.row.tflops,
                "predicted_tflops": p.tflops, "ratio": p.ratio, **p.plan.to_dict()}
               for p in preds], real_stdout, indent=1)
    real_stdout.write("\n")
    return 0


def _korthikanti(args, real_stdout):
    """--paper korthikanti2022: Tables 3 and 5 (and Table 4's layer), both recompute modes."""
    from megatron.memory import korthikanti as k

    with contextlib.redirect_stdout(sys.stderr):
        preds, layers = k.predict_table(), k.predict_layers()
    if not args.json:
        print("Korthikanti et al. 2022, Tables 3 and 5: full recompute against sequence "
              "parallelism + selective recompute, through the planner's model (A100 preset)")
        print(k.format_table(preds))
        print()
        print("Table 4: one 22B layer")
        print(k.format_layers(layers))
        return 0
    json.dump({"rows": [{"params_b": p.row.params_b, "paper_full_s": p.row.full_s,
                         "paper_present_s": p.row.present_s, "paper_mfu": p.row.mfu,
                         "predicted_mfu": p.mfu, "predicted_speedup": p.speedup,
                         "full": p.full.to_dict(), "present": p.present.to_dict()}
                        for p in preds],
               "layer_22b_ms": {v: {"paper": k.LAYER_22B[v], "predicted": t}
                                for v, t in layers.items()}}, real_stdout, indent=1)
    real_stdout.write("\n")
    return 0


def main(argv=None):
    args = _args(argv)
    # Only the answer on stdout: whatever an import or a library prints goes to stderr.
    real_stdout = sys.stdout
    if args.paper:
        return _paper(args, real_stdout)
    from megatron.launch.layout_line import run_line
    from megatron.memory.planner import layouts, rank

    with contextlib.redirect_stdout(sys.stderr):
        cfg, family, base, hw, batch, flops, why = _setup(args)
        mine, why = _config_plan(base, hw, batch, flops, why)
        candidates = list(layouts(base, hw, batch))
    if not args.json:
        _header(args, hw, base, batch, len(candidates), mine, why)
    elif mine:
        print(f"plan_layout: the config's layout: {mine.layout()}, "
              f"{mine.tokens_per_gpu_s:.0f} tok/s/GPU; ranking {len(candidates)} layouts",
              file=sys.stderr, flush=True)
    with contextlib.redirect_stdout(sys.stderr):
        plans = rank(candidates, hw, flops)
    if not plans:
        raise ConfigError(_nothing_fits(args, hw, base, batch, candidates))
    settings = cfg.to_dict()
    config_flags = _config_flags(args, family)
    if not args.json:
        print(f"  {len(plans)} of them fit; the fastest first:")
        for p in plans[:args.top]:
            _row("", p, hw)
        print("\n".join("  " + line for line in LEGEND.splitlines()))
        for i, p in enumerate(plans[:args.run_lines]):
            print(f"run #{i + 1} ({p.layout()}):\n  "
                  f"{run_line(p.spec, family.name, hw.nodes, settings, config_flags)}")
        return 0
    json.dump({"config": args.config, "family": family.name, "gpu": args.gpu,
               "gpus": args.gpus, "nodes": hw.nodes, "gpu_memory_bytes": hw.gpu_memory,
               "reserve_bytes": hw.reserve, "usable_bytes": hw.usable, "global_batch": batch,
               "dtype": base.dtype, "efficiency": hw.efficiency,
               "peak_tflops": hw.peak_tflops, "candidates": len(candidates),
               "config_layout": mine.to_dict() if mine else None,
               "config_layout_note": why,
               "layouts": [dict(p.to_dict(), run=run_line(p.spec, family.name, hw.nodes,
                                                          settings, config_flags))
                           for p in plans]},
              real_stdout, indent=1)
    real_stdout.write("\n")
    return 0


if __name__ == "__main__":
    run_main(main)

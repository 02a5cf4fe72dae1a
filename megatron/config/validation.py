"""One validation pass over the parsed flags, filling in derived values.

Every problem found is listed in a single :class:`ConfigError`, so a user fixes them all
at once. Nothing here communicates: it runs on every rank before torch.distributed starts.
The flag checks reach the same verdict on every rank, so every rank fails the same way and
none waits on another; whether the run's files exist (:func:`rank_file_problems`) is each
rank's own verdict, which the ranks of a distributed run agree on as soon as
torch.distributed starts (:func:`megatron.initialize.initialize_megatron`).
"""
import argparse
import math
import os
from typing import Any, List, Optional, Sequence, Tuple

import torch

from ..common.errors import ConfigError, DataError
from . import preflight
from .recompute import check_recompute

_REQUIRED = {
    "num_layers": "--num-layers", "hidden_size": "--hidden-size",
    "num_attention_heads": "--num-attention-heads", "seq_length": "--seq-length",
    "micro_batch_size": "--batch-size", "train_iters": "--train-iters", "lr": "--lr",
}


def _parallel(args, problems):
    args.tensor_model_parallel_size = max(args.tensor_model_parallel_size, 1)
    args.pipeline_model_parallel_size = max(args.pipeline_model_parallel_size, 1)
    tp, pp, world = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, \
        args.world_size
    cp = getattr(args, "context_parallel_size", 1)
    if cp < 1:
        problems.append(f"--context-parallel-size must be >= 1, got {cp}")
        cp = args.context_parallel_size = 1
    sizes, flags = f"tensor-model-parallel size ({tp}) x pipeline-model-parallel size ({pp})", \
        "--model-parallel-size/--pipe-parallel-size"
    if cp > 1:
        sizes, flags = f"{sizes} x context-parallel size ({cp})", \
            "--model-parallel-size/--pipe-parallel-size/--context-parallel-size"
    if world % (tp * pp * cp):
        problems.append(f"world size ({world}) is not divisible by {sizes}; launch a multiple "
                        f"of {tp * pp * cp} processes or change {flags}")
        args.data_parallel_size = 1
        return
    args.data_parallel_size = world // (tp * pp * cp)
    expected = getattr(args, "expected_data_parallel_size", None)
    if expected is not None and expected != args.data_parallel_size:
        problems.append(f"parallel_config.data_parallel is {expected} but world size {world} / "
                        f"(tp {tp} x pp {pp}{f' x cp {cp}' if cp > 1 else ''}) gives "
                        f"{args.data_parallel_size}")
    if args.distributed_backend is None:
        on_gpu = torch.cuda.is_available() and os.environ.get("MEGATRON_DEVICE", "") != "cpu"
        args.distributed_backend = "nccl" if on_gpu else "gloo"


def _model(args, problems):
    h, heads, tp = args.hidden_size, args.num_attention_heads, args.tensor_model_parallel_size
    if heads % tp:
        problems.append(f"--num-attention-heads ({heads}) is not divisible by the "
                        f"tensor-model-parallel size ({tp}); use a tp that divides the heads")
    if args.kv_channels is None:
        if h % heads:
            problems.append(f"--hidden-size ({h}) is not divisible by --num-attention-heads "
                            f"({heads}); set --kv-hidden-size explicitly")
        args.kv_channels = h // heads
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * h
    if args.ffn_hidden_size % tp:
        problems.append(f"--ff-hidden-size ({args.ffn_hidden_size}) is not divisible by the "
                        f"tensor-model-parallel size ({tp})")
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.seq_length > args.max_position_embeddings:
        problems.append(f"--seq-length ({args.seq_length}) is longer than "
                        f"--max-position-embeddings ({args.max_position_embeddings}); "
                        f"raise --max-position-embeddings or shorten the sequences")
    stacks = args.layer_stacks  # encoder-decoder: --num-layers per stack
    if args.pipeline_model_parallel_size > stacks * args.num_layers:
        layers = f"--num-layers ({args.num_layers})" if stacks == 1 else \
            f"the {stacks} x --num-layers ({args.num_layers}) layers"
        problems.append(f"--pipe-parallel-size ({args.pipeline_model_parallel_size}) is larger "
                        f"than {layers}; every stage needs a layer")
    for name in ("hidden_dropout", "attention_dropout"):
        if not 0.0 <= getattr(args, name) < 1.0:
            problems.append(f"--{name.replace('_', '-')} must be in [0, 1)")


def _virtual_pipeline(args, problems):
    """``--virtual-pipeline-model-parallel-size`` v (or derived from
    ``--num-layers-per-virtual-pipeline-stage``): the layers split into pp x v equal chunks."""
    pp, stacks = args.pipeline_model_parallel_size, args.layer_stacks
    layers = stacks * args.num_layers  # an encoder-decoder cuts both stacks (T5: 2 L)
    what = "--num-layers" if stacks == 1 else f"the {stacks} x --num-layers"
    v = getattr(args, "virtual_pipeline_model_parallel_size", None)
    per_chunk = getattr(args, "num_layers_per_virtual_pipeline_stage", None)
    if per_chunk is not None:
        if per_chunk < 1 or layers % (pp * per_chunk):
            problems.append(f"--num-layers-per-virtual-pipeline-stage ({per_chunk}) must be "
                            f"positive and divide {what} ({layers}) / --pipe-parallel-size "
                            f"({pp}) evenly")
            per_chunk = None
        elif v is not None and v != layers // (pp * per_chunk):
            problems.append(f"--virtual-pipeline-model-parallel-size ({v}) disagrees with "
                            f"--num-layers-per-virtual-pipeline-stage ({per_chunk}), which "
                            f"gives {layers // (pp * per_chunk)} chunks per rank; give one")
        else:
            v = layers // (pp * per_chunk)
    v = 1 if v is None else v
    args.virtual_pipeline_model_parallel_size = v
    if v < 1:
        problems.append(f"--virtual-pipeline-model-parallel-size must be positive, got {v}")
    elif v > 1 and pp < 2:
        problems.append(f"--virtual-pipeline-model-parallel-size {v} needs "
                        f"--pipe-parallel-size >= 2 (interleaving places chunks on other "
                        f"pipeline ranks); drop it or raise the pipeline size")
    elif v > 1 and layers % (pp * v):
        problems.append(f"{what} ({layers}) is not divisible by --pipe-parallel-size ({pp}) x "
                        f"--virtual-pipeline-model-parallel-size ({v}); every model chunk "
                        f"holds the same number of layers")


def _pipeline_schedule(args, problems):
    """``--pipeline-schedule``: 1f1b by default, interleaved when v > 1; zbv takes two chunks
    per rank (placed in a V), so the layers split into 2 x pp equal chunks."""
    pp, v = args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size
    name = getattr(args, "pipeline_schedule", None) or ("interleaved" if v > 1 else "1f1b")
    args.pipeline_schedule = name
    if name != "1f1b" and pp < 2:
        problems.append(f"--pipeline-schedule {name} needs --pipe-parallel-size >= 2 (one stage "
                        f"has no pipeline to schedule); drop it or raise the pipeline size")
        return
    if name == "1f1b" and v > 1:
        problems.append(f"--pipeline-schedule 1f1b runs one model chunk per rank, but "
                        f"--virtual-pipeline-model-parallel-size is {v}; use "
                        f"--pipeline-schedule interleaved or drop the virtual size")
    elif name == "interleaved" and v < 2:
        problems.append("--pipeline-schedule interleaved needs "
                        "--virtual-pipeline-model-parallel-size >= 2 (chunks per rank)")
    elif name == "zb-h1" and v > 1:
        problems.append(f"--pipeline-schedule zb-h1 runs one model chunk per rank (1F1B's "
                        f"order, split backward), but --virtual-pipeline-model-parallel-size "
                        f"is {v}; drop it, or use --pipeline-schedule zbv (two chunks per rank)")
    elif name == "zbv":
        layers = args.layer_stacks * args.num_layers
        if v not in (1, 2):
            problems.append(f"--pipeline-schedule zbv places exactly 2 model chunks on each "
                            f"rank, but --virtual-pipeline-model-parallel-size is {v}; drop it")
        elif layers % (2 * pp):
            problems.append(f"--pipeline-schedule zbv cuts the {layers} layers into 2 x "
                            f"--pipe-parallel-size ({2 * pp}) equal chunks; they do not divide")
        args.virtual_pipeline_model_parallel_size = 2


def _batch(args, problems):
    mbs, dp = args.micro_batch_size, args.data_parallel_size
    if mbs < 1:
        problems.append(f"--batch-size must be positive, got {mbs}")
        return
    gbs = args.global_batch_size
    if gbs is not None:
        if gbs % (mbs * dp):
            problems.append(f"--global-batch-size ({gbs}) is not divisible by --batch-size "
                            f"({mbs}) x data-parallel size ({dp})")
            return
        if args.gas is not None and args.gas != gbs // (mbs * dp):
            problems.append(f"--gas ({args.gas}) disagrees with --global-batch-size ({gbs}) / "
                            f"(batch-size {mbs} x data-parallel size {dp})")
        args.gas = gbs // (mbs * dp)
    if args.gas is None:
        args.gas = 1
    if args.gas < 1:
        problems.append(f"--gas must be positive, got {args.gas}")
    args.global_batch_size = mbs * args.gas * dp


def _optim(args, problems):
    if args.fp16 and args.bf16:
        problems.append("--fp16 and --bf16 are mutually exclusive")
    args.compute_dtype = torch.float16 if args.fp16 else torch.bfloat16 if args.bf16 \
        else torch.float32
    args.params_dtype = torch.float32  # master weights; compute is autocast to compute_dtype
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.min_lr > args.lr:
        problems.append(f"--min-lr ({args.min_lr}) is above --lr ({args.lr})")
    if args.warmup < 0:
        problems.append(f"--warmup must be >= 0, got {args.warmup}")
    args.lr_warmup_iters = int(args.warmup * args.lr_decay_iters) if args.warmup < 1 \
        else int(args.warmup)
    if args.loss_scale < 0 or args.min_loss_scale <= 0:
        problems.append("--loss-scale must be >= 0 (0 = dynamic) and --min-loss-scale > 0")
    if args.loss_scale_window < 1 or args.hysteresis < 1:
        problems.append("--loss-scale-window and --hysteresis must be >= 1")
    if args.skip_nonfinite_steps and preflight.uses_deepspeed(args):
        problems.append("--skip-nonfinite-steps works with the project's own step only; "
                        "DeepSpeed's engine (--deepspeed) skips only fp16 overflows")
    if args.clip_grad < 0:
        problems.append(f"--clip-grad must be >= 0 (0 disables), got {args.clip_grad}")


def _json_zero_stage(path, problems):
    """The ``zero_optimization.stage`` of a DeepSpeed JSON config (None when it sets none or
    cannot be read: the file checks report that)."""
    import json

    if not path or not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            config = json.load(handle)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        problems.append(f"--deepspeed_config {path} is not a readable JSON file: {exc}")
        return None
    stage = config.get("zero_optimization", {}).get("stage") if isinstance(config, dict) \
        else None
    return stage if isinstance(stage, int) else None


def _distributed_optimizer(args, problems):
    """ZeRO without DeepSpeed's engine: stage 1 (``--zero-stage 1`` or the JSON's) is the
    distributed optimizer; stages 2-3 exist only in DeepSpeed's engine at pp 1."""
    stage = args.zero_stage if args.zero_stage is not None else \
        _json_zero_stage(args.deepspeed_config, problems)
    if preflight.uses_deepspeed(args):
        if args.fp16 and not stage:
            problems.append("--fp16 with DeepSpeed's engine (--deepspeed) needs ZeRO: its fp16 "
                            "optimizer without ZeRO does not scale the loss "
                            "(deepspeedai/DeepSpeed#8393); pass --zero-stage 1, or drop "
                            "--deepspeed (the project's own step scales fp16 losses)")
        if args.use_distributed_optimizer or args.overlap_grad_reduce or \
                args.overlap_param_gather:
            problems.append("--use-distributed-optimizer / --overlap-grad-reduce / "
                            "--overlap-param-gather are the project's own step; with "
                            "--deepspeed, DeepSpeed's engine reduces and shards (its ZeRO "
                            "stage: --zero-stage); drop one or the other")
        return
    if stage is not None and stage not in (0, 1):
        where = "--zero-stage" if args.zero_stage is not None else \
            f"{args.deepspeed_config}'s zero_optimization.stage"
        fix = "pass --deepspeed to train through DeepSpeed's engine (pp 1 only), or use " \
            "stage 1 (the distributed optimizer)" if args.pipeline_model_parallel_size <= 1 \
            else "pipeline runs take stage 0 or 1 (the distributed optimizer)"
        problems.append(f"{where} is {stage}: ZeRO stage {stage} is DeepSpeed's engine's; {fix}")
    if stage == 1:
        args.use_distributed_optimizer = True
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        problems.append("--overlap-param-gather needs --use-distributed-optimizer (only the "
                        "distributed optimizer all-gathers parameters)")
    if args.ddp_bucket_size is not None and args.ddp_bucket_size < 1:
        problems.append(f"--ddp-bucket-size must be >= 1 element, got {args.ddp_bucket_size}")


def _data(args, problems):
    if args.num_workers < 0 or args.prefetch_batches < 0:
        problems.append(f"--num-workers ({args.num_workers}) and --prefetch-batches "
                        f"({args.prefetch_batches}) must be >= 0")


def _intervals(args, problems):
    if args.log_interval < 1 or args.eval_interval < 1 or args.eval_iters < 0:
        problems.append("--log-interval and --eval-interval must be >= 1, --eval-iters >= 0")
    if args.train_iters < 1:
        problems.append(f"--train-iters must be >= 1, got {args.train_iters}")
    if args.save_interval is not None and args.save_interval < 1:
        problems.append(f"--save-interval must be >= 1, got {args.save_interval}")


def _faults(args, problems):
    """Signal stops, background saves and the watchdog (docs/fault_tolerance.md)."""
    if args.exit_signal_check_interval < 1:
        problems.append(f"--exit-signal-check-interval must be >= 1, got "
                        f"{args.exit_signal_check_interval}")
    if args.exit_signal_handler and not args.save:
        problems.append("--exit-signal-handler needs --save (a stop on a signal saves there, "
                        "and the requeued run resumes from it with --load = --save)")
    if args.async_save and not args.save:
        problems.append("--async-save needs --save (the folder the background writer fills)")
    for flag in ("step_timeout", "startup_timeout", "save_timeout"):
        value = getattr(args, flag)
        if value is not None and not (math.isfinite(value) and value > 0):
            problems.append(f"--{flag.replace('_', '-')} must be > 0 seconds, got {value} "
                            f"(a finite number; leave --step-timeout out for no watchdog)")
    if args.step_timeout is None:
        if args.startup_timeout is not None or args.save_timeout is not None:
            problems.append("--startup-timeout / --save-timeout need --step-timeout (the "
                            "watchdog is off without it)")
        return
    # A save of a large model takes far longer than a step: by default it gets ten steps'
    # worth, and at least five minutes. Start-up's default follows the checkpoint to load
    # and --compile, computed when the watchdog starts (resilience/startup_allowance.py).
    args.save_timeout = args.save_timeout or max(10 * args.step_timeout, 300.0)


def _split(args, problems):
    parts = args.split.replace("/", ",").split(",")
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        weights = []
    if len(weights) != 3 or min(weights) < 0 or sum(weights) <= 0:
        problems.append(f"--split {args.split!r} must be three non-negative numbers such as "
                        f"949,50,1")
    elif weights[0] == 0:
        problems.append(f"--split {args.split!r} gives the training split no data; give it a "
                        f"positive first weight, e.g. 949,50,1")


def _wandb(args, problems):
    """``--wandb-*`` flags that cannot work (checked on every rank, before any group)."""
    if not args.wandb_project:
        if args.wandb_exp_name or args.wandb_save_dir:
            problems.append("--wandb-exp-name / --wandb-save-dir need --wandb-project (the "
                            "W&B project to log to)")
        return
    try:
        import wandb  # noqa: F401
    except ImportError:
        problems.append("--wandb-project given but wandb is not installed: "
                        "pip install 'megatron-tds[wandb]' (or pip install wandb)")


def parse_data_path(data_path: Sequence[str]) -> Tuple[Optional[List[float]], List[str]]:
    """``[prefix]`` or ``[w1, p1, w2, p2, ...]`` -> (weights or None, prefixes); ``[]`` (no
    ``--data-path``: a provider's own data) -> (None, [])."""
    if len(data_path) <= 1:
        return None, list(data_path)
    if len(data_path) % 2:
        raise DataError(f"--data-path {' '.join(data_path)}: give one prefix, or pairs of "
                        f"'weight prefix'")
    try:
        weights = [float(w) for w in data_path[0::2]]
    except ValueError:
        raise DataError(f"--data-path {' '.join(data_path)}: with several prefixes every "
                        f"prefix must be preceded by its weight, e.g. 0.3 A 0.7 B") from None
    if min(weights) <= 0:
        raise DataError("--data-path weights must be positive")
    return weights, list(data_path[1::2])


def _file_flags(args, problems):
    """The data and tokenizer flags themselves (the same verdict on every rank)."""
    if not args.data_path:
        problems.append("--data-path is required (a prefix written by tools/preprocess_data.py)")
    else:
        try:
            parse_data_path(args.data_path)
        except DataError as exc:
            problems.append(str(exc))
    if args.tokenizer_type is None:
        problems.append("--tokenizer-type is required")
    for name in _TOKENIZER_FILES.get(args.tokenizer_type, ()):
        if not getattr(args, name):
            problems.append(f"{args.tokenizer_type} needs --{name.replace('_', '-')}")


_TOKENIZER_FILES = {"GPT2BPETokenizer": ("vocab_file", "merge_file"),
                    "CharTokenizer": ("vocab_file",),
                    "SentencePieceTokenizer": ("tokenizer_model",)}


def rank_file_problems(args: argparse.Namespace) -> List[str]:
    """What this process finds wrong with the run's files: the data, vocabulary and
    DeepSpeed config files exist, ``--save`` is writable, ``--load`` exists.

    Unlike the flag checks, the verdict can differ between ranks (a mount lost on one
    node): :func:`megatron.config.build_run_config` reports these at once in a single
    process and lets the ranks of a distributed run agree on them first
    (:class:`~megatron.config.parser.RankFileProblems`).

    Args:
        args: the parsed flags, already validated.

    Returns:
        The problems (empty when every file is there).
    """
    problems = []
    try:
        _, prefixes = parse_data_path(args.data_path or [])
    except DataError:
        prefixes = []  # a flag problem, reported by _file_flags
    for prefix in prefixes:
        missing = [ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
        if missing:
            problems.append(f"data prefix {prefix!r} has no {' or '.join(missing)} file; "
                            f"run tools/preprocess_data.py or fix --data-path")
    for name in _TOKENIZER_FILES.get(args.tokenizer_type, ()):
        path = getattr(args, name)
        if path and not os.path.isfile(path):
            problems.append(f"--{name.replace('_', '-')} {path} does not exist")
    if args.deepspeed_config and not os.path.isfile(args.deepspeed_config):
        problems.append(f"--deepspeed_config {args.deepspeed_config} does not exist")
    preflight.check_save_dir(args.save, problems)
    preflight.check_load_dir(args, problems)
    return problems


def _sequence_parallel(args, problems):
    """--sequence-parallel: off (nothing to shard) at tp 1; every sequence divides by tp."""
    tp = args.tensor_model_parallel_size
    if not args.sequence_parallel or tp == 1:
        args.sequence_parallel = False
        return
    lengths = [("--seq-length", args.seq_length)]
    for flag, dest in (("--enc-seq-length", "enc_seq_length"),
                       ("--dec-seq-length", "dec_seq_length")):
        if getattr(args, dest, None) is not None:
            lengths.append((flag, getattr(args, dest)))
    for flag, length in lengths:
        if length is not None and length % tp:
            problems.append(f"--sequence-parallel splits the sequence across the {tp} "
                            f"tensor-parallel ranks but {flag} ({length}) is not divisible by "
                            f"{tp}; use a length that is a multiple of {tp} or drop "
                            f"--sequence-parallel")


def derive_vocab(args: argparse.Namespace, vocab_size: int) -> None:
    """The vocabulary's derived sizes, from the tokenizer's ``vocab_size``."""
    from ..tokenizer import vocab_size_with_padding

    args.true_vocab_size = vocab_size  # saved with checkpoints (resharding needs it)
    args.padded_vocab_size = vocab_size_with_padding(
        vocab_size, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size)


def derive_and_validate(args: argparse.Namespace, family: Optional[Any] = None,
                        check_files: bool = True,
                        accelerator: Optional[Any] = None) -> List[str]:
    """Check every flag (generic and the family's) and fill derived values.

    Args:
        args: the parsed namespace (the only mutable form of the configuration).
        family: the run's :class:`~megatron.families.ModelFamily`, or None.
        check_files: also check the data and tokenizer flags (whether the files exist is
            each rank's own verdict: :func:`rank_file_problems`).
        accelerator: DeepSpeed's accelerator to check ``--fp16`` / ``--bf16`` against
            (default: this device's; tests pass a stand-in to emulate one).

    Returns:
        The list of problems (empty when the configuration is valid).

    Raises:
        ConfigError: when required settings are missing (nothing else can be checked).
    """
    args.layer_stacks = family.layer_stacks if family is not None else 1
    args.true_vocab_size = args.padded_vocab_size = None  # derived from the tokenizer
    if not hasattr(args, "expected_data_parallel_size"):
        args.expected_data_parallel_size = None
    if family is not None:
        family.derive(args)
    missing = [flag for dest, flag in _REQUIRED.items() if getattr(args, dest, None) is None]
    if missing:
        raise ConfigError(f"missing required settings: {', '.join(missing)} (give them as "
                          f"flags or in the --config file)")
    problems = []
    from .context_parallel import validate_context_parallel
    from .moe import validate_moe
    from .fp8 import validate_fp8
    from .speed_flags import validate_speed

    for check in (_parallel, _model, check_recompute, _virtual_pipeline, _pipeline_schedule,
                  _batch, _optim, _distributed_optimizer, _data, _intervals,
                  _faults, _split, _wandb,
                  _sequence_parallel, validate_context_parallel, validate_speed, validate_moe,
                  validate_fp8):
        check(args, problems)
    if family is not None:
        family.validate(args, problems)
        problems.extend(family.unsupported_flags(args))
    preflight.check_precision(args, problems, accelerator)
    if check_files:
        _file_flags(args, problems)
    return problems

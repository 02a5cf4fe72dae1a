"""The DeepSpeed side of pretrain(): config from flags, tds.initialize, engine train steps.

Used for pipeline runs (``--pipe-parallel-size`` > 1, tds's pipeline engine) and for
``--deepspeed`` data parallelism. DeepSpeed owns precision (fp16 with fp32 master weights
and its loss scaler, or bf16), ZeRO, clipping and the data-parallel reduction; the
optimizer (AdamW, no decay on biases and norms) and LR schedule are ours, so a pipeline
run and a plain run of the same model take the same steps.
"""
import json

import torch

from . import mpu
from .errors import ConfigError
from .learning_rates import AnnealingLR
from .optimizer import get_param_groups

BATCH_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
              "train_batch_size")


def _read_json(path):
    try:
        with open(path) as handle:
            return json.load(handle)
    except FileNotFoundError:
        raise ConfigError(f"DeepSpeed config {path} does not exist") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"DeepSpeed config {path} is not valid JSON: {exc}") from None


def _precision(config, args, path):
    for key, flag in (("fp16", args.fp16), ("bf16", args.bf16)):
        enabled = bool(config.get(key, {}).get("enabled", False))
        if enabled and not flag:
            raise ConfigError(f"{path} enables {key} but --{key} is not given; pass --{key} "
                              f"or disable it in the JSON")
    if args.fp16:
        block = {"loss_scale": args.loss_scale, "initial_scale_power": args.initial_scale_power,
                 "loss_scale_window": args.loss_scale_window, "hysteresis": args.hysteresis,
                 "min_loss_scale": args.min_loss_scale}
        config["fp16"] = {**block, **config.get("fp16", {}), "enabled": True}
    if args.bf16:
        config["bf16"] = {**config.get("bf16", {}), "enabled": True}


def build_deepspeed_config(args):
    """DeepSpeed's config dict: ``--deepspeed_config`` (if any) checked against the flags.

    The batch sizes and clipping come from the flags (BATCHSIZE x GAS x dp, --clip-grad); a
    JSON value that disagrees is an error rather than a silent override. Precision follows
    the flags; the JSON's fp16 block supplies loss-scaler settings.
    """
    path = args.deepspeed_config or "(flags)"
    config = _read_json(args.deepspeed_config) if args.deepspeed_config else {}
    batch = dict(zip(BATCH_KEYS, (args.micro_batch_size, args.gas, args.global_batch_size)))
    for key, value in batch.items():
        if key in config and config[key] != value:
            raise ConfigError(f"{path}: {key} is {config[key]} but the flags give {value} "
                              f"(batch size {args.micro_batch_size} x gas {args.gas} x "
                              f"data-parallel {args.data_parallel_size}); make them agree")
    config.update(batch)
    if config.get("gradient_clipping", args.clip_grad) != args.clip_grad:
        raise ConfigError(f"{path}: gradient_clipping is {config['gradient_clipping']} but "
                          f"--clip-grad is {args.clip_grad}; make them agree")
    config["gradient_clipping"] = args.clip_grad
    config.setdefault("steps_per_print", 10**9)  # pretrain() logs
    config.setdefault("wall_clock_breakdown", False)
    _precision(config, args, path)
    if args.zero_stage is not None:
        config["zero_optimization"] = {**config.get("zero_optimization", {}),
                                       "stage": args.zero_stage}
    stage = config.get("zero_optimization", {}).get("stage", 0)
    if args.pipeline_model_parallel_size > 1 and stage > 1:
        raise ConfigError(f"ZeRO stage {stage} cannot be combined with pipeline parallelism; "
                          f"use stage 0 or 1")
    return config


def setup_engine(model, args):
    """``tds.initialize`` the model; returns (engine, engine optimizer, lr_scheduler)."""
    import tds as deepspeed

    deepspeed.init_distributed(dist_backend=args.distributed_backend)
    optimizer = torch.optim.AdamW(get_param_groups([model], args.weight_decay), lr=args.lr,
                                  betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps,
                                  weight_decay=args.weight_decay)
    lr_scheduler = AnnealingLR(optimizer, args.lr, args.min_lr, args.lr_warmup_iters,
                               args.lr_decay_iters, args.lr_decay_style)
    pipeline = args.pipeline_model_parallel_size > 1
    engine, ds_optimizer, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=lr_scheduler,
        config=build_deepspeed_config(args), mpu=None if pipeline else mpu,
        dist_init_required=False)
    engine.megatron_kind = "pipeline" if pipeline else "deepspeed"
    return engine, ds_optimizer, lr_scheduler


def engine_train_step(forward_step_func, data_iterator, engine, args):
    """One step on a DeepSpeed engine; returns (stats, updated, grad_norm)."""
    if engine.megatron_kind == "pipeline":
        loss = engine.train_batch(data_iter=data_iterator)
        per_micro_batch = [{"lm loss": loss.detach().float()}]
    else:
        per_micro_batch = []
        for _ in range(args.gas):
            loss, stats = forward_step_func(data_iterator, engine)
            engine.backward(loss)  # DeepSpeed divides by gas itself
            engine.step()
            per_micro_batch.append(stats)
    updated = not getattr(engine.optimizer, "overflow", False)
    norm = engine.get_global_grad_norm()
    return per_micro_batch, updated, (float(norm) if norm is not None else None)


def engine_eval_step(forward_step_func, data_iterator, engine, args):
    """Validation loss of one global batch on an engine."""
    if engine.megatron_kind == "pipeline":
        return [{"lm loss": engine.eval_batch(data_iterator).detach().float()}]
    return [forward_step_func(data_iterator, engine)[1] for _ in range(args.gas)]

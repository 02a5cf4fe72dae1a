"""The frozen run configuration: every flag once, validated, with its derived values.

A :class:`RunConfig` is built once per run by :func:`megatron.config.build_run_config`
(command line + YAML, one validation pass, derived values such as the data-parallel size,
the padded vocabulary and the compute dtype) and never changes afterwards: setting an
attribute raises. Megatron-style code reads flags flat (``args.hidden_size``); new code
reads the typed sections (``cfg.parallel.dp``, ``cfg.precision.dtype``, ``cfg.optim.lr``).
What changes while a run goes (iteration, consumed samples, which splits exist) lives in
the training state (:class:`megatron.training.loop.TrainState`), not here.
"""
from dataclasses import dataclass
from typing import Optional, Tuple

import torch


def uses_pipeline_engine(pp: int) -> bool:
    """Whether ``pp`` pipeline stages train through tds's pipeline engine (whose checkpoints
    hold stage-keyed state dicts): the one rule, for validation, the backend factory and the
    checkpoint writers."""
    return pp > 1


class FrozenConfigError(AttributeError):
    """Raised when code tries to change a built run configuration."""


@dataclass(frozen=True)
class ParallelDims:
    """Sizes and this process's place in the (tensor, pipeline, data) grid."""

    world: int
    """Number of processes."""
    tp: int
    """Tensor-model-parallel size (``--model-parallel-size``)."""
    pp: int
    """Pipeline stages (``--pipe-parallel-size``; 0 and 1 both mean one stage)."""
    dp: int
    """Data-parallel size: world / (tp x pp)."""
    rank: int
    local_rank: int
    dist_backend: str
    """torch.distributed backend: ``nccl`` with GPUs, ``gloo`` without."""
    deepspeed: bool
    """``--deepspeed``: data parallelism through DeepSpeed's engine (ZeRO, its fp16)."""
    deepspeed_config: Optional[str]
    zero_stage: Optional[int]


@dataclass(frozen=True)
class PrecisionConfig:
    """Compute precision and the fp16 loss scaler's settings."""

    dtype: torch.dtype
    """Compute dtype (autocast); master weights stay fp32."""
    params_dtype: torch.dtype
    loss_scale: float
    """Static scale; 0 = dynamic (fp16 only)."""
    initial_scale_power: int
    loss_scale_window: int
    hysteresis: int
    min_loss_scale: float

    @property
    def fp16(self):
        return self.dtype == torch.float16

    @property
    def bf16(self):
        return self.dtype == torch.bfloat16

    @property
    def name(self):
        return str(self.dtype).replace("torch.", "")


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW, gradient clipping and the learning-rate schedule."""

    lr: float
    min_lr: float
    lr_decay_style: str
    lr_decay_iters: int
    lr_warmup_iters: int
    weight_decay: float
    adam_betas: Tuple[float, float]
    adam_eps: float
    clip_grad: float
    """Max global grad norm; 0 disables clipping (the norm is still measured)."""


@dataclass(frozen=True)
class BatchConfig:
    micro_batch_size: int
    gas: int
    """Micro-batches per step (gradient accumulation)."""
    global_batch_size: int
    """micro_batch_size x gas x dp."""
    train_iters: int
    seq_length: int


@dataclass(frozen=True)
class LoggingConfig:
    log_interval: int
    eval_interval: int
    eval_iters: int
    tensorboard_dir: Optional[str]
    peak_tflops: Optional[float]


@dataclass(frozen=True)
class CheckpointConfig:
    save: Optional[str]
    load: Optional[str]
    save_interval: Optional[int]
    no_load_optim: bool
    no_load_rng: bool
    no_save_optim: bool
    finetune: bool
    exit_interval: Optional[int]


class RunConfig:
    """Read-only view of a validated run: flat flags plus typed sections.

    Args:
        values: every flag and derived value by its ``dest`` name.
        family: name of the model family the run was validated for (``gpt2``, ``t5``) or
            None for a model defined outside megatron-tds.
    """

    __slots__ = ("_values", "family", "parallel", "precision", "optim", "batch", "logging",
                 "checkpoint")

    def __init__(self, values, family=None):
        set_ = object.__setattr__
        set_(self, "_values", dict(values))
        set_(self, "family", family)
        v = self._values
        if "data_parallel_size" in v:  # a full run config (not a saved-args view)
            for name, section in _sections(v).items():
                set_(self, name, section)

    def __getattr__(self, name):
        try:
            return object.__getattribute__(self, "_values")[name]
        except KeyError:
            raise AttributeError(f"the run configuration has no setting {name!r}") from None

    def __setattr__(self, name, value):
        raise FrozenConfigError(
            f"the run configuration is frozen (tried to set {name!r}); derived values are "
            f"computed in megatron/config, run progress lives in the training state")

    def __delattr__(self, name):
        raise FrozenConfigError(f"the run configuration is frozen (tried to delete {name!r})")

    def __contains__(self, name):
        return name in self._values

    def __repr__(self):
        return f"RunConfig(family={self.family!r}, {len(self._values)} settings)"

    def get(self, name, default=None):
        """A setting that a saved configuration may lack (checkpoints of older versions)."""
        return self._values.get(name, default)

    def to_dict(self):
        """Plain values (safe for ``torch.load(weights_only=True)``), as saved in checkpoints."""
        return values_to_plain(self._values)

    def replace(self, **changes):
        """A new RunConfig with ``changes`` applied (tools and tests; no re-validation)."""
        return RunConfig({**self._values, **changes}, self.family)


def values_to_plain(values):
    """Flag values as bools, numbers, strings and lists of them (dtypes become strings)."""
    plain = (bool, int, float, str, type(None))
    out = {}
    for key, value in values.items():
        if isinstance(value, plain):
            out[key] = value
        elif isinstance(value, (list, tuple)) and all(isinstance(v, plain) for v in value):
            out[key] = list(value)
        else:
            out[key] = str(value)
    return out


def _sections(v):
    return {
        "parallel": ParallelDims(
            world=v["world_size"], tp=v["tensor_model_parallel_size"],
            pp=v["pipeline_model_parallel_size"], dp=v["data_parallel_size"], rank=v["rank"],
            local_rank=v["local_rank"], dist_backend=v["distributed_backend"],
            deepspeed=v["deepspeed"], deepspeed_config=v["deepspeed_config"],
            zero_stage=v["zero_stage"]),
        "precision": PrecisionConfig(
            dtype=v["compute_dtype"], params_dtype=v["params_dtype"],
            loss_scale=v["loss_scale"], initial_scale_power=v["initial_scale_power"],
            loss_scale_window=v["loss_scale_window"], hysteresis=v["hysteresis"],
            min_loss_scale=v["min_loss_scale"]),
        "optim": OptimizerConfig(
            lr=v["lr"], min_lr=v["min_lr"], lr_decay_style=v["lr_decay_style"],
            lr_decay_iters=v["lr_decay_iters"], lr_warmup_iters=v["lr_warmup_iters"],
            weight_decay=v["weight_decay"], adam_betas=(v["adam_beta1"], v["adam_beta2"]),
            adam_eps=v["adam_eps"], clip_grad=v["clip_grad"]),
        "batch": BatchConfig(
            micro_batch_size=v["micro_batch_size"], gas=v["gas"],
            global_batch_size=v["global_batch_size"], train_iters=v["train_iters"],
            seq_length=v["seq_length"]),
        "logging": LoggingConfig(
            log_interval=v["log_interval"], eval_interval=v["eval_interval"],
            eval_iters=v["eval_iters"], tensorboard_dir=v["tensorboard_dir"],
            peak_tflops=v["peak_tflops"]),
        "checkpoint": CheckpointConfig(
            save=v["save"], load=v["load"], save_interval=v["save_interval"],
            no_load_optim=v["no_load_optim"], no_load_rng=v["no_load_rng"],
            no_save_optim=v["no_save_optim"], finetune=v["finetune"],
            exit_interval=v["exit_interval"]),
    }

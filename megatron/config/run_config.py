"""The frozen run configuration: every flag once, validated, with its derived values.

A :class:`RunConfig` is built once per run by :func:`megatron.config.build_run_config`
(command line + YAML, one validation pass, derived values such as the data-parallel size,
the padded vocabulary and the compute dtype) and never changes afterwards: setting an
attribute raises. Megatron-style code reads flags flat (``args.hidden_size``); new code
reads the typed sections (``cfg.parallel.dp``, ``cfg.precision.dtype``, ``cfg.optim.lr``).
What changes while a run goes (iteration, consumed samples, which splits exist) lives in
the training state (:class:`megatron.training.loop.TrainState`), not here.
"""
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Dict, List, Optional, Tuple

import torch


def uses_pipeline_engine(pp: int) -> bool:
    """Whether ``pp`` pipeline stages train through tds's pipeline engine (whose checkpoints
    hold stage-keyed state dicts): the one rule, for validation, the backend factory and the
    checkpoint writers."""
    return pp > 1


#: ``--pipeline-schedule``'s names, as tds.pipe.schedules defines them (``SCHEDULES``,
#: ``ZERO_BUBBLE``; megatron reads them here because importing tds at start-up would load
#: DeepSpeed: tests/test_config_access.py keeps the two equal).
PIPELINE_SCHEDULES = ("1f1b", "interleaved", "zb-h1", "zbv")
#: The zero-bubble schedules: split backward, weight-gradient GEMMs deferred to a store.
ZERO_BUBBLE_SCHEDULES = ("zb-h1", "zbv")
#: The schedule that places its two chunks per rank in a V (every other one: a loop).
V_SCHEDULE = "zbv"


class FrozenConfigError(AttributeError):
    """Raised when code tries to change a built run configuration."""


class Section:
    """A typed, frozen part of the run configuration, built from the flag values.

    Each field reads the flag of the same ``dest`` name, or the one :attr:`FLAGS` names;
    :meth:`derived` fills fields that are not one flag.
    """

    FLAGS: ClassVar[Dict[str, str]] = {}
    """field name -> flag ``dest`` where they differ."""
    DEFAULTS: ClassVar[Dict[str, Any]] = {}
    """Values for derived settings that older saved configurations may lack."""

    @classmethod
    def derived(cls, values: dict) -> dict:
        return {}

    @classmethod
    def from_values(cls, values: dict):
        extra = cls.derived(values)
        kwargs = {}
        for f in fields(cls):
            if f.name in extra:
                kwargs[f.name] = extra[f.name]
                continue
            dest = cls.FLAGS.get(f.name, f.name)
            if dest in values:
                kwargs[f.name] = values[dest]
            elif f.name in cls.DEFAULTS:
                kwargs[f.name] = cls.DEFAULTS[f.name]
            else:
                raise AttributeError(f"the run configuration has no setting {dest!r} "
                                     f"(for {cls.__name__}.{f.name})")
        return cls(**kwargs)


@dataclass(frozen=True)
class ParallelDims(Section):
    """Sizes and this process's place in the (tensor, context, pipeline, data) grid
    (``cfg.parallel``)."""

    world: int
    """Number of processes."""
    tp: int
    """Tensor-model-parallel size (``--model-parallel-size``)."""
    pp: int
    """Pipeline stages (``--pipe-parallel-size``; 0 and 1 both mean one stage)."""
    dp: int
    """Data-parallel size: world / (tp x cp x pp)."""
    rank: int
    local_rank: int
    dist_backend: str
    """torch.distributed backend: ``nccl`` with GPUs, ``gloo`` without."""
    deepspeed: bool
    """``--deepspeed``: data parallelism through DeepSpeed's engine (ZeRO, its fp16)."""
    deepspeed_config: Optional[str]
    zero_stage: Optional[int]
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False
    """``--use-distributed-optimizer`` (or ZeRO stage 1 without ``--deepspeed``): Adam states
    sharded over the data x context ranks (megatron/optimizer/distributed.py)."""
    overlap_grad_reduce: bool = False
    """``--overlap-grad-reduce``: buckets reduced from the backward's hooks."""
    overlap_param_gather: bool = False
    """``--overlap-param-gather``: the distributed optimizer's all-gather left in flight."""
    ddp_bucket_size: Optional[int] = None
    """``--ddp-bucket-size``: elements per gradient bucket (None: the default)."""
    """Norm/dropout activations split along the sequence across the tp ranks."""
    vpp: int = 1
    """Model chunks per pipeline rank (``--virtual-pipeline-model-parallel-size``)."""
    pipeline_schedule: str = "1f1b"
    """``--pipeline-schedule``: ``1f1b``, ``interleaved`` (vpp > 1), ``zb-h1`` or ``zbv``
    (zero bubble; zbv has vpp 2 in a V placement); tds.pipe.schedules."""
    cp: int = 1
    """Context-parallel size (``--context-parallel-size``): ranks splitting each sequence."""
    cp_comm_type: str = "p2p"
    """``--cp-comm-type``: ``p2p`` (ring), ``all_gather`` or ``a2a`` (Ulysses)."""
    ep: int = 1
    """Expert-model-parallel size (``--expert-model-parallel-size``), out of dp x cp."""

    FLAGS: ClassVar[Dict[str, str]] = {
        "world": "world_size", "tp": "tensor_model_parallel_size",
        "pp": "pipeline_model_parallel_size", "dp": "data_parallel_size",
        "dist_backend": "distributed_backend", "vpp": "virtual_pipeline_model_parallel_size",
        "cp": "context_parallel_size", "ep": "expert_model_parallel_size"}
    DEFAULTS: ClassVar[Dict[str, Any]] = {"dp": 1, "world": 1, "rank": 0, "local_rank": 0,
                                          "dist_backend": None, "vpp": 1,
                                          "pipeline_schedule": "1f1b", "cp": 1,
                                          "cp_comm_type": "p2p", "ep": 1,
                                          "use_distributed_optimizer": False,
                                          "overlap_grad_reduce": False,
                                          "overlap_param_gather": False,
                                          "ddp_bucket_size": None}

    @property
    def pipeline_engine(self) -> bool:
        """Whether the run trains through tds's pipeline engine (:func:`uses_pipeline_engine`)."""
        return uses_pipeline_engine(self.pp)


@dataclass(frozen=True)
class PrecisionConfig(Section):
    """Compute precision and the fp16 loss scaler's settings (``cfg.precision``)."""

    dtype: torch.dtype
    """Compute dtype (autocast); master weights stay fp32."""
    params_dtype: torch.dtype
    loss_scale: float
    """Static scale; 0 = dynamic (fp16 only)."""
    initial_scale_power: int
    loss_scale_window: int
    hysteresis: int
    min_loss_scale: float
    fp8_format: Optional[str] = None
    """``--fp8-format``: ``e4m3``, ``hybrid`` or None (no FP8)."""
    fp8_recipe: Optional[str] = None
    """``--fp8-recipe``: ``tensorwise`` or ``rowwise`` (None without FP8)."""

    FLAGS: ClassVar[Dict[str, str]] = {"dtype": "compute_dtype"}
    DEFAULTS: ClassVar[Dict[str, Any]] = {"params_dtype": torch.float32, "fp8_format": None,
                                          "fp8_recipe": None}

    @property
    def fp8(self):
        """The :class:`megatron.mpu.Fp8Recipe` the transformer layers' linears run, or None."""
        if self.fp8_format is None:
            return None
        from ..mpu.fp8 import Fp8Recipe

        return Fp8Recipe(self.fp8_format, self.fp8_recipe or "tensorwise")

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
class OptimizerConfig(Section):
    """AdamW, gradient clipping and the learning-rate schedule (``cfg.optim``)."""

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
    skip_nonfinite_steps: bool
    """Skip (not stop at) a step whose gradient norm is inf/nan (DDP path)."""
    use_checkpoint_lr_scheduler: bool
    """On resume, the checkpoint's LR schedule rather than the flags'."""

    DEFAULTS: ClassVar[Dict[str, Any]] = {"use_checkpoint_lr_scheduler": False}

    @classmethod
    def derived(cls, values):
        return {"adam_betas": (values["adam_beta1"], values["adam_beta2"])}


@dataclass(frozen=True)
class BatchConfig(Section):
    """Batch sizes and run length (``cfg.batch``)."""

    micro_batch_size: int
    gas: int
    """Micro-batches per step (gradient accumulation)."""
    global_batch_size: int
    """micro_batch_size x gas x dp."""
    train_iters: int
    seq_length: int


@dataclass(frozen=True)
class ModelDims(Section):
    """The transformer's sizes and model options (``cfg.model``)."""

    num_layers: int
    """Layers (per stack for an encoder-decoder)."""
    hidden_size: int
    num_attention_heads: int
    kv_channels: int
    """Per-head size."""
    ffn_hidden_size: int
    max_position_embeddings: int
    padded_vocab_size: Optional[int]
    """Vocabulary rows of the embedding (the tokenizer's, padded for tp)."""
    true_vocab_size: Optional[int]
    """The tokenizer's vocabulary (padded rows beyond it get -inf logits)."""
    make_vocab_size_divisible_by: int
    hidden_dropout: float
    attention_dropout: float
    init_method_std: float
    layernorm_epsilon: float
    hidden_bias: bool
    checkpoint_activations: bool
    """Recompute each group of ``checkpoint_num_layers`` layers in the backward."""
    checkpoint_num_layers: int
    recompute_granularity: Optional[str]
    """``full``, ``selective`` or None (megatron/config/recompute.py)."""
    recompute_method: Optional[str]
    """Full recompute's ``uniform`` or ``block``; None otherwise."""
    recompute_num_layers: Optional[int]
    """Full recompute's group size (uniform) or layers per stage or chunk (block)."""
    seed: int
    """Base of the per-layer initialisation seeds and of the data order."""

    DEFAULTS: ClassVar[Dict[str, Any]] = {"padded_vocab_size": None, "true_vocab_size": None,
                                          "recompute_granularity": None,
                                          "recompute_method": None,
                                          "recompute_num_layers": None}


@dataclass(frozen=True)
class DataConfig(Section):
    """Data and tokenizer (``cfg.data``)."""

    data_path: Optional[List[str]]
    data_impl: str
    split: str
    num_workers: int
    """DataLoader worker processes."""
    prefetch_batches: int
    """Batches read ahead on a background thread (0: on the training thread)."""
    eod_mask_loss: bool
    reset_attention_mask: bool
    """Decoders: attention stays within each document (``--reset-attention-mask``)."""
    reset_position_ids: bool
    """Decoders: positions restart after each end-of-document token."""
    tokenizer_type: Optional[str]
    vocab_file: Optional[str]
    merge_file: Optional[str]
    tokenizer_model: Optional[str]
    vocab_extra_ids: int

    DEFAULTS: ClassVar[Dict[str, Any]] = {"prefetch_batches": 0, "reset_attention_mask": False,
                                          "reset_position_ids": False}


@dataclass(frozen=True)
class KernelConfig(Section):
    """How fast the step runs, not what it computes (``cfg.kernels``)."""

    masked_softmax_fusion: bool
    layernorm_fusion: Optional[bool]
    """True / False from ``--[no-]layernorm-fusion``; None: each norm's faster path on the
    device (``megatron.fused_kernels.NORM_FUSION_BY_DEFAULT``)."""
    attention_backend: str
    """``sdpa`` or ``unfused`` (megatron/model/attention.py)."""
    compile: bool
    """``torch.compile`` each pipeline chunk (pp 1: the model with its loss) as one region."""
    cuda_graphs: bool
    """CUDA graphs over the compiled regions (``mode="reduce-overhead"``)."""

    DEFAULTS: ClassVar[Dict[str, Any]] = {"attention_backend": "sdpa", "compile": False,
                                          "cuda_graphs": False}


@dataclass(frozen=True)
class LoggingConfig(Section):
    """The log line, evaluation and experiment tracking (``cfg.logging``)."""

    log_interval: int
    eval_interval: int
    eval_iters: int
    tensorboard_dir: Optional[str]
    peak_tflops: Optional[float]
    wandb_project: Optional[str]
    wandb_exp_name: Optional[str]
    wandb_save_dir: Optional[str]


@dataclass(frozen=True)
class CheckpointConfig(Section):
    """Saving and resuming (``cfg.checkpoint``)."""

    save: Optional[str]
    load: Optional[str]
    load_if_exists: bool
    save_interval: Optional[int]
    no_load_optim: bool
    no_load_rng: bool
    no_verify_checkpoint: bool
    """Read checkpoint files without checking them against their manifest's digests."""
    no_save_optim: bool
    finetune: bool
    exit_interval: Optional[int]


@dataclass(frozen=True)
class FaultConfig(Section):
    """Surviving the cluster: signal stops, background saves, hang detection (``cfg.faults``;
    docs/fault_tolerance.md)."""

    exit_signal_handler: bool
    """SIGTERM / SIGUSR1 on any rank: save at the next step boundary and exit 0."""
    exit_signal_check_interval: int
    """Steps between the ranks' agreements on a received signal."""
    async_save: bool
    """Checkpoints are snapshotted to host memory and written by a background thread."""
    step_timeout: Optional[float]
    """Seconds a step may take before the watchdog ends the process (None: no watchdog)."""
    startup_timeout: Optional[float]
    """Seconds from start-up to the first step's end (None: computed when the watchdog
    starts, from step_timeout, the checkpoint to load and --compile)."""
    save_timeout: Optional[float]
    """Seconds a save may take (derived from step_timeout)."""

    DEFAULTS: ClassVar[Dict[str, Any]] = {
        "exit_signal_handler": False, "exit_signal_check_interval": 1, "async_save": False,
        "step_timeout": None, "startup_timeout": None, "save_timeout": None}


@dataclass(frozen=True)
class MoESettings(Section):
    """Mixture of experts (``cfg.moe``; megatron/config/moe.py, docs/moe.md)."""

    num_experts: Optional[int]
    """Experts per MoE layer; None: no MoE layers."""
    moe_router_topk: int
    moe_router_load_balancing_type: str
    moe_aux_loss_coeff: float
    moe_z_loss_coeff: float
    moe_router_score_function: str
    moe_router_pre_softmax: bool
    moe_router_enable_expert_bias: bool
    moe_router_bias_update_rate: float
    moe_expert_capacity_factor: Optional[float]
    moe_token_drop_policy: str
    moe_token_dispatcher_type: str
    moe_grouped_gemm: bool
    moe_layer_freq: str
    moe_ffn_hidden_size: Optional[int]
    moe_shared_expert_intermediate_size: Optional[int]

    DEFAULTS: ClassVar[Dict[str, Any]] = {
        "num_experts": None, "moe_router_topk": 2, "moe_router_load_balancing_type": "aux_loss",
        "moe_aux_loss_coeff": 0.0, "moe_z_loss_coeff": 0.0, "moe_router_score_function":
        "softmax", "moe_router_pre_softmax": False, "moe_router_enable_expert_bias": False,
        "moe_router_bias_update_rate": 1e-3, "moe_expert_capacity_factor": None,
        "moe_token_drop_policy": "probs", "moe_token_dispatcher_type": "alltoall",
        "moe_grouped_gemm": False, "moe_layer_freq": "1", "moe_ffn_hidden_size": None,
        "moe_shared_expert_intermediate_size": None}

    @property
    def enabled(self) -> bool:
        return bool(self.num_experts)

    def layers(self, num_layers: int) -> list:
        """Which of a stack's ``num_layers`` layers are MoE layers (all False without MoE)."""
        if not self.enabled:
            return [False] * num_layers
        from .moe import moe_layer_pattern

        return moe_layer_pattern(self.moe_layer_freq, num_layers)

    def block(self, hidden_size: int, ffn_hidden_size: int, activation: str,
              init_method_std: float, output_init_std: Optional[float] = None):
        """The :class:`~megatron.mpu.moe.MoEConfig` of the run's MoE layers.

        Args:
            hidden_size: the model's width.
            ffn_hidden_size: the dense FFN's width (each expert's, without
                ``--moe-ffn-hidden-size``).
            activation: the experts' activation (the model's FFN's).
            init_method_std, output_init_std: the experts' initialisation.
        """
        from ..mpu.moe import MoEConfig

        return MoEConfig(
            num_experts=self.num_experts, hidden_size=hidden_size,
            ffn_hidden_size=self.moe_ffn_hidden_size or ffn_hidden_size,
            topk=self.moe_router_topk, score_function=self.moe_router_score_function,
            pre_softmax=self.moe_router_pre_softmax,
            load_balancing_type=self.moe_router_load_balancing_type,
            aux_loss_coeff=self.moe_aux_loss_coeff, z_loss_coeff=self.moe_z_loss_coeff or 0.0,
            enable_expert_bias=self.moe_router_enable_expert_bias,
            bias_update_rate=self.moe_router_bias_update_rate,
            capacity_factor=self.moe_expert_capacity_factor,
            token_drop_policy=self.moe_token_drop_policy,
            dispatcher=self.moe_token_dispatcher_type, grouped_gemm=self.moe_grouped_gemm,
            shared_expert_intermediate_size=self.moe_shared_expert_intermediate_size,
            activation=activation, init_method_std=init_method_std,
            output_init_std=output_init_std)


#: ``cfg.<name>`` -> its section class.
SECTIONS = {"parallel": ParallelDims, "precision": PrecisionConfig, "optim": OptimizerConfig,
            "batch": BatchConfig, "model": ModelDims, "data": DataConfig,
            "kernels": KernelConfig, "logging": LoggingConfig, "checkpoint": CheckpointConfig,
            "faults": FaultConfig, "moe": MoESettings}


class RunConfig:
    """Read-only view of a validated run: typed sections plus flat flags.

    Library code reads the typed sections (``cfg.parallel.tp``, ``cfg.model.hidden_size``,
    :data:`SECTIONS`; a family's own settings as ``cfg.<family name>``, e.g. ``cfg.t5``);
    Megatron-style user code reads flags flat (``get_args().hidden_size``).

    Args:
        values: every flag and derived value by its ``dest`` name.
        family: name of the model family the run was validated for (``gpt2``, ``t5``) or
            None for a model defined outside megatron-tds.
        family_settings: the family's section class (a :class:`Section`), or None.
        model_family: the :class:`~megatron.families.ModelFamily` object itself: it travels
            with the run, so loading a checkpoint never looks a family up by name.
    """

    __slots__ = ("_values", "family", "_family_settings", "_sections", "model_family")

    def __init__(self, values, family=None, family_settings=None, model_family=None):
        set_ = object.__setattr__
        set_(self, "_values", dict(values))
        set_(self, "family", family)
        set_(self, "_family_settings", family_settings)
        set_(self, "_sections", {})
        set_(self, "model_family", model_family)

    def __getattr__(self, name):
        sections = object.__getattribute__(self, "_sections")
        if name in sections:
            return sections[name]
        section = SECTIONS.get(name)
        if section is None and name == object.__getattribute__(self, "family"):
            section = object.__getattribute__(self, "_family_settings")
        values = object.__getattribute__(self, "_values")
        if section is not None:
            sections[name] = section.from_values(values)
            return sections[name]
        try:
            return values[name]
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
        return RunConfig({**self._values, **changes}, self.family, self._family_settings,
                         self.model_family)


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

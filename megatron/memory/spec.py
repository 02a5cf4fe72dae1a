"""What the memory model reads: the sizes, the layout and the precision of a run.

:class:`MemorySpec` is a plain frozen record, built from a run configuration by
:func:`spec_from_run_config` (the start-up check) or varied with ``dataclasses.replace``
(the layout planner), so the model never needs a process group, a tokenizer or a device.
"""
from dataclasses import dataclass, replace
from typing import List, Optional, Tuple

from ..common.errors import ConfigError

#: Bytes per element of each precision's activations and low-precision weights.
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class MemorySpec:
    """One run's sizes, layout and precision, as the memory model sees them.

    ``backend`` is ``ddp`` (the project's step at every layout: autocast over fp32 weights,
    one fp32 gradient buffer, the distributed optimizer as ZeRO stage 1) or ``engine``
    (DeepSpeed's, ``--deepspeed`` at pp 1: fp16 / bf16 weights with fp32 masters, ZeRO)
    (megatron/training/backend_factory.py).
    ``device`` is ``cuda`` or ``cpu``: dropout keeps a 1-byte mask on CUDA but a mask in the
    activation's dtype on the CPU.
    """

    family: str
    num_layers: int
    """Layers (per stack for T5)."""
    hidden: int
    heads: int
    kv_channels: int
    ffn: int
    vocab: int
    """Padded vocabulary rows."""
    seq: int
    """Sequence length (T5: the encoder's)."""
    micro_batch: int
    num_micro_batches: int
    """Micro-batches per step per data-parallel rank (gradient accumulation)."""
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    """Context-parallel size (``--context-parallel-size``): each sequence is split across
    ``cp`` ranks, ``seq / cp`` tokens each (docs/scale_out.md); the weights are replicated
    over them and the gradients reduced over data x context (:attr:`grad_ranks`)."""
    cp_comm: str = "p2p"
    """``--cp-comm-type``: ``p2p`` (the ring), ``all_gather`` or ``a2a`` (Ulysses)."""
    vpp: int = 1
    """Model chunks per pipeline rank (interleaved schedule; ZB-V: 2)."""
    schedule: str = ""
    """``--pipeline-schedule`` (1f1b, interleaved, zb-h1, zbv); empty: 1f1b, or interleaved
    when vpp > 1."""
    sequence_parallel: bool = False
    recompute: str = "none"
    """``none``, ``full`` (--recompute-granularity full / --checkpoint-activations) or
    ``selective`` (the attention core, where it keeps ``s x s`` tensors)."""
    recompute_method: str = "uniform"
    """Full recompute: ``uniform`` (each group of ``recompute_num_layers`` layers keeps its
    input) or ``block`` (the first ``recompute_num_layers`` layers of each stage or chunk
    keep their input, the others everything)."""
    recompute_num_layers: int = 1
    dtype: str = "fp32"
    backend: str = "ddp"
    zero_stage: int = 0
    """DeepSpeed's ZeRO stage (``engine``); under the project's step (``ddp``) 1 is its
    distributed optimizer (``--use-distributed-optimizer``)."""
    overlap_grad_reduce: bool = False
    """The project's step reduces each gradient bucket from the backward's hooks
    (``--overlap-grad-reduce``); step time only."""
    attention: str = "sdpa"
    """``sdpa`` or ``unfused`` (megatron/model/attention.py)."""
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    bias: bool = True
    max_positions: int = 1024
    device: str = "cuda"
    dec_seq: int = 0
    """T5's decoder length."""
    ff_type: str = "relu"
    """T5's feed-forward (``relu`` or ``gated-gelu``)."""
    tie_embeddings: bool = True
    """The output layer is the word embedding (GPT-2, T5 v1.0) rather than a weight of its
    own."""
    norm: str = "layernorm"
    """``layernorm`` (weight, bias, two fp32 statistics per row) or ``rmsnorm`` (weight, one
    statistic)."""
    mlp: str = "gelu"
    """``gelu`` (fc1, GeLU, fc2) or ``swiglu`` (gate and up GEMMs of one input, SiLU, their
    product, down: Llama's)."""
    kv_heads: int = 0
    """Key / value heads (grouped-query attention); 0: as many as ``heads``."""
    positions: str = "learned"
    """``learned``: GPT-2's position table beside the word embedding; ``rotary`` (each layer
    keeps its fp32 cos and sin) / ``none``: no table."""
    mask_tensor: bool = False
    """The layers hand SDPA the causal mask as a tensor, which it keeps per layer as an
    additive mask in the compute dtype (GPT-2 uses ``is_causal``: none)."""
    separate_projections: bool = False
    """q, k, v (and a gated MLP's gate and up) are separate linear layers, each casting its
    own copy of their input under autocast (GPT-2: one fused QKV, one fc1)."""
    num_buckets: int = 32
    vocab_padded: bool = True
    """The output layer's rows include padding beyond the tokenizer's vocabulary: their
    logits are filled with -inf in place on a view, so the backward copies the logits'
    gradient once more (autograd's CopySlices)."""
    fused_elementwise: bool = False
    """The step runs Megatron-LM's fused bias-dropout-add and bias-GeLU kernels (the
    published tables' runs): each layer moves ``10 e h + 2 h`` bytes per token around
    its GEMMs (+ ``2 e f / t``) instead of this project's separate bias, dropout and
    residual ops' ``16 e h`` (+ ``4 e f / t``); step time only (megatron/memory/step_time.py)."""
    num_experts: int = 0
    """Experts per MoE layer (``--num-experts``); 0: dense feed-forward layers only
    (megatron/memory/moe.py describes the MoE layers)."""
    moe_topk: int = 2
    moe_ffn: int = 0
    """Each expert's feed-forward width (``--moe-ffn-hidden-size``; 0: ``ffn``)."""
    moe_layers: Tuple[bool, ...] = ()
    """Per layer: an MoE block in the MLP's place (``--moe-layer-freq``; empty: every
    layer when ``num_experts``)."""
    moe_shared_ffn: int = 0
    """The shared experts' width (``--moe-shared-expert-intermediate-size``; 0: none)."""
    ep: int = 1
    """Expert-parallel size: ranks splitting each MoE layer's experts, carved out of the
    data x context ranks."""
    capacity_factor: float = 0.0
    """``--moe-expert-capacity-factor``; 0: dropless (balanced routing assumed)."""
    moe_dispatcher: str = "alltoall"
    moe_grouped: bool = False
    """``--moe-grouped-gemm`` (one ``torch._grouped_mm``; else the per-expert loop)."""
    moe_rows_factor: float = 1.0
    """Dropless: the rows this rank's experts compute over the balanced ``T k`` (1.0:
    balanced routing, the planner's and the start-up check's assumption; above 1 for the
    headroom of a skewed router)."""
    moe_aux_loss: bool = False
    """A load-balancing loss (softmax or sigmoid scores over all experts kept)."""
    moe_z_loss: bool = False
    grad_accum: str = ""
    """DeepSpeed's ``data_types.grad_accum_dtype`` (``fp32``, ``bf16``, ``fp16``; empty: the
    weights' dtype): the dtype of the BF16_Optimizer's flat gradient buffer."""

    @property
    def kv_proj(self) -> int:
        """Width of the key (and of the value) projection."""
        return (self.kv_heads or self.heads) * self.kv_channels

    @property
    def qkv_width(self) -> int:
        """Width of the query, key and value projections together."""
        return self.heads * self.kv_channels + 2 * self.kv_proj

    @property
    def gated(self) -> bool:
        """Two ``ffn``-wide GEMMs of the MLP's input (SwiGLU, T5's gated GeLU)."""
        return self.mlp == "swiglu" or (self.family == "t5" and self.ff_type == "gated-gelu")

    @property
    def norm_stats(self) -> int:
        """fp32 statistics a norm keeps per row (LayerNorm 2, RMSNorm 1)."""
        return 1 if self.norm == "rmsnorm" else 2

    @property
    def e(self) -> int:
        """Bytes per element of the activations (the compute dtype)."""
        return DTYPE_BYTES[self.dtype]

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def seq_local(self) -> int:
        """Tokens of a sequence on one rank (``seq / cp``; T5: the encoder's, cp 1)."""
        return self.seq // self.cp

    @property
    def grad_ranks(self) -> int:
        """Ranks a weight's gradient is reduced over (data x context parallel: the data
        parallel group DeepSpeed and DDP are given); ZeRO partitions over them."""
        return self.dp * self.cp

    @property
    def ring(self) -> bool:
        """The attention is context-parallel (megatron/mpu/cp_attention.py): whatever
        ``--attention-backend`` says, no ``s x s`` tensor is kept, nothing for selective
        recompute, and the pipeline passes the token layout instead of the mask."""
        return self.cp > 1

    @property
    def autocast(self) -> bool:
        """The DDP backend runs a half dtype by autocast over fp32 weights."""
        return self.backend == "ddp" and self.dtype != "fp32"

    @property
    def residual_bytes(self) -> int:
        """Bytes per element of the residual stream: fp32 under autocast (the fp32 biases
        promote it), the weights' dtype under the engine."""
        return 4 if self.backend == "ddp" else self.e

    @property
    def pipeline_schedule(self) -> str:
        """The schedule's name (:data:`schedule`, or what vpp implies)."""
        return self.schedule or ("interleaved" if self.vpp > 1 else "1f1b")

    def check(self) -> None:
        """Raise :class:`~megatron.common.errors.ConfigError` for a spec the model cannot describe."""
        problems = []
        if self.family not in ("gpt2", "t5"):
            problems.append(f"family {self.family!r}: the memory model knows gpt2 and t5")
        if self.dtype not in DTYPE_BYTES:
            problems.append(f"dtype {self.dtype!r}: choose one of {sorted(DTYPE_BYTES)}")
        if self.recompute not in ("none", "full", "selective"):
            problems.append(f"recompute {self.recompute!r}: choose none, full or selective")
        if self.recompute_method not in ("uniform", "block") or self.recompute_num_layers < 1:
            problems.append(f"recompute method {self.recompute_method!r} with "
                            f"{self.recompute_num_layers} layers: choose uniform or block and "
                            f"at least 1 layer")
        if self.family == "t5" and (self.recompute == "selective" or
                                    self.recompute_method == "block" and
                                    self.recompute == "full"):
            problems.append("T5 with selective or block recompute: the model describes T5's "
                            "uniform full recompute only (not measured otherwise)")
        problems += self._layer_problems()
        if self.attention not in ("sdpa", "unfused"):
            problems.append(f"attention {self.attention!r}: choose sdpa or unfused")
        if self.zero_stage not in (0, 1, 2):
            problems.append(f"ZeRO stage {self.zero_stage}: the model covers 0, 1 and 2")
        if self.zero_stage == 2 and self.backend != "engine":
            problems.append("ZeRO stage 2 needs DeepSpeed's engine (--deepspeed, pp 1); stage "
                            "1 is the distributed optimizer")
        if self.zero_stage == 2 and self.pp > 1:
            problems.append("ZeRO stage 2 does not combine with pipeline stages")
        if min(self.tp, self.pp, self.dp, self.cp, self.vpp, self.micro_batch) < 1:
            problems.append("tp, pp, dp, cp, vpp and the micro-batch size must be >= 1")
        if self.heads % self.tp:
            problems.append(f"{self.heads} heads do not split over tp={self.tp}")
        problems += self.cp_problems()
        problems += self._grad_accum_problems()
        if self.num_experts:
            from .moe import moe_problems

            problems += moe_problems(self)
        if problems:
            raise ConfigError("memory model: " + "; ".join(problems))

    def _layer_problems(self):
        problems = []
        for name, value, choices in (("norm", self.norm, ("layernorm", "rmsnorm")),
                                     ("mlp", self.mlp, ("gelu", "swiglu")),
                                     ("positions", self.positions, ("learned", "rotary",
                                                                    "none"))):
            if value not in choices:
                problems.append(f"{name} {value!r}: choose one of {', '.join(choices)}")
        kv = self.kv_heads or self.heads
        if self.heads % kv or kv % self.tp:
            problems.append(f"{kv} key/value heads must divide the {self.heads} heads and "
                            f"split over tp={self.tp}")
        return problems

    def cp_problems(self) -> List[str]:
        """What context parallelism allows (megatron/config/context_parallel.py's rules):
        the problems of this spec's cp, empty when it is allowed (the planner's filter)."""
        if self.cp_comm not in ("p2p", "all_gather", "a2a"):
            return [f"cp_comm {self.cp_comm!r}: choose p2p, all_gather or a2a"]
        if self.cp == 1:
            return []
        problems = []
        if self.family == "t5":
            problems.append("T5 with cp > 1: encoder-decoder context parallelism is not "
                            "implemented")
        if self.seq % (2 * self.cp):
            problems.append(f"sequence {self.seq} does not cut into 2 x cp = {2 * self.cp} "
                            f"chunks")
        elif self.sequence_parallel and (self.seq // self.cp) % self.tp:
            problems.append(f"sequence parallelism splits {self.seq // self.cp} tokens per "
                            f"context-parallel rank over tp={self.tp}")
        if self.cp_comm == "a2a" and (self.heads // self.tp) % self.cp:
            problems.append(f"a2a gives each of cp={self.cp} ranks whole heads of the "
                            f"{self.heads // self.tp} on a tensor-parallel rank")
        if self.attention_dropout > 0:
            problems.append("attention dropout under cp > 1 (not implemented)")
        return problems

    @property
    def accum_bytes(self) -> int:
        """Bytes per element of the BF16_Optimizer's gradient accumulation buffer."""
        return DTYPE_BYTES[self.grad_accum or self.dtype]

    def _grad_accum_problems(self):
        if self.grad_accum not in ("",) + tuple(DTYPE_BYTES):
            return [f"grad_accum_dtype {self.grad_accum!r}: choose one of {sorted(DTYPE_BYTES)}"]
        if self.backend == "engine" and self.grad_accum not in ("", self.dtype) and \
                not self.zero_stage:
            # DeepSpeed 0.19's _do_optimizer_sanity_check: "unsupported mix of model_dtype
            # and grad_accum_dtype" unless ZeRO is on
            return [f"grad_accum_dtype {self.grad_accum} with {self.dtype} weights needs ZeRO "
                    f"(DeepSpeed supports that mix only with zero_optimization.stage >= 1)"]
        return []


#: DeepSpeed's spellings of ``data_types.grad_accum_dtype`` (its DtypeEnum).
GRAD_ACCUM_NAMES = {"fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
                    "bf16": "bf16", "bfloat16": "bf16", "bfloat": "bf16",
                    "torch.bfloat16": "bf16", "fp16": "fp16", "float16": "fp16",
                    "half": "fp16", "torch.float16": "fp16"}


def _deepspeed_json(cfg, what: str) -> dict:
    """The run's ``--deepspeed_config`` JSON as a dict ({} without one)."""
    path = cfg.parallel.deepspeed_config
    if not path:
        return {}
    import json

    try:
        with open(path, encoding="utf-8") as handle:
            config = json.load(handle)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"memory model: cannot read {what} from {path}: {exc}; "
                          f"fix the file") from None
    if not isinstance(config, dict):
        raise ConfigError(f"memory model: {path} is not a JSON object (DeepSpeed's config is "
                          f"one); cannot read {what}")
    return config


def _zero_stage(cfg) -> int:
    """--zero-stage, else the DeepSpeed JSON's ``zero_optimization.stage`` (the backend reads
    the same two places, the flag winning)."""
    if cfg.parallel.zero_stage is not None:
        return cfg.parallel.zero_stage
    config = _deepspeed_json(cfg, "the ZeRO stage (or give --zero-stage)")
    try:
        return int(config.get("zero_optimization", {}).get("stage", 0))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"memory model: zero_optimization.stage in "
                          f"{cfg.parallel.deepspeed_config}: {exc}") from None


def _grad_accum(cfg) -> str:
    """The DeepSpeed JSON's ``data_types.grad_accum_dtype`` as ``fp32`` / ``bf16`` / ``fp16``
    ("" when it does not set one: DeepSpeed then accumulates in the weights' dtype)."""
    data_types = _deepspeed_json(cfg, "data_types.grad_accum_dtype").get("data_types")
    value = data_types.get("grad_accum_dtype") if isinstance(data_types, dict) else None
    if value is None:
        return ""
    name = GRAD_ACCUM_NAMES.get(str(value).lower())
    if name is None:
        raise ConfigError(f"memory model: data_types.grad_accum_dtype {value!r} in "
                          f"{cfg.parallel.deepspeed_config}: DeepSpeed takes one of "
                          f"{sorted(GRAD_ACCUM_NAMES)}")
    return name


def _recompute(m) -> dict:
    """The recompute fields of a run's model section (a saved configuration without the
    granularity: --checkpoint-activations' full, uniform)."""
    granularity = m.recompute_granularity or ("full" if m.checkpoint_activations else None)
    if granularity == "full":
        method = m.recompute_method or "uniform"
        count = m.recompute_num_layers or m.checkpoint_num_layers
        return dict(recompute="full", recompute_method=method, recompute_num_layers=count)
    return dict(recompute=granularity or "none")


def _backend(cfg) -> str:
    """``engine``: DeepSpeed's (``--deepspeed`` at pp 1); ``ddp``: the project's own step
    (gradient buffers, autocast over fp32 weights) at every other layout."""
    return "engine" if cfg.parallel.deepspeed and cfg.parallel.pp <= 1 else "ddp"


def memory_model_of(cfg) -> Optional[str]:
    """The kind of memory model of a run's model (``gpt2``: a decoder- or encoder-only
    description; ``t5``; None: none) from its family's ``memory_model``
    (:mod:`~megatron.memory.describe`); a configuration without a family object (a saved
    one) by its name."""
    described = _described(cfg)
    return described[0] if described else None


def _described(cfg):
    """:func:`~megatron.memory.describe.describe` of the run's family (None: none)."""
    from .describe import describe

    family = cfg.model_family
    if family is not None:
        return describe(family.memory_model, cfg)
    return (cfg.family, {}) if cfg.family in ("gpt2", "t5") else None


def spec_from_run_config(cfg, device: Optional[str] = None, vocab: Optional[int] = None
                         ) -> MemorySpec:
    """The :class:`MemorySpec` of a validated run configuration.

    Args:
        cfg: a :class:`~megatron.config.RunConfig`.
        device: ``cuda`` or ``cpu`` (default: ``cuda`` when the run's backend is NCCL).
        vocab: padded vocabulary rows when the configuration has none (built without its
            tokenizer, as the planner does).

    Raises:
        ConfigError: a run the model does not describe (the start-up check then says so
            and predicts nothing).
    """
    m, p, k = cfg.model, cfg.parallel, cfg.kernels
    rows = m.padded_vocab_size or vocab
    if rows is None:
        raise ConfigError("memory model: the vocabulary size is unknown; give the tokenizer "
                          "files or the planner's --vocab-size")
    dtype = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[cfg.precision.name]
    extra = {"seq": cfg.batch.seq_length}
    kind, layer = _described(cfg) or ("gpt2", {})
    if kind == "t5":
        try:
            t5 = getattr(cfg, cfg.family)
            extra = dict(seq=t5.enc_seq_length, dec_seq=t5.dec_seq_length, ff_type=t5.t5_ff,
                         tie_embeddings=not t5.untie_embeddings,
                         num_buckets=t5.relative_attention_num_buckets)
        except AttributeError as exc:
            raise ConfigError(f"memory model: the encoder-decoder description reads T5's "
                              f"settings (encoder and decoder lengths, feed-forward, buckets), "
                              f"which the {cfg.family!r} family lacks ({exc})") from None
    from ..model.attention import resolve_attention_backend

    backend = _backend(cfg)
    spec = MemorySpec(
        family=kind, num_layers=m.num_layers, hidden=m.hidden_size,
        heads=m.num_attention_heads, kv_channels=m.kv_channels, ffn=m.ffn_hidden_size,
        vocab=rows, micro_batch=cfg.batch.micro_batch_size,
        num_micro_batches=cfg.batch.gas, tp=p.tp, pp=max(p.pp, 1), dp=p.dp,
        cp=getattr(p, "cp", 1), cp_comm=getattr(p, "cp_comm_type", "p2p"), vpp=p.vpp,
        schedule=p.pipeline_schedule if p.pp > 1 else "",
        sequence_parallel=p.sequence_parallel,
        **_recompute(m), dtype=dtype, backend=backend,
        # the project's step: ZeRO stage 1 is its distributed optimizer (the flag or the JSON)
        zero_stage=_zero_stage(cfg) if backend == "engine" else
        int(bool(p.use_distributed_optimizer)),
        overlap_grad_reduce=backend == "ddp" and bool(p.overlap_grad_reduce),
        attention=resolve_attention_backend(k.attention_backend),
        hidden_dropout=m.hidden_dropout, attention_dropout=m.attention_dropout,
        bias=m.hidden_bias, max_positions=m.max_position_embeddings,
        device=device or ("cuda" if p.dist_backend == "nccl" else "cpu"),
        vocab_padded=m.true_vocab_size is None or m.true_vocab_size < rows,
        grad_accum=_grad_accum(cfg) if backend == "engine" else "", **extra)
    spec = replace(spec, **layer)  # the family's description of its layers
    from .moe import moe_fields

    spec = replace(spec, **moe_fields(cfg))
    spec.check()
    return spec

"""What every model family is: :class:`ModelFamily`, and the settings all transformers share
(the package docstring, :mod:`megatron.families`, explains the interface)."""
import argparse
from dataclasses import dataclass, field
from types import ModuleType
from typing import (TYPE_CHECKING, Any, Callable, Dict, FrozenSet, List, Optional, Protocol,
                    Sequence, Tuple, Union)

import torch

from ..config.run_config import V_SCHEDULE, RunConfig

if TYPE_CHECKING:  # megatron.memory sits above the families; the table is the HF tools'
    from ..checkpoint_conversion.hf_table import HFNameTable
    from ..memory.describe import LayerDescription

#: A model's inputs and labels: ``((inputs...), (labels...))``, as the pipeline moves them.
Batch = Tuple[tuple, tuple]
#: ``batch_fn(raw batch, or None on the ranks that do not read) -> Batch``.
BatchFn = Callable[[Optional[Any]], Batch]
#: A loss, or a loss with the named values logged beside it.
Loss = Union[torch.Tensor, Tuple[torch.Tensor, Dict[str, Any]]]
#: train / valid / test datasets (None for an empty split).
Datasets = Tuple[Optional[Any], Optional[Any], Optional[Any]]


class ModelConfigHook(Protocol):
    """``model_config(cfg, dropout=True) -> the model's config dataclass``."""

    def __call__(self, cfg: RunConfig, dropout: bool = True) -> Any: ...


class BuildModelHook(Protocol):
    """``build_model(cfg, pipeline) -> nn.Module``."""

    def __call__(self, cfg: RunConfig, pipeline: bool) -> torch.nn.Module: ...


def _no_problems(*_):
    return None


#: Generic features a model must implement for their flag to mean anything: feature -> the
#: flag that asks for it and whether it is on in a parsed namespace (or a RunConfig). A family
#: gets those it provides (:func:`provided_problems`); a declared ``ModelFamily.supports``
#: narrows them, and a run asking for another is refused at start-up
#: (:func:`unsupported_flags`), not silently ignored.
FEATURES: Dict[str, Tuple[str, Callable]] = {
    "sequence_parallel": ("--sequence-parallel",
                          lambda ns: bool(getattr(ns, "sequence_parallel", False))),
    "checkpoint_activations": ("--checkpoint-activations",  # = --recompute-granularity full
                               lambda ns: bool(getattr(ns, "checkpoint_activations", False))),
    "selective_recompute": ("--recompute-granularity selective",
                            lambda ns: getattr(ns, "recompute_granularity", None) == "selective"),
    "recompute_block": ("--recompute-method block",
                        lambda ns: getattr(ns, "recompute_method", None) == "block"),
    "virtual_pipeline": ("--virtual-pipeline-model-parallel-size",
                         lambda ns: (getattr(ns, "virtual_pipeline_model_parallel_size", None)
                                     or 1) > 1),
    "pipeline": ("--pipeline-model-parallel-size",
                 lambda ns: (getattr(ns, "pipeline_model_parallel_size", None) or 1) > 1),
    "context_parallel": ("--context-parallel-size",
                         lambda ns: (getattr(ns, "context_parallel_size", None) or 1) > 1),
    "document_masking": ("--reset-attention-mask / --reset-position-ids",
                         lambda ns: bool(getattr(ns, "reset_attention_mask", False)
                                         or getattr(ns, "reset_position_ids", False))),
    "moe": ("--num-experts", lambda ns: bool(getattr(ns, "num_experts", None))),
    "fp8": ("--fp8-format", lambda ns: bool(getattr(ns, "fp8_format", None))),
}

#: Features a family provides when the model config it builds from the run carries them
#: switched on (the layers read them there): feature -> the model config's attribute
#: (``model_config(cfg).sequence_parallel`` / ``.checkpoint_activations`` /
#: ``.recompute_granularity`` / ``.recompute_method``; MoE: ``.moe``, the
#: :class:`megatron.mpu.moe.MoEConfig` its layers build MoE blocks from; context
#: parallelism and document masking: ``.token_layout``, the attention taking mpu's token
#: layout, docs/new_model.md; FP8: ``.fp8``, the recipe its layers pass to the mpu linears).
#: The pipeline ones are provided by ``build_model(cfg,
#: pipeline=True)`` itself, checked when it is built
#: (:func:`megatron.training.backend_factory.check_pipeline_module`).
FROM_MODEL_CONFIG = {"sequence_parallel": "sequence_parallel",
                     "checkpoint_activations": "checkpoint_activations",
                     "selective_recompute": "recompute_granularity",
                     "recompute_block": "recompute_method",
                     "context_parallel": "token_layout", "document_masking": "token_layout",
                     "moe": "moe", "fp8": "fp8"}


def unsupported_flags(ns: argparse.Namespace, family: "ModelFamily") -> List[str]:
    """One message per flag of ``ns`` that asks for a feature outside ``family``'s declared
    ``supports`` (none when it declares nothing: then :func:`provided_problems` decides).

    Args:
        ns: the parsed flags (a namespace).
        family: a :class:`ModelFamily`.
    """
    if family.supports is None:
        return []
    return [f"{flag} is not supported by the {family.name!r} model family (its supports "
            f"declares {', '.join(sorted(family.supports)) or 'none of the optional features'}"
            f"); drop the flag, or implement it and add {feature!r} to the family's supports "
            f"(or leave supports out: the family then gets what it provides)"
            for feature, (flag, asked) in FEATURES.items()
            if asked(ns) and feature not in family.supports]


def provided_problems(cfg: RunConfig, family: "ModelFamily") -> List[str]:
    """One message per flag of the run ``cfg`` asking for a feature that ``family`` declares
    (or, declaring nothing, may have) but whose model config does not carry
    (:data:`FROM_MODEL_CONFIG`): the layers would not see it and train without it.

    Args:
        cfg: the frozen :class:`~megatron.config.RunConfig`.
        family: a :class:`ModelFamily`.
    """
    asked = [f for f in FROM_MODEL_CONFIG if FEATURES[f][1](cfg)
             and (family.supports is None or f in family.supports)]
    if not asked:
        return []
    config = family.model_config(cfg)
    return [f"{FEATURES[f][0]} is not supported by the {family.name!r} model family: its "
            f"model config ({type(config).__name__}) does not carry "
            f"{FROM_MODEL_CONFIG[f]}=True, so its layers would not see the flag; drop it, or "
            f"implement it (model_config sets {FROM_MODEL_CONFIG[f]} from the run and the "
            f"layers use it: docs/new_model.md)"
            for f in asked if not getattr(config, FROM_MODEL_CONFIG[f], False)]


@dataclass(frozen=True)
class ModelFamily:
    """The per-model description: every hook, what it receives and returns, is documented
    here, on its field (the module docstring of :mod:`megatron.families` gives the overview).
    ``cfg`` is the frozen :class:`~megatron.config.RunConfig`; ``ns`` the parsed flags
    (an ``argparse.Namespace``) before the configuration is frozen."""

    name: str
    """The family's name (``cfg.family``; the registry's key)."""
    add_flags: Callable[[argparse.ArgumentParser], Optional[argparse.ArgumentParser]]
    """``add_flags(parser)``: add the family's own flags to the run's parser (the return
    value, if any, is ignored)."""
    model_config: ModelConfigHook
    """``model_config(cfg, dropout=True) -> model config``: the model's config dataclass from
    a run configuration or a checkpoint's saved settings (``dropout=False``: inference,
    dropout probabilities 0): the only place a model config is built from flags."""
    build_model: BuildModelHook
    """``build_model(cfg, pipeline) -> nn.Module``: the model; with ``pipeline`` the same
    layers as pipeline stages (a tds ``PipelineModule``), decided by the backend factory."""
    build_datasets: Callable[[RunConfig, Any, Sequence[int]], Datasets]
    """``build_datasets(cfg, tokenizer, num_samples) -> (train, valid, test)``: the datasets
    for ``num_samples`` samples of each split (None for an empty split)."""
    flops_per_step: Optional[Callable[[RunConfig], float]]
    """``flops_per_step(cfg) -> float``: model FLOPs of one step (the log's TFLOP/s and MFU);
    None: the log says "n/a"."""
    make_batch_fn: Callable[[RunConfig, Any], BatchFn]
    """``make_batch_fn(cfg, tokenizer) -> f(raw batch or None) -> (inputs, labels)``: tensor-
    parallel rank 0 reads, the batch is shared with its group, masks are built on the device."""
    loss_fn: Callable[[Any, tuple], Loss]
    """``loss_fn(outputs, labels) -> scalar loss`` of the model's (or last stage's) outputs,
    or ``(loss, {name: value})``: the values are logged beside ``lm loss`` (averaged over
    micro-batches and data-parallel ranks), at pp 1 and pp > 1 alike."""
    keys: Optional[ModuleType] = None
    """The checkpoint key map (:mod:`megatron.checkpoint.gpt2_keys` / ``t5_keys``): a run
    of this family moves a checkpoint to another layout with it where the checkpoint's
    sharding record does not do (no record, or names that depend on the layout); its
    ``matches(args, names)`` must accept the checkpoint. None: the record alone (a model
    built from mpu layers whose names do not depend on the layout needs nothing more)."""
    hf: Optional[ModuleType] = None
    """The Hugging Face adapter (``read_hf`` / ``write_hf``, megatron.checkpoint_conversion)."""
    hf_names: Optional["HFNameTable"] = None
    """The Hugging Face name table (:class:`megatron.checkpoint_conversion.hf_table.
    HFNameTable`: our name <-> the ``transformers`` model's, and the configs): with it
    ``tools/convert_checkpoint.py --family ...`` converts the family to and from HF at any
    layout, the shard dimensions read from the sharding record. None: native -> native only."""
    foreign_checkpoints: Tuple[ModuleType, ...] = ()
    """Other projects' checkpoint formats ``--load`` takes for this model (each with
    ``NAME``, ``DESCRIPTION``, ``detect(root)`` and ``read_full(root, iteration, hints)``:
    :mod:`megatron.checkpoint.megatron_core` and :mod:`megatron.checkpoint.megatron_lm`
    for GPT-2; a format may add ``describe(root)``, the words ``--load`` logs)."""
    flag_defaults: Dict[str, Any] = field(default_factory=dict)
    """Defaults the family sets for generic flags (a config file or a flag overrides them)."""
    label: str = ""
    """Name in the configuration error's heading ("invalid T5 configuration")."""
    layer_stacks: int = 1
    """Stacks of --num-layers layers (2 for an encoder-decoder), for the pipeline check."""
    derive: Callable[[argparse.Namespace], None] = _no_problems
    """``derive(ns) -> None``: fill the family's derived flags in ``ns`` before the generic
    checks."""
    validate: Callable[[argparse.Namespace, List[str]], None] = _no_problems
    """``validate(ns, problems) -> None``: append a message to ``problems`` for each bad
    family setting (all of them are reported at once)."""
    validate_with_tokenizer: Callable[[argparse.Namespace, Any, List[str]], None] = _no_problems
    """``validate_with_tokenizer(ns, tokenizer, problems) -> None``: the checks that need the
    vocabulary, appending to ``problems``."""
    settings: Optional[type] = None
    """The family's own flags as a typed section (``cfg.<name>``, a config ``Section``)."""
    checked_settings: Tuple[str, ...] = ()
    """Flag names (``dest``) a resume must match besides the generic model settings
    (``rope_theta``): a checkpoint saved with another value is refused."""
    compile_classes: Optional[Tuple[type, ...]] = None
    """``()``: ``--compile`` compiles nothing (the log says so); otherwise ``--compile``
    compiles each pipeline chunk (pp = 1: the whole model with its loss) as one region
    (megatron/model/compile.py). The classes named here are what
    :func:`megatron.model.compile.compile_layers` compiles for a per-layer comparison."""
    supports: Optional[FrozenSet[str]] = None
    """Optional generic features (:data:`FEATURES`: ``sequence_parallel``,
    ``checkpoint_activations``, ``selective_recompute``, ``recompute_block``,
    ``virtual_pipeline``, ``pipeline``, ``context_parallel``,
    ``document_masking``, ``moe``). None (the default): what
    the family provides: the pipeline ones through ``build_model(cfg, pipeline=True)`` (a
    ``PipelineModule`` with ``num_virtual_stages`` chunks, checked when it is built),
    sequence parallelism and recompute when ``model_config(cfg)`` carries them, context
    parallelism and document masking when it carries ``token_layout``. A declared
    set narrows that: a flag asking for a feature outside it is refused at start-up."""
    memory_model: Union[None, str, "LayerDescription",
                        Callable[[RunConfig], "LayerDescription"]] = None
    """The startup memory check's and tools/plan_layout.py's description of the model:
    ``"gpt2"`` / ``"decoder"`` / ``"encoder"`` (GPT-2's layers with the run's sizes),
    ``"t5"`` (T5's, from T5's settings), a ``megatron.memory.LayerDescription`` of the family's
    layers (or a function of the run configuration returning one), or None (no memory
    model: said so); megatron/memory/describe.py."""

    def unsupported_flags(self, ns: argparse.Namespace) -> List[str]:
        """Messages for the flags of ``ns`` asking for features outside ``supports``."""
        return unsupported_flags(ns, self)

    def provided_problems(self, cfg: RunConfig) -> List[str]:
        """Messages for the flags of the run ``cfg`` asking for features its model config
        does not carry (:func:`provided_problems`)."""
        return provided_problems(cfg, self)

    def config_from_saved(self, saved: Dict[str, Any]) -> Any:
        """The dropout-free fp32 model config of a checkpoint's saved ``args`` dict
        (settings it lacks take today's flag defaults)."""
        from ..config import saved_run_config

        flags = saved_run_config(saved, self).replace(compute_dtype=torch.float32,
                                                      checkpoint_activations=False,
                                                      recompute_granularity=None,
                                                      recompute_method=None,
                                                      fp8_format=None, fp8_recipe=None)
        return self.model_config(flags, dropout=False)

    def forward_step(self, batch_fn: BatchFn) -> Callable[[Any, torch.nn.Module], Loss]:
        """Megatron's ``forward_step(data_iterator, model) -> (loss, {"lm loss": ...})`` for
        the serial model, from the family's batch function and loss (with the stats the loss
        returns, as the pipeline's schedule takes them)."""
        from ..model.compile import model_loss

        def forward_step(data_iterator, model):
            raw = next(data_iterator) if data_iterator is not None else None
            inputs, labels = batch_fn(raw)
            # with --compile, the loss inside the model's compiled region
            result = model_loss(model, inputs, labels, self.loss_fn)
            loss, stats = result if isinstance(result, tuple) else (result, {})
            return loss, {"lm loss": loss.detach(),
                          **{k: v.detach() if hasattr(v, "detach") else v
                             for k, v in stats.items()}}

        return forward_step


def transformer_kwargs(cfg: RunConfig, dropout: bool = True) -> dict:
    """The settings every family's transformer config takes from the run configuration.

    Args:
        cfg: a :class:`~megatron.config.RunConfig` (or a saved configuration made with
            :func:`megatron.config.saved_run_config`).
        dropout: False for inference (dropout probabilities 0).
    """
    m, kernels = cfg.model, cfg.kernels
    return dict(
        num_layers=m.num_layers, hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads, kv_channels=m.kv_channels,
        ffn_hidden_size=m.ffn_hidden_size,
        hidden_dropout=m.hidden_dropout if dropout else 0.0,
        attention_dropout=m.attention_dropout if dropout else 0.0,
        layernorm_epsilon=m.layernorm_epsilon, checkpoint_activations=m.checkpoint_activations,
        checkpoint_num_layers=m.checkpoint_num_layers,
        recompute_granularity=m.recompute_granularity, recompute_method=m.recompute_method,
        recompute_num_layers=m.recompute_num_layers,
        masked_softmax_fusion=kernels.masked_softmax_fusion, compute_dtype=cfg.precision.dtype,
        seed=m.seed,
        # padded vocabulary rows get -inf logits; unknown (None) in some old checkpoints
        true_vocab_size=m.true_vocab_size,
        sequence_parallel=cfg.parallel.sequence_parallel and dropout,  # not in inference
        attention_backend=kernels.attention_backend or "auto",
        token_layout=uses_token_layout(cfg), cp_comm_type=cfg.parallel.cp_comm_type,
        fp8=cfg.precision.fp8 if dropout else None)  # inference: the compute dtype


def uses_token_layout(cfg: RunConfig) -> bool:
    """Whether a run's decoder passes the token layout (megatron/mpu/context_parallel.py)
    in its mask slot: under context parallelism and with document masking; otherwise the
    ``[1, 1, s, s]`` bool causal mask."""
    return cfg.parallel.cp > 1 or cfg.data.reset_attention_mask or cfg.data.reset_position_ids


def pipeline_placement(cfg: RunConfig) -> str:
    """The chunk placement of a run's pipeline module (``PipelineModule(placement=...)``):
    "v" for ``--pipeline-schedule zbv`` (two chunks per rank in a V), else "loop"."""
    return "v" if cfg.parallel.pipeline_schedule == V_SCHEDULE else "loop"


def pipeline_topology() -> Any:
    """DeepSpeed's pipeline topology of this process grid (same rank order as mpu). Its
    "data" axis is mpu's data x context group: the engine reduces gradients over it."""
    from tds.pipe import PipeModelDataParallelTopology

    from .. import mpu

    s = mpu.get_parallel_state()
    return PipeModelDataParallelTopology(num_pp=s.pp_size, num_mp=s.tp_size,
                                         num_dp=s.dp_size * s.cp_size)

"""What every model family is: :class:`ModelFamily`, and the settings all transformers share
(the package docstring, :mod:`megatron.families`, explains the interface)."""
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, Dict, FrozenSet, Optional, Tuple


def _no_problems(*_):
    return None


#: Generic features a model must implement for their flag to mean anything: feature -> the
#: flag that asks for it and whether it is on in a parsed namespace. A family lists the ones
#: it implements in ``ModelFamily.supports``; a run asking for another is refused at
#: start-up (:func:`unsupported_flags`), not silently ignored.
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
}


def unsupported_flags(ns, family) -> list:
    """One message per flag of ``ns`` that asks for a feature ``family`` does not implement.

    Args:
        ns: the parsed flags (a namespace).
        family: a :class:`ModelFamily`.
    """
    return [f"{flag} is not supported by the {family.name!r} model family (it implements "
            f"{', '.join(sorted(family.supports)) or 'none of the optional features'}); drop "
            f"the flag, or implement it and add {feature!r} to the family's supports"
            for feature, (flag, asked) in FEATURES.items()
            if asked(ns) and feature not in family.supports]


@dataclass(frozen=True)
class ModelFamily:
    """The per-model description (see the module docstring)."""

    name: str
    add_flags: Callable
    model_config: Callable
    build_model: Callable
    """``build_model(cfg, pipeline) -> nn.Module``."""
    build_datasets: Callable
    flops_per_step: Optional[Callable]
    """``flops_per_step(cfg) -> float``: model FLOPs of one step (the log's TFLOP/s and MFU);
    None: the log says "n/a"."""
    make_batch_fn: Callable
    """``make_batch_fn(cfg, tokenizer) -> f(raw batch or None) -> (inputs, labels)``: tensor-
    parallel rank 0 reads, the batch is shared with its group, masks are built on the device."""
    loss_fn: Callable
    """``loss_fn(outputs, labels) -> scalar loss`` of the model's (or last stage's) outputs."""
    keys: Optional[ModuleType] = None
    """The checkpoint key map (:mod:`megatron.checkpoint.gpt2_keys` / ``t5_keys``): a run
    of this family moves a checkpoint to another layout with it where the checkpoint's
    sharding record does not do (no record, or names that depend on the layout); its
    ``matches(args, names)`` must accept the checkpoint. None: the record alone (a model
    built from mpu layers whose names do not depend on the layout needs nothing more)."""
    hf: Optional[ModuleType] = None
    """The Hugging Face adapter (``read_hf`` / ``write_hf``, megatron.checkpoint_conversion)."""
    foreign_checkpoints: Tuple[ModuleType, ...] = ()
    """Other projects' checkpoint formats ``--load`` takes for this model (each with
    ``NAME``, ``DESCRIPTION``, ``detect(root)`` and ``read_full(root, iteration, hints)``:
    :mod:`megatron.checkpoint.megatron_lm` for GPT-2)."""
    flag_defaults: Dict[str, Any] = field(default_factory=dict)
    """Defaults the family sets for generic flags (a config file or a flag overrides them)."""
    label: str = ""
    """Name in the configuration error's heading ("invalid T5 configuration")."""
    layer_stacks: int = 1
    """Stacks of --num-layers layers (2 for an encoder-decoder), for the pipeline check."""
    derive: Callable = _no_problems
    """``derive(ns)``: fill the family's derived flags before the generic checks."""
    validate: Callable = _no_problems
    """``validate(ns, problems)``: append a message for each bad family setting."""
    validate_with_tokenizer: Callable = _no_problems
    """``validate_with_tokenizer(ns, tokenizer, problems)``: checks that need the vocabulary."""
    settings: Optional[type] = None
    """The family's own flags as a typed section (``cfg.<name>``, a config ``Section``)."""
    checked_settings: Tuple[str, ...] = ()
    """Flag names (``dest``) a resume must match besides the generic model settings
    (``rope_theta``): a checkpoint saved with another value is refused."""
    compile_classes: Optional[Tuple[type, ...]] = None
    """The layer classes ``--compile`` compiles (each instance its own region). None: the
    built-in blocks (GPT-2's and T5's layers, matched by name); ``()``: none at all (the
    log says "--compile compiled no layer")."""
    supports: FrozenSet[str] = frozenset()
    """Optional generic features the model implements (:data:`FEATURES`: ``sequence_parallel``,
    ``checkpoint_activations``, ``selective_recompute``, ``recompute_block``,
    ``virtual_pipeline``, ``pipeline``); others are refused."""
    memory_model: Any = None
    """The startup memory check's and tools/plan_layout.py's description of the model:
    ``"gpt2"`` / ``"decoder"`` / ``"encoder"`` (GPT-2's layers with the run's sizes),
    ``"t5"`` / ``"encoder-decoder"``, a ``megatron.memory.LayerDescription`` of the family's
    layers (or a function of the run configuration returning one), or None (no memory
    model: said so); megatron/memory/describe.py."""

    def unsupported_flags(self, ns) -> list:
        """Messages for the flags of ``ns`` asking for features this model lacks."""
        return unsupported_flags(ns, self)

    def config_from_saved(self, saved: dict):
        """The dropout-free fp32 model config of a checkpoint's saved ``args`` dict
        (settings it lacks take today's flag defaults)."""
        import torch

        from ..config import saved_run_config

        flags = saved_run_config(saved, self).replace(compute_dtype=torch.float32,
                                                      checkpoint_activations=False,
                                                      recompute_granularity=None,
                                                      recompute_method=None)
        return self.model_config(flags, dropout=False)

    def forward_step(self, batch_fn: Callable) -> Callable:
        """Megatron's ``forward_step(data_iterator, model) -> (loss, {"lm loss": ...})`` for
        the serial model, from the family's batch function and loss."""
        def forward_step(data_iterator, model):
            raw = next(data_iterator) if data_iterator is not None else None
            inputs, labels = batch_fn(raw)
            loss = self.loss_fn(model(*inputs), labels)
            return loss, {"lm loss": loss.detach()}

        return forward_step


def transformer_kwargs(cfg, dropout: bool = True) -> dict:
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
        attention_backend=kernels.attention_backend or "auto")


def pipeline_placement(cfg: Any) -> str:
    """The chunk placement of a run's pipeline module (``PipelineModule(placement=...)``):
    "v" for ``--pipeline-schedule zbv`` (two chunks per rank in a V), else "loop"."""
    return "v" if getattr(cfg.parallel, "pipeline_schedule", "1f1b") == "zbv" else "loop"


def pipeline_topology() -> Any:
    """DeepSpeed's pipeline topology of this process grid (same rank order as mpu)."""
    from tds.pipe import PipeModelDataParallelTopology

    from .. import mpu

    s = mpu.get_parallel_state()
    return PipeModelDataParallelTopology(num_pp=s.pp_size, num_mp=s.tp_size, num_dp=s.dp_size)

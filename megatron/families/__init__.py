"""Model families: what is specific to GPT-2 or T5, behind one small interface.

The generic parts (flag parsing and validation, the training loop, checkpoints, the
conversion and reshard tools) ask a :class:`ModelFamily` for everything that differs
between models, so a flag, a dataset or a FLOP count is defined once, here, per model:

- ``add_flags(parser)``, ``flag_defaults`` and ``derive(ns)`` / ``validate(ns, problems)`` /
  ``validate_with_tokenizer(ns, tokenizer, problems)``: the family's flags and their part of
  the one validation pass (:func:`megatron.config.build_run_config`);
- ``model_config(flags)``: the model's config dataclass from a run configuration or a
  checkpoint's saved settings (the only place a model config is built from flags);
- ``build_model(cfg, pipeline)``: the module, as a tds ``PipelineModule`` when ``pipeline``
  (decided by the training backend factory, nowhere else);
- ``build_datasets(cfg, tokenizer, num_samples)``, ``flops_per_step(cfg)``;
- ``keys()``: the conversion key map (HF names, tensor-parallel split dims, pipeline stages).
"""
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional


def _no_problems(*_):
    return None


@dataclass(frozen=True)
class ModelFamily:
    """The per-model hooks (see the module docstring)."""

    name: str
    add_flags: Callable
    model_config: Callable
    build_model: Callable
    build_datasets: Callable
    flops_per_step: Callable
    keys: Optional[Callable[[], Any]] = None
    """``keys()``: the conversion key map module (checkpoint_conversion.gpt2_keys / t5_keys)."""
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

    def config_from_saved(self, saved):
        """The dropout-free fp32 model config of a checkpoint's saved ``args`` dict
        (settings it lacks take today's flag defaults)."""
        import torch

        from ..config import saved_run_config

        flags = saved_run_config(saved, self).replace(compute_dtype=torch.float32,
                                                      checkpoint_activations=False)
        return self.model_config(flags, dropout=False)


def transformer_kwargs(flags, dropout=True):
    """The settings every family's transformer config takes from the flags.

    Args:
        flags: a :class:`~megatron.config.RunConfig` (or a saved configuration made with
            :func:`megatron.config.saved_run_config`).
        dropout: False for inference (dropout probabilities 0).
    """
    return dict(
        num_layers=flags.num_layers, hidden_size=flags.hidden_size,
        num_attention_heads=flags.num_attention_heads, kv_channels=flags.kv_channels,
        ffn_hidden_size=flags.ffn_hidden_size,
        hidden_dropout=flags.hidden_dropout if dropout else 0.0,
        attention_dropout=flags.attention_dropout if dropout else 0.0,
        layernorm_epsilon=flags.layernorm_epsilon,
        checkpoint_activations=flags.checkpoint_activations,
        checkpoint_num_layers=flags.checkpoint_num_layers,
        masked_softmax_fusion=flags.masked_softmax_fusion, compute_dtype=flags.compute_dtype,
        seed=flags.seed,
        # padded vocabulary rows get -inf logits; unknown (None) in some old checkpoints
        true_vocab_size=flags.get("true_vocab_size"),
        sequence_parallel=bool(flags.get("sequence_parallel")) and dropout,  # not in inference
        attention_backend=flags.get("attention_backend") or "auto")


def pipeline_topology():
    """DeepSpeed's pipeline topology of this process grid (same rank order as mpu)."""
    from tds.pipe import PipeModelDataParallelTopology

    from .. import mpu

    s = mpu.get_parallel_state()
    return PipeModelDataParallelTopology(num_pp=s.pp_size, num_mp=s.tp_size, num_dp=s.dp_size)


_REGISTRY: Dict[str, Callable[[], ModelFamily]] = {}


def register(name, factory):
    """Register ``factory() -> ModelFamily`` under ``name`` (imports stay lazy)."""
    _REGISTRY[name] = factory


def get_family(name) -> Optional[ModelFamily]:
    """The family called ``name`` (``gpt2``, ``t5``), a ModelFamily passed through, or None."""
    if name is None or isinstance(name, ModelFamily):
        return name
    if name not in _REGISTRY:
        raise KeyError(f"unknown model family {name!r}; known: {sorted(_REGISTRY)}")
    return _REGISTRY[name]()


def _gpt2():
    from .gpt2 import FAMILY

    return FAMILY


def _t5():
    from .t5 import FAMILY

    return FAMILY


register("gpt2", _gpt2)
register("t5", _t5)

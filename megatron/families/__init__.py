"""Model families: each model described once, behind one small interface.

The generic parts (flag parsing and validation, the training loop, checkpoints, the
conversion tools) ask a :class:`ModelFamily` for everything that differs between models, so
a model, its loss, its batch, a flag, a dataset or a FLOP count is defined once, here, per
model:

- ``build_model(cfg, pipeline)``: the model; with ``pipeline`` the same layers as pipeline
  stages (a tds ``PipelineModule``), decided by the training backend factory alone;
- ``make_batch_fn(cfg, tokenizer)``: ``raw batch -> (inputs, labels)``, for the serial
  forward step and for the pipeline engine alike; ``loss_fn(outputs, labels)``: the loss of
  the model's outputs (the serial model's, or the pipeline's last stage's);
- ``add_flags(parser)``, ``flag_defaults`` and ``derive(ns)`` / ``validate(ns, problems)`` /
  ``validate_with_tokenizer(ns, tokenizer, problems)``: the family's flags and their part of
  the one validation pass (:func:`megatron.config.build_run_config`);
- ``model_config(flags)``: the model's config dataclass from a run configuration or a
  checkpoint's saved settings (the only place a model config is built from flags);
- ``build_datasets(cfg, tokenizer, num_samples)``, ``flops_per_step(cfg)``;
- ``keys``: where each weight lives in a checkpoint (:mod:`megatron.checkpoint.gpt2_keys`);
  ``hf``: the Hugging Face adapter (:mod:`megatron.checkpoint_conversion.hf_gpt2`);
  ``foreign_checkpoints``: other projects' checkpoints ``--load`` reads
  (:mod:`megatron.checkpoint.megatron_lm`).
"""
from typing import Dict, Optional

from .base import ModelFamily, pipeline_topology, transformer_kwargs

__all__ = ["ModelFamily", "get_family", "pipeline_topology", "register", "transformer_kwargs"]

_FACTORIES: Dict[str, object] = {}


def register(name: str, factory) -> None:
    """Register ``factory() -> ModelFamily`` under ``name`` (imports stay lazy)."""
    _FACTORIES[name] = factory


def get_family(name) -> Optional[ModelFamily]:
    """The family called ``name`` (``gpt2``, ``t5``), a ModelFamily passed through, or None."""
    if name is None or isinstance(name, ModelFamily):
        return name
    if name not in _FACTORIES:
        raise KeyError(f"unknown model family {name!r}; known: {sorted(_FACTORIES)}")
    return _FACTORIES[name]()


def _gpt2():
    from .gpt2 import FAMILY

    return FAMILY


def _t5():
    from .t5 import FAMILY

    return FAMILY


register("gpt2", _gpt2)
register("t5", _t5)

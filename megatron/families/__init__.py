"""Model families: each model described once, behind one small interface.

The generic parts (flag parsing and validation, the training loop, checkpoints, the
conversion tools) ask a :class:`ModelFamily` for everything that differs between models, so
a model, its loss, its batch, a flag, a dataset or a FLOP count is defined once, here, per
model. Each hook's arguments, return value and meaning are documented once, on its field of
:class:`ModelFamily` (megatron/families/base.py); in short:

- ``build_model``: the model, serial or as pipeline stages from the same layers;
- ``make_batch_fn`` and ``loss_fn``: the batch and the loss, for the serial forward step and
  the pipeline engine alike;
- ``add_flags``, ``flag_defaults``, ``derive`` / ``validate`` / ``validate_with_tokenizer``:
  the family's flags and their part of the one validation pass
  (:func:`megatron.config.build_run_config`);
- ``model_config``: the model's config dataclass (the only place one is built from flags);
- ``build_datasets``, ``flops_per_step``;
- ``checked_settings`` (flags a resume must match), ``compile_classes`` (what ``--compile``
  compiles), ``supports`` (optional generic features: by default what the family provides;
  a declared set narrows it, and a flag asking for another is refused at start-up) and
  ``memory_model`` (the memory check's description, or None);
- ``keys``: where each weight lives in a checkpoint (:mod:`megatron.checkpoint.gpt2_keys`);
  ``hf``: the Hugging Face adapter (:mod:`megatron.checkpoint_conversion.hf_gpt2`);
  ``foreign_checkpoints``: other projects' checkpoints ``--load`` reads
  (:mod:`megatron.checkpoint.megatron_lm`).

A run carries its family object (``cfg.model_family``, set by ``build_run_config``): resuming
with ``--load`` uses that object, so a family defined in a user's script needs no registration.
The registry (:func:`register`, :func:`get_family`) is for what only has a name: ``pretrain(
family="llama")``, ``tools/plan_layout.py --family``, the conversion tools; register a family
of your own with ``register("llama", lambda: LLAMA)`` (docs/new_model.md).
"""
from typing import Callable, Dict, Optional, Union

from ..common.errors import ConfigError
from .base import (FEATURES, ModelFamily, pipeline_placement, pipeline_topology,
                   provided_problems, transformer_kwargs, unsupported_flags,
                   uses_token_layout)

__all__ = ["FEATURES", "ModelFamily", "get_family", "known_families", "load_family",
           "pipeline_placement",
           "pipeline_topology",
           "provided_problems", "register", "transformer_kwargs", "unsupported_flags",
           "uses_token_layout"]

_FACTORIES: Dict[str, Callable[[], ModelFamily]] = {}


class UnknownFamilyError(ConfigError, KeyError):
    """A family name nobody registered."""

    def __str__(self):  # KeyError would quote the message
        return self.args[0] if self.args else ""


def register(name: str, factory: Union[ModelFamily, Callable[[], ModelFamily]]) -> None:
    """Make a family known by ``name`` (for name lookups: ``pretrain(family=name)``, tools).

    Args:
        name: the family's name (its ``ModelFamily.name``).
        factory: the :class:`ModelFamily`, or ``factory() -> ModelFamily`` (imports stay
            lazy until the family is asked for).
    """
    _FACTORIES[name] = factory if callable(factory) and not isinstance(
        factory, ModelFamily) else (lambda: factory)


def known_families() -> list:
    """The registered names, sorted."""
    return sorted(_FACTORIES)


def get_family(name) -> Optional[ModelFamily]:
    """The family called ``name`` (``gpt2``, ``t5``), a ModelFamily passed through, or None.

    Raises:
        UnknownFamilyError: ``name`` was never registered (the message says how).
    """
    if name is None or isinstance(name, ModelFamily):
        return name
    if name not in _FACTORIES:
        raise UnknownFamilyError(
            f"unknown model family {name!r}; known: {known_families()}. Pass the "
            f"ModelFamily object itself (pretrain(family=MY_FAMILY)), or register it first: "
            f"megatron.families.register({name!r}, lambda: MY_FAMILY) (docs/new_model.md)")
    return _FACTORIES[name]()


def load_family(spec) -> Optional[ModelFamily]:
    """The family a command line names (a tool's ``--family``): a registered name,
    ``package.module:OBJECT`` or ``path/to/file.py:OBJECT`` (:func:`.locate.import_family`),
    or a ModelFamily passed through.

    Raises:
        ConfigError: an unknown name, nothing importable there, or not a ModelFamily.
    """
    if isinstance(spec, str) and ":" in spec:
        from .locate import import_family

        return import_family(spec)
    return get_family(spec)


def _gpt2():
    from .gpt2 import FAMILY

    return FAMILY


def _t5():
    from .t5 import FAMILY

    return FAMILY


register("gpt2", _gpt2)
register("t5", _t5)

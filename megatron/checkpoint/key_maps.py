"""The key maps of the model families, and which one a checkpoint uses.

A key map module (:mod:`.gpt2_keys`, :mod:`.t5_keys`) tells the generic reader, writer and
layout change where each weight of a model lives: its full-model key names, the dimension
each tensor is split on across tensor-parallel ranks, the pipeline-stage key names and
stage bounds, the vocabulary rows, what repeats across stages. A run's model family carries
its key map (``ModelFamily.keys``, ``cfg.model_family``): a run uses that one. Without a run
(the conversion tools, a Megatron-style provider run) the checkpoint names its own: by the
family its files record, else by its saved ``args`` and tensor names (``matches``). A model
built from the mpu layers needs none: its files record their sharding (:mod:`.sharding`).
"""
from types import ModuleType
from typing import Any, Iterable, Optional

from ..common.errors import CheckpointError
from . import gpt2_keys, t5_keys

#: The built-in key maps, asked in this order (``matches``) when nothing names the model.
KEY_MAPS = (t5_keys, gpt2_keys)


def _names_text(names: Optional[Iterable[str]]) -> str:
    shown = sorted(names or ())[:4]
    return ", ".join(shown) + (" ..." if len(list(names or ())) > 4 else "") if shown else "none"


def _of_family(family: Any, args: dict, names: Optional[Iterable[str]]) -> ModuleType:
    """The run's family's key map, checked against what the checkpoint holds."""
    keys = family.keys
    if keys is None:
        raise CheckpointError(
            f"the {family.name!r} model family has no key map (ModelFamily.keys) and the "
            f"checkpoint records no sharding (saved before the sharding record, or by "
            f"another program), so its tensors cannot be moved to another layout; resume at "
            f"its saved layout (tp={args.get('tensor_model_parallel_size')}, "
            f"pp={args.get('pipeline_model_parallel_size', 1)}), or give the family a key "
            f"map (docs/new_model.md)")
    matches = getattr(keys, "matches", None)
    if matches is not None and not matches(args, names):
        other = next((k for k in KEY_MAPS if k is not keys and k.matches(args, names)), None)
        held = f"a {other.NAME} checkpoint" if other is not None else \
            f"tensors that are not a {keys.NAME}'s ({_names_text(names)})"
        raise CheckpointError(f"the checkpoint holds {held}, but this run trains the "
                              f"{family.name!r} family; point --load at a {family.name!r} "
                              f"checkpoint")
    return keys


def key_map_for(args: dict, family: Any = None, names: Optional[Iterable[str]] = None,
                saved_family: Optional[str] = None) -> ModuleType:
    """The key map of a checkpoint.

    Args:
        args: the checkpoint's saved ``args``.
        family: the run's :class:`~megatron.families.ModelFamily` (``cfg.model_family``), or
            None: with one, its key map (``family.keys``), which must describe the checkpoint.
        names: the tensor names of the checkpoint's first rank file, when at hand: they
            must be the model's (a checkpoint of another model is not taken for GPT-2).
        saved_family: the family name the checkpoint's files record (``"family"``), or None
            (checkpoints written before it was recorded, provider runs).

    Raises:
        CheckpointError: no key map describes the checkpoint, saying what it holds.
    """
    if family is not None:
        return _of_family(family, args, names)
    if saved_family:
        return key_map_named(saved_family)
    for keys in KEY_MAPS:
        if keys.matches(args, names):
            return keys
    raise CheckpointError(
        f"the checkpoint is not a GPT-2 or T5 checkpoint (its first file's tensors: "
        f"{_names_text(names)}) and records no sharding, so no key map describes it: a "
        f"model of your own reads and reshards through the sharding record its files carry "
        f"when saved by this version (docs/new_model.md)" if names is not None else
        f"the checkpoint's saved args ({sorted(args)[:6]}...) describe no model this "
        f"version knows")


def key_map_named(family: str) -> ModuleType:
    """The key map of the family called ``family`` (``gpt2``, ``t5``)."""
    for keys in KEY_MAPS:
        if keys.FAMILY == family:
            return keys
    raise CheckpointError(f"no checkpoint key map for model family {family!r} (known: "
                          f"{sorted(k.FAMILY for k in KEY_MAPS)}); a model built from the mpu "
                          f"layers is read by the sharding record its files carry, and a "
                          f"run of its family takes the family's own key map "
                          f"(ModelFamily.keys; docs/new_model.md)")

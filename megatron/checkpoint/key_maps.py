"""The key maps of the model families, and which one a checkpoint's saved args describe.

A key map module (:mod:`.gpt2_keys`, :mod:`.t5_keys`) tells the generic reader, writer and
layout change where each weight of a model lives: its full-model key names, the dimension
each tensor is split on across tensor-parallel ranks, the pipeline-stage key names and
stage bounds, the vocabulary rows, what repeats across stages. Each also says whether a
saved ``args`` dict is its model (``matches``), so a checkpoint names its own key map.
"""
from types import ModuleType

from ..errors import CheckpointError
from . import gpt2_keys, t5_keys

#: Most specific first: GPT-2's matches any transformer args, so it comes last.
KEY_MAPS = (t5_keys, gpt2_keys)


def key_map_for(args: dict) -> ModuleType:
    """The key map of the model a checkpoint's saved ``args`` describe."""
    for keys in KEY_MAPS:
        if keys.matches(args):
            return keys
    raise CheckpointError(f"the checkpoint's saved args ({sorted(args)[:6]}...) describe no "
                          f"model this version knows")


def key_map_named(family: str) -> ModuleType:
    """The key map of the family called ``family`` (``gpt2``, ``t5``)."""
    for keys in KEY_MAPS:
        if keys.FAMILY == family:
            return keys
    raise CheckpointError(f"no checkpoint key map for model family {family!r}; known: "
                          f"{sorted(k.FAMILY for k in KEY_MAPS)}")

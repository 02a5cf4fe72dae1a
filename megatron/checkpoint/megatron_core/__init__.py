"""Megatron-Core GPT checkpoints: read legacy (``mp_rank_*`` files with Megatron-Core names)
and ``torch_dist`` (torch DCP) ones whole at any saved layout, write ``torch_dist``.

- :mod:`.names`: Megatron-Core's weight names (local and TransformerEngine specs, stacked or
  per-layer) <-> this project's GPT-2 keys;
- :mod:`.safe_load`: the pickled parts, read without running pickled code (nor needing
  megatron-core installed);
- :mod:`.dist_io`: a ``torch_dist`` folder through torch DCP;
- :mod:`.args`: the features refused, the args a written checkpoint saves;
- :mod:`.reader` / :mod:`.writer`: a whole checkpoint <-> a
  :class:`~megatron.checkpoint.FullCheckpoint`.

Conversion (``tools/convert_checkpoint.py --input-format megatron-core`` / ``--output-format
megatron-core``) and training (``--load`` of such a folder) use it through the GPT-2
family's list of foreign formats. See docs/conversion.md.
"""
from typing import Any, Dict, Optional

from .reader import LEGACY, TORCH_DIST, kind_of, read_megatron_core
from .writer import write_megatron_core

NAME = "megatron-core"
"""The format's name in ``--input-format`` / ``--output-format``."""
DESCRIPTION = "Megatron-Core checkpoint"


def detect(root: str) -> bool:
    """Whether ``root`` holds a Megatron-Core checkpoint (legacy or torch_dist)."""
    return kind_of(root) is not None


def describe(root: str) -> Optional[str]:
    """Which Megatron-Core format ``root`` holds, in words, or None."""
    return kind_of(root)


def read_full(root: str, iteration: Optional[int] = None,
              hints: Optional[Dict[str, Any]] = None) -> Any:
    """The whole model (see :func:`.reader.read_megatron_core`)."""
    return read_megatron_core(root, iteration, hints)


__all__ = ["DESCRIPTION", "LEGACY", "NAME", "TORCH_DIST", "describe", "detect", "kind_of",
           "read_full", "read_megatron_core", "write_megatron_core"]

"""Megatron-LM's own GPT checkpoints (versions 0 to 3): read them whole, write version 3.

- :mod:`.files`: folders, the tracker, ``release/``, which folder holds one;
- :mod:`.safe_load`: ``torch.load(weights_only=True)`` with ``argparse.Namespace`` and NumPy
  arrays allow-listed, nothing else;
- :mod:`.names`: Megatron-LM's weight names <-> this project's GPT-2 keys;
- :mod:`.qkv`: the fused QKV row order of each version;
- :mod:`.args`: Megatron-LM's saved args <-> this project's;
- :mod:`.reader` / :mod:`.writer`: a whole checkpoint <-> a
  :class:`~megatron.checkpoint.FullCheckpoint`.

Conversion (``tools/convert_checkpoint.py --input-format megatron`` / ``--output-format
megatron``) and training (``--load`` of such a folder) use it through the GPT-2 family's
list of foreign formats. See docs/conversion.md.
"""
from typing import Any, Dict, Optional

from .files import is_megatron_lm_checkpoint
from .reader import read_megatron_lm
from .writer import write_megatron_lm

NAME = "megatron"
"""The format's name in ``--input-format`` / ``--output-format``."""
DESCRIPTION = "Megatron-LM checkpoint"


def detect(root: str) -> bool:
    """Whether ``root`` holds a Megatron-LM checkpoint."""
    return is_megatron_lm_checkpoint(root)


def read_full(root: str, iteration: Optional[int] = None,
              hints: Optional[Dict[str, Any]] = None) -> Any:
    """The whole model (see :func:`.reader.read_megatron_lm`)."""
    return read_megatron_lm(root, iteration, hints)


__all__ = ["DESCRIPTION", "NAME", "detect", "is_megatron_lm_checkpoint", "read_full",
           "read_megatron_lm", "write_megatron_lm"]

"""Read one Megatron-LM ``model_optim_rng.pt`` without executing pickled code.

Megatron-LM saves its whole ``argparse.Namespace`` under ``args`` and, unless it ran with
``--no-save-rng``, NumPy's random state (a tuple holding a ``uint32`` array) under
``np_rng_state``. ``torch.load(weights_only=True)`` refuses both, and loading with
``weights_only=False`` would let the file run any code it names. This loader keeps
``weights_only=True`` and allows, for the duration of the call only
(``torch.serialization.safe_globals``), exactly these data types:

- ``argparse.Namespace`` (rebuilt from its attribute dict: no code runs);
- NumPy's array reconstruction (``numpy.core.multiarray._reconstruct`` under both of its
  module names, ``numpy.ndarray``, ``numpy.dtype`` and the ``uint32`` dtype class), which
  only rebuild arrays from their bytes.

Anything else a file pickles (an optimizer's loss-scaler object from Megatron-LM v1.0, an
enum of a newer Megatron-core) is refused with a :class:`~megatron.common.errors.CheckpointError`
naming it; nothing is ever unpickled without the allow-list.
"""
import argparse
from typing import Any, Dict, List

import numpy as np
import torch

from ...common.errors import CheckpointError


def _numpy_reconstruct():
    core = getattr(np, "_core", None) or np.core
    return core.multiarray._reconstruct


def allowed_globals() -> List[Any]:
    """The allow-list: ``(object, pickled name)`` pairs ``safe_globals`` accepts."""
    reconstruct = _numpy_reconstruct()
    return [argparse.Namespace, np.ndarray, np.dtype, type(np.dtype(np.uint32)),
            (reconstruct, "numpy.core.multiarray._reconstruct"),
            (reconstruct, "numpy._core.multiarray._reconstruct")]


def load_megatron_file(path: str, mmap: bool = False) -> Dict[str, Any]:
    """The dict a Megatron-LM rank file holds (tensors on the CPU).

    Args:
        path: a ``model_optim_rng.pt``.
        mmap: map the tensors instead of reading them (a quick look at a big file; files
            in PyTorch's old, non-zip format are then read whole).

    Raises:
        CheckpointError: the file is missing or unreadable, or pickles a type outside the
            allow-list (the message names it).
    """
    try:
        with torch.serialization.safe_globals(allowed_globals()):
            try:
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
            except RuntimeError:
                if not mmap:
                    raise
                state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing: the checkpoint is "
                              f"incomplete") from None
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"cannot read Megatron-LM checkpoint file {path}: {first}. megatron-tds reads "
            f"checkpoints with torch.load(weights_only=True) and allows only argparse.Namespace "
            f"and NumPy arrays besides tensors, so a file that pickles other objects (e.g. an "
            f"old fp16 optimizer's loss scaler) is not loaded; re-save it from Megatron-LM "
            f"without optimizer state (--no-save-optim), or load and re-save its 'model' "
            f"entry yourself") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds a {type(state).__name__}, not a Megatron-LM "
                              f"checkpoint dict")
    return state

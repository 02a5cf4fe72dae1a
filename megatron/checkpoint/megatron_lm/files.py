"""Where a Megatron-LM checkpoint's files are, and whether a folder holds one.

Megatron-LM (v1.0 to v2.6 and the legacy models of later releases) saves::

    <root>/latest_checkpointed_iteration.txt     an iteration number, or "release"
    <root>/iter_0001000/mp_rank_{tp:02d}/model_optim_rng.pt           (no pipeline)
    <root>/iter_0001000/mp_rank_{tp:02d}_{pp:03d}/model_optim_rng.pt  (pipeline stages)
    <root>/release/mp_rank_00/model_optim_rng.pt  (a released model, e.g. GPT-2 345M)

Each file is a dict with ``iteration``, ``model`` (or ``model0``, ``model1``, ... under
virtual pipelining), optionally ``args`` (an ``argparse.Namespace``) and
``checkpoint_version`` (absent: version 0). The folder names are the same as this project's
own (:mod:`megatron.checkpoint.format`), so a folder is told apart by what its first file
holds: Megatron-LM's has no saved args *dict*, and its model nests ``language_model``.
"""
import os
import re
from typing import Any, Dict, List, Optional, Tuple

from ...common.errors import CheckpointError
from ..format import (MODEL_FILENAME, TRACKER_FILENAME, check_rank_layout, iteration_dir,
                      rank_files)
from .safe_load import load_megatron_file

RELEASE = "release"
_CHUNK_KEY = re.compile(r"^model(\d+)$")


def read_megatron_tracker(root: str) -> Optional[Tuple[int, bool]]:
    """``(iteration, release)`` from ``root``'s tracker, or None when there is none."""
    path = os.path.join(root, TRACKER_FILENAME)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8", errors="replace") as handle:
        text = handle.read().strip()
    if text == RELEASE:
        return 0, True
    try:
        return int(text), False
    except ValueError:
        raise CheckpointError(f"{path} should hold an iteration number or 'release', found "
                              f"{text!r}") from None


def checkpoint_folder(root: str, iteration: Optional[int] = None) -> Tuple[str, int, bool]:
    """``(folder with the mp_rank_* folders, iteration, release)``.

    Args:
        root: the ``--save`` folder of a Megatron-LM run (with the tracker), a folder with
            only ``release/``, or an ``iter_*`` / ``release`` folder itself.
        iteration: the iteration to read (default: the tracker's; then ``release``).

    Raises:
        CheckpointError: no checkpoint there.
    """
    if not os.path.isdir(root):
        raise CheckpointError(f"checkpoint directory {root} does not exist")
    if iteration is not None:
        folder = iteration_dir(root, iteration)
        if not os.path.isdir(folder):
            raise CheckpointError(f"checkpoint folder {folder} is missing")
        return folder, iteration, False
    if rank_files(root):  # the iteration folder itself
        name = os.path.basename(os.path.normpath(root))
        match = re.match(r"^iter_(\d+)$", name)
        return root, int(match.group(1)) if match else 0, name == RELEASE
    tracked = read_megatron_tracker(root)
    if tracked is None:
        if os.path.isdir(os.path.join(root, RELEASE)):
            return os.path.join(root, RELEASE), 0, True
        raise CheckpointError(f"{root} holds no Megatron-LM checkpoint ({TRACKER_FILENAME} "
                              f"and release/ are missing)")
    iteration, release = tracked
    folder = os.path.join(root, RELEASE) if release else iteration_dir(root, iteration)
    if not os.path.isdir(folder):
        raise CheckpointError(f"{os.path.join(root, TRACKER_FILENAME)} points at {folder}, "
                              f"which is missing")
    return folder, iteration, release


def layout_files(folder: str) -> Tuple[Dict[Tuple[int, int], str], int, int]:
    """``({(tp_rank, pp_rank): path}, tp, pp)`` of an iteration folder, checked complete."""
    files = rank_files(folder)
    if not files:
        raise CheckpointError(f"{folder} has no mp_rank_* folders")
    tp = max(t for t, _ in files) + 1
    pp = max(p for _, p in files) + 1
    check_rank_layout(files, tp, pp, folder)
    return files, tp, pp


def model_chunks(state: Dict[str, Any], path: str) -> List[Any]:
    """The model state dicts of one rank file, in virtual-pipeline chunk order."""
    if "model" in state:
        return [state["model"]]
    chunks = sorted((int(m.group(1)), value) for key, value in state.items()
                    if (m := _CHUNK_KEY.match(key)))
    if not chunks or [i for i, _ in chunks] != list(range(len(chunks))):
        raise CheckpointError(f"{path} has no 'model' (or model0, model1, ...) entry: not a "
                              f"Megatron-LM checkpoint")
    return [value for _, value in chunks]


def _holds_megatron_model(state):
    if isinstance(state.get("args"), dict):
        return False  # this project's own files save their args as a dict
    try:
        chunk = model_chunks(state, "")[0]
    except CheckpointError:
        return False
    return isinstance(chunk, dict) and (
        "language_model" in chunk or any(str(k).startswith("language_model.") for k in chunk))


def is_megatron_lm_checkpoint(root: str) -> bool:
    """Whether ``root`` holds a Megatron-LM checkpoint (reads the first rank file)."""
    try:
        folder, _, _ = checkpoint_folder(root)
    except CheckpointError:
        return False
    files = rank_files(folder)
    first = files.get((0, 0))
    if first is None or not os.path.isfile(first):
        return False
    try:
        return _holds_megatron_model(load_megatron_file(first, mmap=True))
    except CheckpointError:
        return False


def rank_file_name(folder: str, tp_rank: int, pp_rank: int, pp: int) -> str:
    """Megatron-LM's name of one rank's file: ``mp_rank_XX`` without pipeline stages."""
    sub = f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    return os.path.join(folder, sub, MODEL_FILENAME)

"""The on-disk format of a checkpoint: folder and file names, the tracker, what must match.

Layout (Megatron-LM's)::

    <root>/iter_0000100/mp_rank_{tp:02d}_{pp:03d}/model_optim_rng.pt
    <root>/iter_0000100/mp_rank_{tp:02d}_{pp:03d}/optim_dp_rank_{dp:03d}.pt   (sharded optimizers)
    <root>/latest_checkpointed_iteration.txt

With expert parallelism (ep > 1) the ranks of one (tp, pp) hold different experts: each ep
rank has its own folder, Megatron-LM's ``mp_rank_{tp:02d}_{pp:03d}_{ep:03d}``, with its model
file and the optimizer files of the data-parallel ranks in that ep rank (``dp``: the rank in
the data x context group, so the numbers of one (tp, pp) are spread over its ep folders).
At ep 1 the names stay the ones above.

Megatron-LM without pipeline stages names the rank folder ``mp_rank_{tp:02d}``; both are
read. A writer builds the iteration folder under a temporary root, each file flushed to disk
(``fsync``) as it is written; :func:`publish_iteration` flushes the folder's entries, renames
it into place and flushes its parent, then rewrites the tracker the same way (temporary file,
flush, rename, flush of the folder), so neither a killed process nor a crashed node leaves a
tracker naming a half checkpoint (:mod:`megatron.resilience.durable`). Every file is written through
:func:`write_checkpoint_file`, which hashes its bytes as they are written; the folder's
manifest of those digests (:mod:`.manifest`) is published with it, before the tracker, and
every reader verifies a file against it before loading it. Every reader here loads with
``torch.load(weights_only=True)``: a checkpoint cannot execute code.
"""
import os
import re
import shutil
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ..resilience import durable
from ..config.run_config import RunConfig
from ..config.run_config import uses_pipeline_engine  # noqa: F401 (part of the format)
from ..common.errors import CheckpointError, not_text
from ..resilience.locks import remove_stale_tmps, tmp_name
from .digest import FileDigest, save_with_digest
from .manifest import check_file, write_manifest

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
CHECKPOINT_FORMAT = "megatron-tds/1"
MODEL_FILENAME = "model_optim_rng.pt"

#: Settings that must agree between a checkpoint and the flags that load it.
MODEL_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "kv_channels",
              "ffn_hidden_size", "padded_vocab_size", "max_position_embeddings", "hidden_bias",
              "tensor_model_parallel_size", "pipeline_model_parallel_size",
              # T5 (absent from GPT-2 checkpoints, so never compared for them)
              "t5_ff", "untie_embeddings", "relative_attention_num_buckets")

#: The settings of MODEL_KEYS that a resume at another layout may change
#: (:mod:`megatron.checkpoint.layout_change`).
LAYOUT_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "padded_vocab_size")

_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")
_EP_RANK_DIR = re.compile(r"^mp_rank_(\d{2})_(\d{3})_(\d{3})$")
#: The saved setting that names the expert-parallel size (1 when absent).
EP_KEY = "expert_model_parallel_size"
_ITER_DIR = re.compile(r"^iter_(\d{7})$")

#: A damaged iteration folder moved aside by a resume keeps its name with this suffix.
DAMAGED_SUFFIX = ".damaged"


# ---------------------------------------------------------------- names
def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def rank_dir_name(tp_rank: int, pp_rank: int, ep_rank: Optional[int] = None) -> str:
    """The rank folder's name: ``mp_rank_{tp:02d}_{pp:03d}``, with ``_{ep:03d}`` for a run
    at expert-parallel size > 1 (``ep_rank`` None: ep 1)."""
    tail = "" if ep_rank is None else f"_{ep_rank:03d}"
    return f"mp_rank_{tp_rank:02d}_{pp_rank:03d}{tail}"


def checkpoint_name(root: str, iteration: int, tp_rank: int, pp_rank: int,
                    ep_rank: Optional[int] = None) -> str:
    """Path of one rank's file inside ``root/iter_*`` (or a temporary iteration folder).

    Args:
        root, iteration: the checkpoint and its iteration.
        tp_rank, pp_rank: the rank folder.
        ep_rank: the expert-parallel rank of a run at ep > 1; None at ep 1.
    """
    return os.path.join(iteration_dir(root, iteration),
                        rank_dir_name(tp_rank, pp_rank, ep_rank), MODEL_FILENAME)


def megatron_v2_name(root: str, iteration: int, tp_rank: int) -> str:
    """Megatron-LM's name when there is no pipeline: ``mp_rank_{tp:02d}``."""
    return os.path.join(iteration_dir(root, iteration), f"mp_rank_{tp_rank:02d}", MODEL_FILENAME)


def optimizer_shard_name(root: str, iteration: int, tp_rank: int, pp_rank: int,
                         dp_rank: int, ep_rank: Optional[int] = None) -> str:
    """Per-data-parallel-rank optimizer file (the distributed optimizer, DeepSpeed engines),
    in its ep rank's folder at ep > 1 (``ep_rank`` None: ep 1)."""
    return os.path.join(os.path.dirname(checkpoint_name(root, iteration, tp_rank, pp_rank,
                                                        ep_rank)),
                        f"optim_dp_rank_{dp_rank:03d}.pt")


# ---------------------------------------------------------------- tracker
def read_tracker(root: str) -> Optional[int]:
    """The iteration in ``root``'s tracker file, or None when there is none."""
    path = os.path.join(root, TRACKER_FILENAME)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read().strip()
    except UnicodeDecodeError as exc:
        raise not_text(path, exc, "the tracker file should hold an iteration number; write "
                       "the newest complete iteration (an iter_* folder's number) into it",
                       CheckpointError) from None
    if text == "release":
        return 0
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"{path} should hold an iteration number, found {text!r}") from None


def write_atomic(path: str, write: Callable[[str], None]) -> None:
    """``write(tmp)``, flush it, rename it to ``path`` and flush the folder: neither a killed
    writer nor a crashed node leaves a half file under ``path``."""
    remove_stale_tmps(path)  # a killed writer's leftovers
    tmp = tmp_name(path)
    durable.write_file(tmp, write)
    durable.replace(tmp, path)


def write_checkpoint_file(path: str, state) -> FileDigest:
    """``torch.save(state)`` to ``path`` atomically and durably (:func:`write_atomic`),
    hashing the bytes as they are written: the one write path of every checkpoint file.

    Args:
        path: the file, inside a temporary iteration folder.
        state: what to save.

    Returns:
        Its :class:`~.digest.FileDigest`, for the folder's manifest.
    """
    written = []
    write_atomic(path, lambda tmp: written.append(save_with_digest(state, tmp)))
    return written[-1]


def write_tracker(root: str, iteration: int) -> None:
    """Point ``root``'s tracker file at ``iteration`` (atomically; one rank calls it)."""
    def write(tmp):
        with open(tmp, "w") as handle:
            handle.write(str(iteration))

    write_atomic(os.path.join(root, TRACKER_FILENAME), write)


def publish_iteration(root: str, tmp_root: str, iteration: int, *,
                      digests: Dict[str, FileDigest]) -> None:
    """Write the manifest of the finished ``tmp_root`` iteration folder, move the folder into
    ``root``, then point the tracker at it. Re-saving an iteration replaces the old folder
    whole.

    Args:
        root: the ``--save`` folder.
        tmp_root: where the iteration folder was written.
        iteration: its iteration.
        digests: ``{name inside the iteration folder: FileDigest}`` of every file in it
            (from :func:`write_checkpoint_file`, gathered from every writer).

    Raises:
        CheckpointError: a file of the folder has no digest (:func:`.manifest.write_manifest`).
    """
    final = iteration_dir(root, iteration)
    write_manifest(iteration_dir(tmp_root, iteration), iteration, digests)
    durable.fsync_tree(iteration_dir(tmp_root, iteration))  # the files' names (data: writers)
    if os.path.exists(final):
        old = iteration_dir(os.path.join(root, ".old"), iteration)
        shutil.rmtree(old, ignore_errors=True)
        os.makedirs(os.path.dirname(old), exist_ok=True)
        os.replace(final, old)
        shutil.rmtree(old, ignore_errors=True)
    durable.replace(iteration_dir(tmp_root, iteration), final)
    write_tracker(root, iteration)


# ---------------------------------------------------------------- reading
def resolve_iteration(root: str, iteration: Optional[int] = None) -> int:
    """The iteration to read: ``iteration`` if given, else the tracker's."""
    if not os.path.isdir(root):
        raise CheckpointError(f"checkpoint directory {root} does not exist")
    if iteration is None:
        iteration = read_tracker(root)
        if iteration is None:
            raise CheckpointError(f"{root} holds no checkpoint ({TRACKER_FILENAME} is missing); "
                                  f"point at a --save directory or pass --iteration")
    if not os.path.isdir(iteration_dir(root, iteration)):
        raise CheckpointError(f"checkpoint folder {iteration_dir(root, iteration)} is missing")
    return iteration


def rank_files(folder: str) -> Dict[Tuple[int, int], str]:
    """``{(tp_rank, pp_rank): path}`` for every rank folder in ``folder`` (an ep > 1
    checkpoint's folders are :func:`ep_rank_files`')."""
    files = {}
    for name in sorted(os.listdir(folder)):
        match = _RANK_DIR.match(name)
        if match:
            key = (int(match.group(1)), int(match.group(2) or 0))
            files[key] = os.path.join(folder, name, MODEL_FILENAME)
    return files


def ep_rank_files(folder: str) -> Dict[Tuple[int, int, int], str]:
    """``{(tp_rank, pp_rank, ep_rank): path}`` for every rank folder in ``folder``: the
    ``mp_rank_*_*_*`` folders of an ep > 1 checkpoint, and those of an ep 1 one as ep 0."""
    files = {}
    for name in sorted(os.listdir(folder)):
        match = _EP_RANK_DIR.match(name)
        if match:
            files[tuple(int(g) for g in match.groups())] = \
                os.path.join(folder, name, MODEL_FILENAME)
    for (tp, pp), path in rank_files(folder).items():
        files.setdefault((tp, pp, 0), path)
    return files


def saved_ep(state: dict) -> int:
    """The expert-parallel size a rank file's args record (1 when absent)."""
    return int((state.get("args") or {}).get(EP_KEY) or 1)


def published_iterations(root: str) -> List[int]:
    """The iterations of ``root``'s published ``iter_*`` folders, oldest first."""
    if not os.path.isdir(root):
        return []
    return sorted(int(m.group(1)) for m in map(_ITER_DIR.match, os.listdir(root)) if m)


def set_aside(root: str, iteration: int) -> str:
    """Rename a damaged iteration folder to ``iter_N.damaged`` (``.damaged-2``, ... when that
    name is taken): out of every reader's way, kept for whoever wants to look at it.

    Returns:
        Its new path.
    """
    folder = iteration_dir(root, iteration)
    aside, count = folder + DAMAGED_SUFFIX, 1
    while os.path.exists(aside):
        count += 1
        aside = f"{folder}{DAMAGED_SUFFIX}-{count}"
    durable.replace(folder, aside)
    return aside


def load_rank_file(path: str) -> dict:
    """One rank file, verified against its manifest (:func:`.manifest.check_file`), read
    without executing pickled code."""
    check_file(path)
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file {path} is missing: the checkpoint is incomplete")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"cannot read checkpoint file {path}: "
                              f"{str(exc).splitlines()[0]}") from None


def check_rank_layout(files: Dict[tuple, str], tp: int, pp: int, folder: str,
                      ep: Optional[int] = None) -> None:
    """Raise unless ``files`` are exactly the rank folders of a ``tp`` x ``pp`` layout
    (keys ``(tp, pp)``), or of ``tp`` x ``pp`` x ``ep`` (keys ``(tp, pp, ep)``: ep 1's
    folders are ep 0)."""
    if ep is None:
        expected = {(t, p) for t in range(tp) for p in range(pp)}
    else:
        expected = {(t, p, e) for t in range(tp) for p in range(pp) for e in range(ep)}
    missing, extra = sorted(expected - set(files)), sorted(set(files) - expected)
    layout = f"tp={tp} x pp={pp}" + ("" if ep is None else f" x ep={ep}")
    if missing:
        names = ", ".join(rank_dir_name(k[0], k[1], k[2] if ep and ep > 1 else None)
                          for k in missing)
        raise CheckpointError(f"checkpoint {folder} is incomplete: {layout} needs "
                              f"{names}, which are missing")
    if extra:
        raise CheckpointError(f"checkpoint {folder} has rank folders {extra} beyond its saved "
                              f"layout {layout}: files from different runs are mixed")


def saved_optimizer_files(root: str, iteration: int, tp_rank: int, pp_rank: int) -> List[str]:
    """Every data-parallel rank's optimizer file of one (tp, pp), in rank order (their number
    is the saved data-parallel size).

    Raises:
        CheckpointError: there are none, or one is missing.
    """
    folder = os.path.dirname(checkpoint_name(root, iteration, tp_rank, pp_rank))
    names = os.listdir(folder) if os.path.isdir(folder) else []
    count = sum(1 for name in names if name.startswith("optim_dp_rank_"))
    hint = "pass --no-load-optim (or --finetune) to load the weights only"
    if count == 0:
        raise CheckpointError(f"checkpoint in {root} has no optimizer files in {folder} (saved "
                              f"without optimizer state, or by the DDP backend); {hint}")
    paths = [optimizer_shard_name(root, iteration, tp_rank, pp_rank, r) for r in range(count)]
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise CheckpointError(f"optimizer file {missing[0]} is missing: the checkpoint is "
                              f"incomplete; {hint}")
    return paths


def saved_ep_optimizer_files(root: str, iteration: int, tp_rank: int, pp_rank: int,
                             ep: int) -> Dict[int, List[str]]:
    """Every data-parallel rank's optimizer file of one (tp, pp) of an ep > 1 checkpoint,
    by ep rank: ``{ep_rank: [paths in data-parallel rank order]}`` (each ep folder holds the
    files of the data-parallel ranks in that ep rank; together they are ranks 0 .. dp-1).

    Raises:
        CheckpointError: there are none, or one is missing.
    """
    hint = "pass --no-load-optim (or --finetune) to load the weights only"
    by_ep, ranks = {}, {}
    for ep_rank in range(ep):
        folder = os.path.dirname(checkpoint_name(root, iteration, tp_rank, pp_rank, ep_rank))
        names = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
        found = [int(n[len("optim_dp_rank_"):-3]) for n in names
                 if re.fullmatch(r"optim_dp_rank_\d{3}\.pt", n)]
        by_ep[ep_rank] = [os.path.join(folder, f"optim_dp_rank_{r:03d}.pt") for r in found]
        ranks.update({r: ep_rank for r in found})
    if not ranks:
        raise CheckpointError(f"checkpoint in {root} has no optimizer files for tp {tp_rank}, "
                              f"pp {pp_rank} (saved without optimizer state, or by the "
                              f"replicated optimizer); {hint}")
    missing = [r for r in range(max(ranks) + 1) if r not in ranks]
    if missing or any(not paths for paths in by_ep.values()):
        where = missing[0] if missing else "of an ep rank"
        raise CheckpointError(f"the optimizer file of data-parallel rank {where} (tp "
                              f"{tp_rank}, pp {pp_rank}) is missing from {root}: the "
                              f"checkpoint is incomplete; {hint}")
    return by_ep


def check_compatible(saved: dict, cfg: RunConfig, path: str, ignore=()) -> None:
    """Raise unless the checkpoint's saved model settings match the run's.

    Args:
        saved: the checkpoint's args dict.
        cfg: the run configuration.
        path: the checkpoint, for the message.
        ignore: settings allowed to differ (:data:`LAYOUT_KEYS` for a resume at another
            layout).
    """
    # and the settings the run's model family declares (ModelFamily.checked_settings)
    family = cfg.model_family
    keys = tuple(MODEL_KEYS) + tuple(family.checked_settings if family is not None else ())
    diffs = [f"{k}: checkpoint {saved.get(k)!r}, flags {cfg.get(k)!r}"
             for k in keys if k in saved and k not in ignore and saved.get(k) != cfg.get(k)]
    if not diffs:
        return
    raise CheckpointError(f"checkpoint {path} was made for a different model:\n    "
                          + "\n    ".join(diffs) + "\n  fix the flags to match it")

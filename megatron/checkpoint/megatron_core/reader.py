"""Read a whole Megatron-Core GPT checkpoint, legacy or ``torch_dist``, at any saved layout.

- **legacy** (``--ckpt-format torch``): ``<root>/iter_N/mp_rank_{tp:02d}[_{pp:03d}]/
  model_optim_rng.pt``, folders and tracker as Megatron-LM's own (:mod:`..megatron_lm.files`);
  each file's ``model`` (``model0``, ``model1``, ... under virtual pipelining) is the flat
  ``GPTModel.state_dict()`` with Megatron-Core names and stage-local layer numbers. The tp
  shards are concatenated (:func:`..native_reader.merge_tensor_parallel`, which checks the
  replicated tensors agree) and a last stage's ``output_layer.weight`` (the tied copy) is
  checked against the first stage's word embeddings.
- **torch_dist**: the iteration folder holds ``metadata.json`` and DCP's files
  (:mod:`.dist_io`): every tensor is read whole, whatever layout wrote it; stacked layers are
  unstacked (:mod:`.names`).

Model sizes come from the tensors and the saved args (:mod:`.args`); the iteration and the
consumed samples carry over. Nothing is executed: :mod:`.safe_load`.
"""
import os
import re
from typing import Any, Dict, List, Optional, Tuple

from ...common.errors import CheckpointError
from ...observability.progress import progress
from .. import gpt2_keys
from ..megatron_lm.args import model_args
from ..megatron_lm.files import checkpoint_folder, layout_files, model_chunks
from ..megatron_lm.names import flatten
from ..native_reader import FullCheckpoint, check_complete, merge_tensor_parallel, replicas_agree
from . import dist_io, names
from .args import check_core_supported
from .safe_load import load_core, namespace_dict

LEGACY = "Megatron-Core legacy checkpoint (mp_rank_* files, Megatron-Core names)"
TORCH_DIST = "Megatron-Core torch_dist checkpoint (torch.distributed.checkpoint)"
_ITER = re.compile(r"^iter_(\d+)$")


def find_folder(root: str, iteration: Optional[int] = None) -> Tuple[str, int, bool]:
    """``(iteration folder, iteration, release)`` of a Megatron-Core checkpoint: ``root``
    may be a ``--save`` folder (with the tracker), or the ``iter_*`` / ``release`` folder."""
    if iteration is None and dist_io.dist_config(root) is not None:
        name = os.path.basename(os.path.normpath(root))
        match = _ITER.match(name)
        return root, int(match.group(1)) if match else 0, name == "release"
    return checkpoint_folder(root, iteration)


def _first_model(folder: str) -> Optional[Dict[str, Any]]:
    """The flat model dict of a legacy folder's first file, or None."""
    try:
        files, _, _ = layout_files(folder)
        chunk = model_chunks(load_core(files[(0, 0)], mmap=True), files[(0, 0)])[0]
    except CheckpointError:
        return None
    return chunk if isinstance(chunk, dict) else None


def kind_of(root: str, iteration: Optional[int] = None) -> Optional[str]:
    """:data:`TORCH_DIST`, :data:`LEGACY`, or None when ``root`` holds neither."""
    try:
        folder, _, _ = find_folder(root, iteration)
    except CheckpointError:
        return None
    if dist_io.dist_config(folder) is not None:
        return TORCH_DIST
    model = _first_model(folder)
    # "decoder." is Megatron-Core's alone (this project's and Megatron-LM's GPT files name
    # "embedding." too, and every file holds a layer or the final norm under "decoder.")
    if model and any(str(k).startswith("decoder.") for k in model):
        return LEGACY
    return None


def _stage_offsets(chunks: Dict[Tuple[int, int], List[dict]], pp: int):
    """``[(chunk, stage, first layer)]`` in global layer order (tp rank 0's counts)."""
    order, offset = [], 0
    for chunk in range(len(chunks[(0, 0)])):
        for stage in range(pp):
            order.append((chunk, stage, offset))
            offset += names.layer_count(chunks[(0, stage)][chunk])
    return order


def _legacy_part(flat, offset, where):
    """One rank chunk's tensors under full keys, its tied head copy under the word
    embeddings' key (a stage holds one or the other)."""
    head: List[Any] = []
    part = names.to_full_keys(flat, offset, head_copy=head)
    if head:
        if gpt2_keys.WORD_EMBEDDINGS in part:
            raise CheckpointError(f"{where} holds both the word embeddings and "
                                  f"{names.OUTPUT_LAYER}: an untied output layer, which "
                                  f"GPT2Model (tied, as GPT-2) cannot load")
        part[gpt2_keys.WORD_EMBEDDINGS] = head[0]
    return part


def _read_legacy(folder: str) -> Tuple[Dict[str, Any], dict, int, int, dict]:
    """``(full tensors, first file's state, tp, pp, saved args)`` of a legacy folder."""
    files, tp, pp = layout_files(folder)
    states = {key: load_core(path) for key, path in
              progress(sorted(files.items()), desc="reading Megatron-Core files", unit="files")}
    chunks = {key: [flatten(c) for c in model_chunks(state, files[key])]
              for key, state in states.items()}
    if len({len(v) for v in chunks.values()}) != 1:
        raise CheckpointError(f"{folder}: the rank files hold different numbers of model "
                              f"chunks: files from different runs are mixed")
    full: Dict[str, Any] = {}
    for chunk, stage, offset in _stage_offsets(chunks, pp):
        where = f"{folder} stage {stage} chunk {chunk}"
        shards = [_legacy_part(chunks[(t, stage)][chunk], offset, files[(t, stage)])
                  for t in range(tp)]
        for key, tensor in merge_tensor_parallel(shards, where).items():
            if key not in full:
                full[key] = tensor
            elif key == gpt2_keys.WORD_EMBEDDINGS:
                replicas_agree(full[key], tensor, f"{folder}: the output layer's copy of the "
                                                  f"word embeddings (stage {stage})")
            else:
                raise CheckpointError(f"{folder}: {key} appears on two pipeline stages")
    first = states[(0, 0)]
    return full, first, tp, pp, namespace_dict(first.get("args"))


def _read_dist(folder: str) -> Tuple[Dict[str, Any], dict, int, int, dict]:
    """``(full tensors, common state, tp, pp, saved args)`` of a torch_dist folder."""
    dist_io.check_torch_dist(folder)
    common = dist_io.read_common(folder)
    saved = namespace_dict(common.get("args"))
    check_core_supported(saved)
    stored = dist_io.tensor_keys(folder)
    keys = [k for k in stored if names.is_weight_name(k)]
    if not keys:
        raise CheckpointError(f"torch_dist checkpoint {folder} holds no Megatron-Core GPT "
                              f"model tensors (its tensors: {stored[:4]})")
    full = names.to_full_keys(dist_io.read_tensors(folder, keys))
    tp = int(saved.get("tensor_model_parallel_size") or 1)
    pp = int(saved.get("pipeline_model_parallel_size") or 1)
    return full, common, tp, pp, saved


def read_megatron_core(root: str, iteration: Optional[int] = None,
                       hints: Optional[Dict[str, Any]] = None) -> FullCheckpoint:
    """A Megatron-Core GPT checkpoint (legacy or torch_dist) as a :class:`FullCheckpoint`.

    Args:
        root: the ``--save`` folder (with ``latest_checkpointed_iteration.txt``), or an
            ``iter_*`` / ``release`` folder.
        iteration: which ``iter_*`` to read (default: the tracker's).
        hints: settings the checkpoint may not save (``num_attention_heads``,
            ``true_vocab_size``, tokenizer files: :func:`..megatron_lm.args.model_args`).

    Raises:
        CheckpointError: missing, incomplete or mixed files, or not a GPT model.
        ConfigError: a GPT variant GPT2Model does not compute, or a missing hint.
    """
    hints = dict(hints or {})
    folder, iteration, release = find_folder(root, iteration)
    if dist_io.dist_config(folder) is not None:
        full, first, tp, pp, saved = _read_dist(folder)
    else:
        full, first, tp, pp, saved = _read_legacy(folder)
        check_core_supported(saved)
    if not hints.get("true_vocab_size") and saved.get("true_vocab_size"):
        hints["true_vocab_size"] = saved["true_vocab_size"]  # recorded by this project's writer
    args = model_args(saved, full, tp, pp, hints, folder)
    state = check_complete(gpt2_keys, full, args, folder)
    iteration = 0 if release else int(first.get("iteration", iteration))
    extras = {"lr_scheduler": {"num_steps": iteration}} if iteration else {}
    for name in ("consumed_train_samples", "consumed_valid_samples"):
        if saved.get(name):
            extras[name] = int(saved[name])
    return FullCheckpoint(state, args, iteration, extras)

"""Write a :class:`~megatron.checkpoint.FullCheckpoint` (GPT-2) as a Megatron-Core
``torch_dist`` checkpoint, which Megatron-LM (``--ckpt-format torch_dist``, the default) loads
into Megatron-Core's ``GPTModel`` built as GPT-2 (learned absolute positions, LayerNorm,
GeLU, tied output layer; either the local or the TransformerEngine layer spec).

- folders: ``iter_{N:07d}/`` and the tracker holding N; iteration 0 goes to ``release/``
  with the tracker ``release`` (Megatron-LM refuses an ``iter_0000000``);
- tensors under Megatron-Core's ``torch_dist`` names (TransformerEngine's fused-norm
  spelling, which the local spec maps its own names to), layers stacked ``[L, ...]``, each
  stored as the chunks the ranks of the asked (tp, pp) hold: a tensor-parallel split where
  Megatron-Core splits it, the layer dimension cut into ``L / pp`` per stage (the tied
  output copy of a last stage is the word embeddings' replica and is not stored);
- an ``_extra_state`` object (None) per layer and linear / attention module, as a
  local-spec model saves them (a TransformerEngine model takes None as "no FP8 state");
- ``common.pt``: ``args`` (:func:`.args.core_namespace`), ``checkpoint_version`` 3.0 and
  ``iteration`` (every megatron-core release reads it; 0.19 and later also read their own
  ``common_state`` object, which they prefer only when ``common.pt`` is absent).

Weights only: no optimizer or RNG state. Megatron-LM continues from it with
``--no-load-optim --no-load-rng`` (or ``--finetune``). Writing is atomic: a temporary
folder renamed into place, then the tracker.
"""
import io
import os
import shutil
from typing import Any, Dict, List, Optional

import torch

from ...resilience import durable
from ...common.errors import CheckpointError, ConfigError
from .. import gpt2_keys
from ..format import TRACKER_FILENAME, iteration_dir, write_atomic
from ..megatron_lm.files import RELEASE
from ..megatron_lm.qkv import WRITE_VERSION
from ..native_writer import check_layout, layout_args
from . import dist_io, names
from .args import core_namespace

_OUR_KEY = {theirs: ours for ours, theirs in names.DIST_LAYER_NAMES.items()}


def _tp_dim(name: str) -> Optional[int]:
    """The dimension ``name`` (a torch_dist tensor) is split on across tp ranks, or None."""
    if name.startswith(names.LAYERS):
        ours = _OUR_KEY[name[len(names.LAYERS):]]
        dim = gpt2_keys.tp_split_dim(f"{gpt2_keys.LAYER_PREFIX}0.{ours}")
        return None if dim is None else dim + 1  # after the stacked layer dimension
    return 0 if name == "embedding.word_embeddings.weight" else None


def rank_chunks(name: str, tensor: torch.Tensor, tp: int, pp: int) -> List[dist_io.Chunk]:
    """The pieces of ``tensor`` that the ranks of a tp x pp layout store (each once)."""
    tp_dim = _tp_dim(name)
    pp_parts = pp if name.startswith(names.LAYERS) else 1
    tp_parts = tp if tp_dim is not None else 1
    out = []
    for stage in range(pp_parts):
        for rank in range(tp_parts):
            offsets, piece = [0] * tensor.dim(), tensor
            if pp_parts > 1:
                size = tensor.shape[0] // pp_parts
                offsets[0] = stage * size
                piece = piece.narrow(0, offsets[0], size)
            if tp_parts > 1:
                size = tensor.shape[tp_dim] // tp_parts
                offsets[tp_dim] = rank * size
                piece = piece.narrow(tp_dim, offsets[tp_dim], size)
            out.append((tuple(offsets), piece.contiguous()))
    return out


def _extra_states(num_layers: int) -> Dict[str, io.BytesIO]:
    """``{unique key: pickled [None]}``: each layer's module extra state, as Megatron-Core's
    ShardedObject ``{key}/shard_{layer}_{L}`` saves it."""
    out = {}
    for module in names.EXTRA_STATE_MODULES:
        for layer in range(num_layers):
            buffer = io.BytesIO()
            torch.save([None], buffer)
            buffer.seek(0)
            out[f"{names.LAYERS}{module}{names.EXTRA_STATE}/shard_{layer}_{num_layers}"] = buffer
    return out


def _check(ckpt: Any, tp: int, pp: int) -> Dict[str, Any]:
    args = layout_args(ckpt.args, tp, pp)
    check_layout(args, tp, pp)
    if args["num_layers"] % pp:
        raise ConfigError(f"Megatron-Core's default pipeline split gives every stage the same "
                          f"number of layers: {args['num_layers']} layers do not split into "
                          f"{pp} stages")
    rows = ckpt.state[gpt2_keys.WORD_EMBEDDINGS].shape[0]
    if rows != args["padded_vocab_size"]:
        raise CheckpointError(f"the word embeddings have {rows} rows, the args say "
                              f"padded_vocab_size={args['padded_vocab_size']}")
    return args


def write_megatron_core(ckpt: Any, root: str, tp: Optional[int] = None,
                        pp: Optional[int] = None) -> str:
    """Write ``ckpt`` (already padded for ``tp``) as a torch_dist checkpoint under ``root``.

    Args:
        ckpt: a GPT-2 :class:`FullCheckpoint`.
        root: the output folder (new, or without this iteration's folder).
        tp, pp: the layout the files are cut for (default: the args').

    Returns:
        The iteration (or ``release``) folder written.
    """
    tp = tp or ckpt.args["tensor_model_parallel_size"]
    pp = pp or ckpt.args.get("pipeline_model_parallel_size", 1)
    args = _check(ckpt, tp, pp)
    release = ckpt.iteration == 0
    name = RELEASE if release else os.path.basename(iteration_dir(root, ckpt.iteration))
    final = os.path.join(root, name)
    if os.path.exists(final):
        raise CheckpointError(f"{final} already exists; choose another --output or remove it")
    if os.path.exists(root) and not os.path.isdir(root):
        raise CheckpointError(f"--output {root} exists and is not a directory")
    tensors = names.to_dist_names(ckpt.state, args["num_layers"])
    common = {"args": core_namespace(args, ckpt.iteration,
                                     (ckpt.extras.get("consumed_train_samples", 0),
                                      ckpt.extras.get("consumed_valid_samples", 0))),
              "checkpoint_version": WRITE_VERSION, "iteration": ckpt.iteration}
    tmp = os.path.join(root, f".tmp_megatron_core_{os.getpid()}", name)
    shutil.rmtree(os.path.dirname(tmp), ignore_errors=True)
    os.makedirs(tmp)
    try:
        dist_io.save_chunks(tmp, {k: rank_chunks(k, v, tp, pp) for k, v in tensors.items()},
                            {k: v.size() for k, v in tensors.items()},
                            _extra_states(args["num_layers"]))
        durable.write_file(os.path.join(tmp, dist_io.COMMON_FILE),
                           lambda out: torch.save(common, out))
        durable.fsync_tree(tmp)
        durable.replace(tmp, final)
    finally:
        shutil.rmtree(os.path.dirname(tmp), ignore_errors=True)

    def tracker(path):
        with open(path, "w") as handle:
            handle.write(RELEASE if release else str(ckpt.iteration))

    write_atomic(os.path.join(root, TRACKER_FILENAME), tracker)
    return final

"""Write a :class:`~megatron.checkpoint.FullCheckpoint` (GPT-2) as a version-3 Megatron-LM
checkpoint, the layout Megatron-LM v2.x and the legacy GPT model of later releases load.

- folders: ``iter_{N:07d}/`` and the tracker holding N, or ``release/`` and the tracker
  holding ``release`` for iteration 0 (Megatron-LM refuses iteration 0 otherwise);
  ``mp_rank_{tp:02d}`` without pipeline stages, ``mp_rank_{tp:02d}_{pp:03d}`` with them;
- each file: ``args`` (an ``argparse.Namespace`` with every size Megatron-LM's
  ``check_checkpoint_args`` compares), ``checkpoint_version`` 3.0, ``iteration`` and
  ``model``, the nested ``state_dict_for_save_checkpoint()`` of v2.5+ (``encoder``,
  ``self_attention``; :func:`.names.stage_tree`), QKV rows per head ``[np, 3, hn]``;
- pipeline stages get ``num_layers / pp`` consecutive layers each (Megatron-LM's rule; the
  layer count must divide), numbered from 0 within the stage; the last of several stages
  holds the output layer's copy of the word embeddings (``word_embeddings_for_head``).

Weights only: no optimizer, no RNG state. Megatron-LM loads a ``release`` folder as it is;
an ``iter_*`` one with ``--finetune`` or ``--no-load-optim --no-load-rng``. Writing is
atomic like the native writer's: a temporary folder renamed into place, the tracker last.
"""
import os
import shutil
from typing import Any, Optional

import torch

from ...resilience import durable
from ...common.errors import CheckpointError, ConfigError
from .. import gpt2_keys
from ..format import TRACKER_FILENAME, iteration_dir, write_atomic
from ..native_writer import check_layout, layout_args
from .args import megatron_namespace
from .files import RELEASE, rank_file_name
from .names import stage_tree
from .qkv import WRITE_VERSION


def _stage_keys(keys, stage, pp, layers_per_stage):
    first, last = stage * layers_per_stage, (stage + 1) * layers_per_stage
    out = []
    for key in keys:
        if key == gpt2_keys.WORD_EMBEDDINGS:
            keep = stage in (0, pp - 1)
        elif key == gpt2_keys.POSITION_EMBEDDINGS:
            keep = stage == 0
        elif key.startswith(gpt2_keys.FINAL_NORM_PREFIX):
            keep = stage == pp - 1
        else:
            keep = first <= int(key.split(".")[2]) < last
        if keep:
            out.append(key)
    return out


def _shard(tensor, dim, tp, tp_rank):
    if dim is None:
        return tensor.clone()
    return torch.chunk(tensor, tp, dim=dim)[tp_rank].clone()  # clone: save the slice only


def write_megatron_lm(ckpt: Any, root: str, tp: Optional[int] = None,
                      pp: Optional[int] = None) -> str:
    """Write ``ckpt`` (already padded for ``tp``) as a Megatron-LM checkpoint under ``root``.

    Args:
        ckpt: a GPT-2 :class:`FullCheckpoint`.
        root: the output folder (new, or without this iteration's folder).
        tp, pp: the layout (default: the args').

    Returns:
        The iteration (or ``release``) folder written.
    """
    tp = tp or ckpt.args["tensor_model_parallel_size"]
    pp = pp or ckpt.args.get("pipeline_model_parallel_size", 1)
    args = layout_args(ckpt.args, tp, pp)
    check_layout(args, tp, pp)
    num_layers = args["num_layers"]
    if num_layers % pp:
        raise ConfigError(f"Megatron-LM gives every pipeline stage the same number of layers: "
                          f"{num_layers} layers do not split into {pp} stages")
    rows = ckpt.state[gpt2_keys.WORD_EMBEDDINGS].shape[0]
    if rows != args["padded_vocab_size"]:
        raise CheckpointError(f"the word embeddings have {rows} rows, the args say "
                              f"padded_vocab_size={args['padded_vocab_size']}")
    release = ckpt.iteration == 0
    name = RELEASE if release else os.path.basename(iteration_dir(root, ckpt.iteration))
    final = os.path.join(root, name)
    if os.path.exists(final):
        raise CheckpointError(f"{final} already exists; choose another --output or remove it")
    if os.path.exists(root) and not os.path.isdir(root):
        raise CheckpointError(f"--output {root} exists and is not a directory")
    tmp_root = os.path.join(root, f".tmp_megatron_{os.getpid()}")
    shutil.rmtree(tmp_root, ignore_errors=True)
    namespace = megatron_namespace(args, ckpt.iteration,
                                   (ckpt.extras.get("consumed_train_samples", 0),
                                    ckpt.extras.get("consumed_valid_samples", 0)))
    per_stage = num_layers // pp
    try:
        for stage in range(pp):
            keys = _stage_keys(list(ckpt.state), stage, pp, per_stage)
            for tp_rank in range(tp):
                shard = {k: _shard(ckpt.state[k], gpt2_keys.tp_split_dim(k), tp, tp_rank)
                         for k in keys}
                state = {"args": namespace, "checkpoint_version": WRITE_VERSION,
                         "iteration": ckpt.iteration,
                         "model": stage_tree(shard, stage * per_stage,
                                             pp > 1 and stage == pp - 1)}
                path = rank_file_name(os.path.join(tmp_root, name), tp_rank, stage, pp)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                durable.write_file(path, lambda out, state=state: torch.save(state, out))
        durable.fsync_tree(os.path.join(tmp_root, name))
        durable.replace(os.path.join(tmp_root, name), final)
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)

    def tracker(tmp):
        with open(tmp, "w") as handle:
            handle.write(RELEASE if release else str(ckpt.iteration))

    write_atomic(os.path.join(root, TRACKER_FILENAME), tracker)
    return final

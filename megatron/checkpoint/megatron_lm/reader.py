"""Read a Megatron-LM GPT checkpoint (versions 0-3, any tp x pp, virtual-pipeline chunks)
into one :class:`~megatron.checkpoint.FullCheckpoint` in this project's GPT-2 keys.

Every rank file is read (:mod:`.safe_load`); each virtual-pipeline chunk of each stage is
renamed to whole-model keys (:mod:`.names`; layers are numbered from the chunk's global
offset: Megatron-LM gives chunk ``c`` of stage ``p`` the layers after those of every chunk
before ``c`` on every stage and those of chunk ``c`` on the stages before ``p``), each tp
rank's fused QKV is reordered from its version's row order (:mod:`.qkv`), the tp shards are
concatenated (:func:`..native_reader.merge_tensor_parallel`, which also checks replicated
tensors agree), and the last stage's tied copy of the word embeddings is checked against the
first stage's. Model sizes come from the tensors and the saved args (:mod:`.args`).

The vocabulary keeps its padded rows (``padded_vocab_size``); ``true_vocab_size`` is set
when a hint gives it, and the conversion pipeline (:func:`..native_writer.reshard`, the HF
writer) strips or re-pads them.
"""
from typing import Any, Dict, Optional

from ...common.errors import CheckpointError
from ...observability.progress import progress
from .. import gpt2_keys
from ..native_reader import FullCheckpoint, check_complete, merge_tensor_parallel, replicas_agree
from . import names, qkv
from .args import model_args, namespace_dict
from .files import checkpoint_folder, layout_files, model_chunks
from .safe_load import load_megatron_file


def _heads_per_rank(saved, hints, tp, versions, path):
    """Heads on each tp rank (needed to reorder version 0 / 1.0 QKV rows), or None."""
    heads = saved.get("num_attention_heads") or hints.get("num_attention_heads")
    if heads is None:
        if min(versions) < 2:
            raise CheckpointError(f"{path} saves no args, so the number of attention heads "
                                  f"(needed to reorder its version-{min(versions):g} "
                                  f"query_key_value rows) is unknown; pass "
                                  f"--num-attention-heads (the released GPT-2 345M has 16)")
        return None
    if heads % tp:
        raise CheckpointError(f"{path}: {heads} attention heads do not split over {tp} "
                              f"tensor-parallel ranks")
    return heads // tp


def _chunk_positions(lms, tp, pp):
    """``[(chunk, stage, first layer)]`` in global layer order (tp rank 0's counts)."""
    chunks = len(lms[(0, 0)])
    order, offset = [], 0
    for chunk in range(chunks):
        for stage in range(pp):
            order.append((chunk, stage, offset))
            offset += names.layer_counts(lms[(0, stage)][chunk][0])
    return order


def read_megatron_lm(root: str, iteration: Optional[int] = None,
                     hints: Optional[Dict[str, Any]] = None) -> FullCheckpoint:
    """A Megatron-LM GPT checkpoint as a :class:`FullCheckpoint`.

    Args:
        root: the checkpoint folder (with ``latest_checkpointed_iteration.txt`` or
            ``release/``), or an ``iter_*`` / ``release`` folder.
        iteration: which ``iter_*`` to read (default: the tracker's).
        hints: settings the checkpoint may not save (:func:`.args.model_args`).

    Raises:
        CheckpointError: missing, incomplete or mixed files, or not a GPT model.
        ConfigError: a GPT variant GPT2Model does not compute, or a missing hint.
    """
    hints = dict(hints or {})
    folder, iteration, release = checkpoint_folder(root, iteration)
    files, tp, pp = layout_files(folder)
    states = {key: load_megatron_file(path)
              for key, path in progress(sorted(files.items()), desc="reading Megatron-LM files",
                                        unit="files")}
    versions = {}
    lms = {}
    for key, state in states.items():
        versions[key] = qkv.check_version(state.get("checkpoint_version", 0), files[key])
        lms[key] = [names.language_model_part(names.flatten(chunk))
                    for chunk in model_chunks(state, files[key])]
    first = states[(0, 0)]
    saved = namespace_dict(first.get("args"))
    if len({len(v) for v in lms.values()}) != 1:
        raise CheckpointError(f"{folder}: the rank files hold different numbers of model "
                              f"chunks: files from different runs are mixed")
    heads = _heads_per_rank(saved, hints, tp, set(versions.values()), files[(0, 0)])
    full = {}
    for chunk, stage, offset in _chunk_positions(lms, tp, pp):
        shards = []
        for tp_rank in range(tp):
            lm, head = lms[(tp_rank, stage)][chunk]
            part = names.to_full_keys(lm, offset)
            for key in [k for k in part if names.is_qkv(k)]:
                part[key] = qkv.to_per_head(part[key], versions[(tp_rank, stage)], heads)
            if head is not None:
                if gpt2_keys.WORD_EMBEDDINGS in part:
                    raise CheckpointError(f"{files[(tp_rank, stage)]} holds the word "
                                          f"embeddings twice")
                part[gpt2_keys.WORD_EMBEDDINGS] = head
            shards.append(part)
        merged = merge_tensor_parallel(shards, f"{folder} stage {stage} chunk {chunk}")
        for key, tensor in merged.items():
            if key not in full:
                full[key] = tensor
            elif key == gpt2_keys.WORD_EMBEDDINGS:
                replicas_agree(full[key], tensor, f"{folder}: the output layer's copy of the "
                                                  f"word embeddings (stage {stage})")
            else:
                raise CheckpointError(f"{folder}: {key} appears on two pipeline stages")
    args = model_args(saved, full, tp, pp, hints, files[(0, 0)])
    state = check_complete(gpt2_keys, full, args, folder)
    iteration = 0 if release else int(first.get("iteration", first.get("total_iters",
                                                                         iteration)))
    extras = {}
    if iteration:
        extras["lr_scheduler"] = {"num_steps": iteration}
    for name in ("consumed_train_samples", "consumed_valid_samples"):
        if saved.get(name):
            extras[name] = int(saved[name])
    return FullCheckpoint(state, args, iteration, extras)

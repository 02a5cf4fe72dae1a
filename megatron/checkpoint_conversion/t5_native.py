"""Native T5 checkpoints of any (tp, pp) layout <-> one full T5Model state dict.

Reading merges tensor-parallel shards along their split dims (:mod:`.t5_keys`), renames
T5ModelPipe stage keys, and checks that every replicated copy agrees: the tied word
embedding on the first and last stage, and the relative-bias tables on every stage of a
stack (a difference means mixed files, or copies that were not kept tied). Writing splits a
full state dict into a layout's files, weights only, atomically (temporary folder renamed,
tracker last), in the layout :mod:`megatron.checkpointing` loads.
"""
import os
import shutil

import torch

from ..checkpointing import CHECKPOINT_FORMAT, TRACKER_FILENAME, checkpoint_name, iteration_dir
from ..errors import CheckpointError, ConfigError
from ..tokenizer import vocab_size_with_padding
from . import t5_keys
from .native_reader import CARRIED_KEYS, FullCheckpoint, load_rank_file, \
    merge_tensor_parallel, rank_files, replicas_agree, resolve_iteration
from .vocab_padding import resolve_true_vocab_size, target_padded_size

def _full_names(state, num_layers):
    if not t5_keys.is_pipe_state(state):
        return dict(state)
    return {t5_keys.pipe_to_full_key(k, num_layers): v for k, v in state.items()}


def _check_complete(full, args, folder):
    tied = not args.get("untie_embeddings", False)
    expected = t5_keys.full_keys(args["num_layers"], tied)
    missing = [k for k in expected if k not in full]
    unexpected = sorted(set(full) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {folder} does not hold a {args['num_layers']}-layer "
                              f"{'tied' if tied else 'untied'} T5: missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]}")
    return {k: full[k] for k in expected}


def read_native_t5(root, iteration=None):
    """Read and merge a native T5 checkpoint into a :class:`FullCheckpoint`.

    Args:
        root: a ``--save`` directory of pretrain_t5.py (or of a conversion).
        iteration: which iteration (default: the tracker's).
    """
    iteration = resolve_iteration(root, iteration)
    folder = iteration_dir(root, iteration)
    files = rank_files(folder)
    if (0, 0) not in files:
        raise CheckpointError(f"checkpoint {folder} has no mp_rank_00_000 (or mp_rank_00) file")
    first = load_rank_file(files[(0, 0)])
    args = dict(first.get("args") or {})
    if "t5_ff" not in args or "num_layers" not in args:
        raise CheckpointError(f"{files[(0, 0)]} is not a T5 checkpoint (its args have no "
                              f"t5_ff); use tools/convert_checkpoint.py for GPT-2")
    tp, pp = args["tensor_model_parallel_size"], args.get("pipeline_model_parallel_size", 1)
    if set(files) != {(t, p) for t in range(tp) for p in range(pp)}:
        raise CheckpointError(f"checkpoint {folder} should hold tp={tp} x pp={pp} rank folders, "
                              f"found {sorted(files)}")
    full = {}
    for pp_rank in range(pp):
        shards = [_full_names((first if (t, pp_rank) == (0, 0) else
                               load_rank_file(files[(t, pp_rank)])).get("model", {}),
                              args["num_layers"]) for t in range(tp)]
        merged = merge_tensor_parallel(shards, f"{folder} stage {pp_rank}",
                                       split_dim=t5_keys.tp_split_dim)
        for key, tensor in merged.items():
            if key in full:  # a replica on a later stage: embedding or relative-bias copy
                replicas_agree(full[key], tensor, f"{key} (pipeline stage {pp_rank})")
            else:
                full[key] = tensor
    extras = {k: first[k] for k in CARRIED_KEYS if k in first}
    return FullCheckpoint(_check_complete(full, args, folder), args,
                          int(first.get("iteration", iteration)), extras)


def _repad(state, true_vocab, padded):
    """Word embedding (and lm head) with ``padded`` rows: the real rows, then zeros."""
    out = dict(state)
    for key in (t5_keys.WORD_EMBEDDINGS, t5_keys.LM_HEAD):
        if key not in state or state[key].shape[0] == padded:
            continue
        if true_vocab is None or true_vocab > min(state[key].shape[0], padded):
            raise CheckpointError(f"cannot re-pad {state[key].shape[0]} vocabulary rows to "
                                  f"{padded} without the real vocabulary size; pass "
                                  f"--true-vocab-size")
        new = torch.zeros(padded, state[key].shape[1], dtype=state[key].dtype)
        new[:true_vocab] = state[key][:true_vocab]
        out[key] = new
    return out


def check_layout(args, tp, pp):
    """Raise ConfigError unless the T5 in ``args`` splits into ``tp`` x ``pp``."""
    if tp < 1 or pp < 1:
        raise ConfigError(f"target sizes must be >= 1, got tp={tp}, pp={pp}")
    problems = [f"{what} ({args[name]}) is not divisible by --target-tensor-parallel-size {tp}"
                for name, what in (("num_attention_heads", "attention heads"),
                                   ("ffn_hidden_size", "d_ff"),
                                   ("padded_vocab_size", "padded vocabulary size"))
                if args[name] % tp]
    if pp > 2 * args["num_layers"]:
        problems.append(f"--target-pipeline-parallel-size {pp} is larger than the "
                        f"{2 * args['num_layers']} encoder + decoder layers")
    if problems:
        raise ConfigError("; ".join(problems))


def reshard_t5(ckpt, tp, pp, divisible_by=None, true_vocab=None):
    """``ckpt`` padded for ``tp`` with its args set to the (tp, pp) layout (nothing written).

    Args:
        ckpt: a :class:`FullCheckpoint` (real or padded vocabulary rows).
        tp, pp: target layout.
        divisible_by: ``--make-vocab-size-divisible-by`` (default: the source's, else 128).
        true_vocab: real vocabulary rows (default: from the args or their tokenizer).
    """
    args = dict(ckpt.args)
    divisible_by = divisible_by or args.get("make_vocab_size_divisible_by") or 128
    true_vocab = resolve_true_vocab_size(args, true_vocab)
    if "padded_vocab_size" in args:
        padded = target_padded_size(args, tp, divisible_by, true_vocab)
    else:  # fresh from HF: only the real rows so far
        padded = vocab_size_with_padding(true_vocab, divisible_by, tp)
    args.update(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                padded_vocab_size=padded, make_vocab_size_divisible_by=divisible_by)
    if true_vocab is not None:
        args["true_vocab_size"] = true_vocab
    check_layout(args, tp, pp)
    return FullCheckpoint(_repad(ckpt.state, true_vocab, padded), args, ckpt.iteration,
                          dict(ckpt.extras))


def stage_state_t5(full_state, args, tp_rank, stage_bounds=None):
    """The state dict one (tp_rank, stage) loads: T5Model keys (pp=1) or stage keys."""
    tp, L = args["tensor_model_parallel_size"], args["num_layers"]
    if stage_bounds is None:
        names = {k: k for k in full_state}
    else:
        names = t5_keys.stage_full_keys(list(full_state), L, stage_bounds,
                                        tied=not args.get("untie_embeddings", False))
    out = {}
    for old, new in names.items():
        dim = t5_keys.tp_split_dim(old)
        tensor = full_state[old]
        out[new] = tensor.clone() if dim is None else torch.chunk(tensor, tp, dim)[tp_rank].clone()
    return out


def write_native_t5(ckpt, root, source="converted"):
    """Write ``ckpt`` (from :func:`reshard_t5`) as a native checkpoint; returns its folder."""
    args = ckpt.args
    tp, pp = args["tensor_model_parallel_size"], args["pipeline_model_parallel_size"]
    bounds = t5_keys.stage_spec_bounds(args["num_layers"], pp) if pp > 1 else [None]
    final = iteration_dir(root, ckpt.iteration)
    if os.path.exists(final):
        raise CheckpointError(f"{final} already exists; choose another --output or remove it")
    tmp_root = os.path.join(root, f".tmp_convert_{os.getpid()}")
    shutil.rmtree(tmp_root, ignore_errors=True)
    try:
        for pp_rank, stage_bounds in enumerate(bounds):
            for tp_rank in range(tp):
                path = checkpoint_name(tmp_root, ckpt.iteration, tp_rank, pp_rank)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                torch.save({"format": CHECKPOINT_FORMAT, "iteration": ckpt.iteration,
                            "args": args, "converted_from": source, "weights_only": True,
                            "model": stage_state_t5(ckpt.state, args, tp_rank, stage_bounds),
                            **ckpt.extras}, path)
        os.replace(iteration_dir(tmp_root, ckpt.iteration), final)
        tracker = os.path.join(root, TRACKER_FILENAME)
        with open(tracker + ".tmp", "w") as handle:
            handle.write(str(ckpt.iteration))
        os.replace(tracker + ".tmp", tracker)
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)
    return final

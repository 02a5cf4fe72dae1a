"""Split a full state dict (any model family) into a (tp, pp) layout and write a native
checkpoint.

The result has the layout :mod:`.format` describes and training reads
(``<root>/iter_N/mp_rank_{tp:02d}_{pp:03d}/model_optim_rng.pt`` and the tracker), with
whole-model keys when pp = 1 and pipeline-stage keys when pp > 1 (the family's key map
says which; a model without a key map is cut by its sharding record, which each file
carries on: :mod:`.recorded_reshard`). It holds weights only:
no optimizer state and no RNG state. A training run starts from it with ``--finetune``
(iteration 0, fresh optimizer) or resumes with ``--no-load-optim`` (keeps the iteration,
consumed samples and LR schedule carried over from the source; RNG from ``--seed``).

Writing is atomic and durable: every file goes to ``<root>/.tmp_convert_<pid>/`` first and is
flushed to disk and hashed as it is written, the finished iteration folder gets its manifest
of digests and is renamed into place, and the tracker is written last
(:func:`~.format.publish_iteration`).
"""
import os
import shutil
from typing import Any, Dict, Optional

import torch

from ..common.errors import CheckpointError, ConfigError
from ..observability.progress import progress
from ..tokenizer import vocab_size_with_padding
from .format import (CHECKPOINT_FORMAT, checkpoint_name, iteration_dir, publish_iteration,
                     uses_pipeline_engine, write_checkpoint_file)
from .manifest import relative_name
from .chunks import SCHEDULE_KEY, VPP_KEY, Bounds
from .key_maps import key_map_for
from .native_reader import FullCheckpoint
from .recorded_reshard import check_recorded_layout, recorded_rank_state, reshard_recorded
from .vocab_padding import repad_vocab_rows, resolve_true_vocab_size, target_padded_size


def check_layout(args: Dict[str, Any], tp: int, pp: int,
                 recorded: Optional[FullCheckpoint] = None, keys: Any = None) -> None:
    """Raise ConfigError unless the model in ``args`` splits into ``tp`` x ``pp``.

    Args:
        args: the saved args (model sizes); its key map says what must divide.
        tp, pp: target sizes.
        recorded: a model without a key map: its whole tensors and sharding record say
            what must divide instead (:func:`.recorded_reshard.check_recorded_layout`).
        keys: the key map (a run's family's); default: the one ``args`` describe.
    """
    if recorded is not None and recorded.stage_records is not None:
        check_recorded_layout(recorded, tp, pp)
        return
    if tp < 1 or pp < 1:
        raise ConfigError(f"target sizes must be >= 1, got tp={tp}, pp={pp}")
    keys = keys or key_map_for(args)
    problems = [f"{what} ({args[name]}) is not divisible by --target-tensor-parallel-size {tp}"
                for name, what in keys.TP_DIVIDES if args[name] % tp]
    stages, limit = keys.pipeline_capacity(args)
    if pp > stages:
        problems.append(f"--target-pipeline-parallel-size {pp} is larger than {limit}")
    if problems:
        raise ConfigError("; ".join(problems))


def layout_args(args: Dict[str, Any], tp: int, pp: int, vpp: int = 1,
                schedule: str = "") -> Dict[str, Any]:
    """The saved args of the target layout (sizes a loading run checks); the tools write
    1F1B stages (``vpp`` 1), which an interleaved or ZB-V run loads through a layout change.

    Args:
        schedule: the target's ``--pipeline-schedule`` (it decides the chunk placement);
            default 1f1b, or interleaved for ``vpp`` > 1.
    """
    out = dict(args)
    out.update(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    out[VPP_KEY] = vpp
    out[SCHEDULE_KEY] = schedule or ("interleaved" if vpp > 1 else "1f1b")
    return out


def _shard(tensor, dim, tp, tp_rank):
    if dim is None:
        return tensor.clone()
    # clone: torch.save of a view would write the whole full tensor's storage
    return torch.chunk(tensor, tp, dim=dim)[tp_rank].clone()


def stage_state(full_state: Dict[str, torch.Tensor], args: Dict[str, Any], tp_rank: int,
                stage_bounds: Optional[Bounds] = None, keys: Any = None
                ) -> Dict[str, torch.Tensor]:
    """The state dict one (tp_rank, stage) of the layout in ``args`` loads.

    Args:
        full_state: full state dict (whole-model keys).
        args: the target layout's args (``tensor_model_parallel_size``, model sizes).
        tp_rank: this tensor-parallel rank.
        stage_bounds: ``(start, end)`` layer-spec indices for a pipeline stage (a list of
            them for a rank with virtual stages), or None for a whole-model (pp = 1) state.
        keys: the key map (a run's family's); default: the one ``args`` describe.
    """
    keys = keys or key_map_for(args)
    tp = args["tensor_model_parallel_size"]
    if stage_bounds is None:
        names = {k: k for k in full_state}
    else:
        names = keys.stage_keys(list(full_state), args, stage_bounds)
    return {new: _shard(full_state[old], keys.tp_split_dim(old), tp, tp_rank)
            for old, new in names.items()}


def _prepare_output(root, iteration):
    final = iteration_dir(root, iteration)
    if os.path.exists(final):
        raise CheckpointError(f"{final} already exists; choose another --output or remove it")
    if os.path.exists(root) and not os.path.isdir(root):
        raise CheckpointError(f"--output {root} exists and is not a directory")
    tmp_root = os.path.join(root, f".tmp_convert_{os.getpid()}")
    shutil.rmtree(tmp_root, ignore_errors=True)
    os.makedirs(tmp_root)
    return tmp_root


def _rank_writer(ckpt, tp, pp):
    """``(f(tp_rank, pp_rank) -> the file's model [and record], target args)``, layout
    checked: by the key map, or by the sharding record of a model without one."""
    if ckpt.stage_records is not None:
        if (tp, pp) != (ckpt.args["tensor_model_parallel_size"],
                        ckpt.args.get("pipeline_model_parallel_size", 1)):
            raise ConfigError("a checkpoint without a key map is written at the layout "
                              "reshard() padded it for; call reshard(ckpt, tp, pp) first")
        check_layout(ckpt.args, tp, pp, recorded=ckpt)
        return (lambda t, p: recorded_rank_state(ckpt, t, p)), ckpt.args
    args = layout_args(ckpt.args, tp, pp)
    check_layout(args, tp, pp)
    bounds = key_map_for(args).stage_bounds(args, pp) if uses_pipeline_engine(pp) else [None]
    return (lambda t, p: {"model": stage_state(ckpt.state, args, t, bounds[p])}), args


def write_native(ckpt: FullCheckpoint, root: str, tp: Optional[int] = None,
                 pp: Optional[int] = None, source: str = "converted") -> str:
    """Write ``ckpt`` (a :class:`FullCheckpoint` already padded for ``tp``) as a checkpoint.

    Args:
        ckpt: the full model and its args (``padded_vocab_size`` must match the tensor).
        root: output ``--save``-style directory.
        tp, pp: target tensor- and pipeline-parallel sizes (default: the args' layout).
        source: where the weights came from (recorded in each file).

    Returns:
        The iteration folder written.
    """
    tp = tp or ckpt.args["tensor_model_parallel_size"]
    pp = pp or ckpt.args.get("pipeline_model_parallel_size", 1)
    rank_state, args = _rank_writer(ckpt, tp, pp)
    tmp_root = _prepare_output(root, ckpt.iteration)
    folder, digests = iteration_dir(tmp_root, ckpt.iteration), {}
    try:
        for pp_rank in progress(range(pp), desc="writing stages", unit="stages"):
            for tp_rank in range(tp):
                state = {"format": CHECKPOINT_FORMAT, "iteration": ckpt.iteration,
                         "args": args, "converted_from": source, "weights_only": True,
                         **rank_state(tp_rank, pp_rank), **ckpt.extras}
                path = checkpoint_name(tmp_root, ckpt.iteration, tp_rank, pp_rank)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                digests[relative_name(path, folder)] = write_checkpoint_file(path, state)
        publish_iteration(root, tmp_root, ckpt.iteration, digests=digests)
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)
    return iteration_dir(root, ckpt.iteration)


def reshard(ckpt: FullCheckpoint, tp: int, pp: int, divisible_by: Optional[int] = None,
            true_vocab: Optional[int] = None) -> FullCheckpoint:
    """``ckpt`` with its vocabulary padded for ``tp`` and its args updated (no files written).

    Args:
        ckpt: a :class:`FullCheckpoint` (padded rows, or only the real ones fresh from HF).
        tp, pp: target layout.
        divisible_by: ``--make-vocab-size-divisible-by`` of the target (default: the
            source's, else 128).
        true_vocab: real vocabulary rows, or None to look them up
            (:func:`~.vocab_padding.resolve_true_vocab_size`).
    """
    if ckpt.stage_records is not None:  # a model without a key map: by its record
        return reshard_recorded(ckpt, tp, pp, divisible_by, true_vocab)
    keys = key_map_for(ckpt.args)
    divisible_by = divisible_by or ckpt.args.get("make_vocab_size_divisible_by") or 128
    true_vocab = resolve_true_vocab_size(ckpt.args, true_vocab)
    if "padded_vocab_size" in ckpt.args:
        padded = target_padded_size(ckpt.args, tp, divisible_by, true_vocab)
    else:  # fresh from HF: only the real rows so far
        padded = vocab_size_with_padding(true_vocab, divisible_by, tp)
    state = repad_vocab_rows(ckpt.state, true_vocab, padded, keys.VOCAB_KEYS)
    args = layout_args(ckpt.args, tp, pp)
    args.update(padded_vocab_size=padded, make_vocab_size_divisible_by=divisible_by)
    if true_vocab is not None:
        args["true_vocab_size"] = true_vocab
    check_layout(args, tp, pp)
    return FullCheckpoint(state, args, ckpt.iteration, dict(ckpt.extras))

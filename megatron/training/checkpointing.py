"""Save and load training checkpoints (Megatron's layout), atomically and without pickled code.

Layout::

    <save>/iter_0000100/mp_rank_{tp:02d}_{pp:03d}/model_optim_rng.pt
    <save>/latest_checkpointed_iteration.txt

A save goes to ``<save>/.tmp/iter_0000100`` first; rank 0 renames it to ``iter_0000100``
once every file is complete, then rewrites the tracker (also via a temporary file). A crash
at any point leaves the previous checkpoint and tracker untouched. Loading uses
``torch.load(weights_only=True)``, so a checkpoint cannot execute code.
"""
import os
import random
import shutil

import numpy as np
import torch
import torch.distributed as dist

from .. import mpu
from ..config import args_to_dict
from ..errors import CheckpointError, not_text
from ..utils import print_rank_0, raise_if_any_rank_failed, warn_rank_0
from ..locks import remove_stale_tmps, tmp_name

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
CHECKPOINT_FORMAT = "megatron-tds/1"

#: Settings that must agree between a checkpoint and the flags that load it.
MODEL_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "kv_channels",
              "ffn_hidden_size", "padded_vocab_size", "max_position_embeddings", "hidden_bias",
              "tensor_model_parallel_size", "pipeline_model_parallel_size",
              # T5 (absent from GPT-2 checkpoints, so never compared for them)
              "t5_ff", "untie_embeddings", "relative_attention_num_buckets")

#: The settings of MODEL_KEYS that a resume at another layout may change
#: (megatron/training/layout_change.py).
LAYOUT_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "padded_vocab_size")


def iteration_dir(root, iteration):
    return os.path.join(root, f"iter_{iteration:07d}")


def checkpoint_name(root, iteration, tp_rank, pp_rank):
    """Path of one rank's file inside ``root/iter_*`` (or a temporary iteration folder)."""
    return os.path.join(iteration_dir(root, iteration), f"mp_rank_{tp_rank:02d}_{pp_rank:03d}",
                        "model_optim_rng.pt")


def _megatron_v2_name(root, iteration, tp_rank):
    """Megatron-LM's name when there is no pipeline: ``mp_rank_{tp:02d}``."""
    return os.path.join(iteration_dir(root, iteration), f"mp_rank_{tp_rank:02d}",
                        "model_optim_rng.pt")


def read_tracker(root):
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


def _write_atomic(path, write):
    remove_stale_tmps(path)  # a killed writer's leftovers
    tmp = tmp_name(path)
    write(tmp)
    os.replace(tmp, path)


# ---------------------------------------------------------------- RNG state
def get_rng_state():
    """This rank's generator states, in types ``weights_only`` loading accepts."""
    np_state = np.random.get_state()
    return {
        "random": random.getstate(),
        "np": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
               "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": mpu.get_cuda_rng_tracker().get_states(),
    }


def set_rng_state(state):
    random.setstate(state["random"])
    np_state = state["np"]
    np.random.set_state(("MT19937", np_state["keys"].numpy().astype(np.uint32), np_state["pos"],
                         np_state["has_gauss"], np_state["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    mpu.get_cuda_rng_tracker().set_states(state["tracker"])


def _gather_rng_states():
    """Every data-parallel rank's RNG state (dp rank order), for the dp-rank-0 writer."""
    state = get_rng_state()
    group = mpu.get_data_parallel_group()
    if dist.get_world_size(group) == 1:
        return [state]
    states = [None] * dist.get_world_size(group)
    dist.all_gather_object(states, state, group=group)
    return states


# ---------------------------------------------------------------- save
def optimizer_shard_name(root, iteration, tp_rank, pp_rank, dp_rank):
    """Per-data-parallel-rank optimizer file (DeepSpeed engines shard optimizer state)."""
    return os.path.join(os.path.dirname(checkpoint_name(root, iteration, tp_rank, pp_rank)),
                        f"optim_dp_rank_{dp_rank:03d}.pt")


def _main_state(iteration, backend, args, train_state, rng_states):
    state = {
        "format": CHECKPOINT_FORMAT, "iteration": iteration, "args": args_to_dict(args),
        "model": backend.module().state_dict(),
        "rng_state": rng_states,
        "consumed_train_samples": train_state.consumed_train_samples,
        "consumed_valid_samples": train_state.consumed_valid_samples,
    }
    if not args.no_save_optim and not backend.shards_optimizer:
        state["optimizer"] = backend.optimizer.state_dict()
    named = backend.named_optimizer()
    if not args.no_save_optim and named is not None:
        # names the positional optimizer state, so a resume at another layout can re-slice it
        from ..checkpoint_conversion.optimizer_reshard import param_names

        state["optimizer_param_names"] = param_names(backend.module(), named)
    state["lr_scheduler"] = backend.lr_scheduler.state_dict()
    counters = backend.counters()
    if counters:
        state["engine"] = counters
    return state


def save_checkpoint(iteration, backend, args, train_state):
    """Write a complete checkpoint for ``iteration`` (collective: every rank calls it).

    Data-parallel rank 0 of each (tp, pp) writes the model, schedule, RNG and progress. A
    backend whose optimizer state is sharded across data-parallel ranks (DeepSpeed's ZeRO-1,
    bf16) has every rank write its own optimizer file next to it.

    Args:
        iteration: steps completed.
        backend: the :class:`~megatron.training.backend.TrainingBackend`.
        args: the run configuration (saved, and checked when loading).
        train_state: object with ``consumed_train_samples`` / ``consumed_valid_samples``.
    """
    root = args.save
    tmp_root = os.path.join(root, ".tmp")
    rng_states = _gather_rng_states()
    if dist.get_rank() == 0:
        shutil.rmtree(iteration_dir(tmp_root, iteration), ignore_errors=True)
        os.makedirs(iteration_dir(tmp_root, iteration), exist_ok=True)
    dist.barrier()
    tp, pp, dp = (mpu.get_tensor_model_parallel_rank(), mpu.get_pipeline_model_parallel_rank(),
                  mpu.get_data_parallel_rank())
    path = checkpoint_name(tmp_root, iteration, tp, pp)
    if dp == 0:
        state = _main_state(iteration, backend, args, train_state, rng_states)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        _write_atomic(path, lambda tmp: torch.save(state, tmp))
    if backend.shards_optimizer and not args.no_save_optim:
        shard = optimizer_shard_name(tmp_root, iteration, tp, pp, dp)
        os.makedirs(os.path.dirname(shard), exist_ok=True)
        _write_atomic(shard, lambda tmp: torch.save(backend.optimizer.state_dict(), tmp))
    dist.barrier()
    if dist.get_rank() == 0:
        _publish(root, tmp_root, iteration)
    dist.barrier()
    print_rank_0(f"> saved checkpoint at iteration {iteration} to {root}")


def _publish(root, tmp_root, iteration):
    """Move the finished iteration folder into place, then point the tracker at it."""
    final = iteration_dir(root, iteration)
    if os.path.exists(final):  # re-saving the same iteration: replace it whole
        old = iteration_dir(os.path.join(root, ".old"), iteration)
        shutil.rmtree(old, ignore_errors=True)
        os.makedirs(os.path.dirname(old), exist_ok=True)
        os.replace(final, old)
        shutil.rmtree(old, ignore_errors=True)
    os.replace(iteration_dir(tmp_root, iteration), final)
    write_tracker(root, iteration)


def write_tracker(root, iteration):
    """Point ``root``'s tracker file at ``iteration`` (atomically; one rank calls it)."""
    def write(tmp):
        with open(tmp, "w") as handle:
            handle.write(str(iteration))

    _write_atomic(os.path.join(root, TRACKER_FILENAME), write)


# ---------------------------------------------------------------- load
def check_compatible(saved, args, path, ignore=()):
    """Raise unless the checkpoint's saved model settings match the run's.

    Args:
        saved: the checkpoint's args dict.
        args: the run configuration.
        path: the checkpoint, for the message.
        ignore: settings allowed to differ (:data:`LAYOUT_KEYS` for a resume at another
            layout).
    """
    diffs = [f"{k}: checkpoint {saved.get(k)!r}, flags {args.get(k)!r}"
             for k in MODEL_KEYS if k in saved and k not in ignore and saved.get(k) != args.get(k)]
    if not diffs:
        return
    raise CheckpointError(f"checkpoint {path} was made for a different model:\n    "
                          + "\n    ".join(diffs) + "\n  fix the flags to match it")


def _read_own_file(args, iteration):
    tp, pp = mpu.get_tensor_model_parallel_rank(), mpu.get_pipeline_model_parallel_rank()
    path = checkpoint_name(args.load, iteration, tp, pp)
    if not os.path.isfile(path) and pp == 0:
        path = _megatron_v2_name(args.load, iteration, tp) if os.path.isfile(
            _megatron_v2_name(args.load, iteration, tp)) else path
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file {path} is missing: the checkpoint in "
                              f"{args.load} is incomplete or was made with another layout")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from None
    check_compatible(state.get("args", {}), args, path)
    return state


def saved_optimizer_files(root, iteration, tp_rank, pp_rank):
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


def _load_optimizer(backend, state, args, iteration):
    """The optimizer state: in the main file, or the data-parallel ranks' files of a
    sharding backend (which may have been saved at another data-parallel size)."""
    hint = "pass --no-load-optim (or --finetune) to load the weights only"
    if not backend.shards_optimizer:
        if "optimizer" not in state:
            raise CheckpointError(f"checkpoint in {args.load} has no optimizer state; {hint}")
        backend.load_optimizer_state(state["optimizer"])
        return
    paths = saved_optimizer_files(args.load, iteration, mpu.get_tensor_model_parallel_rank(),
                                  mpu.get_pipeline_model_parallel_rank())
    backend.load_optimizer_files(paths)
    backend.load_counters(_engine_counters(state, args))


def _load_state(backend, args, iteration, load_optim):
    """Load the weights (and optimizer) for this rank; return the main file's state.

    A checkpoint of another tensor- or pipeline-parallel size goes through
    :mod:`.layout_change`; otherwise each rank reads its own file (and optimizer files).
    """
    from .layout_change import load_at_new_layout, saved_layout_differs

    if saved_layout_differs(args.load, iteration, args):
        state = load_at_new_layout(backend, args, iteration, load_optim)
        state["layout_change"] = True
        if load_optim and backend.shards_optimizer:
            backend.load_counters(_engine_counters(state, args))
        return state
    state = _read_own_file(args, iteration)
    backend.module().load_state_dict(state["model"])
    if load_optim:
        _load_optimizer(backend, state, args, iteration)
    return state


def _engine_counters(state, args):
    """The saved DeepSpeed engine counters, with ``micro_steps`` for this run's gas (the
    engine steps when it reaches a multiple of gas: a checkpoint saved at another gas would
    shift the accumulation boundary). A checkpoint saved by the DDP backend has none; they
    follow from the iteration and the consumed samples."""
    counters = dict(state.get("engine", {}))
    steps = counters.setdefault("global_steps", state["iteration"])
    counters.setdefault("global_samples", state.get("consumed_train_samples", 0))
    counters.setdefault("skipped_steps", 0)
    counters["micro_steps"] = steps * args.batch.gas
    return counters


def load_checkpoint(backend, args, train_state):
    """Resume from ``args.load`` if it holds a checkpoint (collective). Returns the iteration.

    A missing tracker starts from scratch with a warning (so ``--save`` and ``--load`` can
    name the same folder for automatic resume); a ``--load`` folder that does not exist was
    already refused by validation unless the run asked for it (``--load-if-exists``, or
    ``--load`` = ``--save``). An incompatible or incomplete checkpoint raises
    :class:`CheckpointError` on every rank.
    """
    if not args.load:
        return 0
    iteration = read_tracker(args.load)
    if iteration is None:
        warn_rank_0(f"no checkpoint in {args.load} ({TRACKER_FILENAME} is missing); "
                    f"starting from scratch")
        return 0
    load_optim = not args.no_load_optim and not args.finetune
    state, error = None, None
    try:
        state = _load_state(backend, args, iteration, load_optim)
    except CheckpointError as exc:
        error = exc
    raise_if_any_rank_failed(error, CheckpointError)
    if not load_optim:
        backend.after_weights_only_load()
    if args.finetune:
        print_rank_0(f"> loaded weights from {args.load} (iteration {iteration}) to fine-tune")
        return 0
    if "lr_scheduler" in state:
        backend.lr_scheduler.load_state_dict(state["lr_scheduler"])
    if not args.no_load_rng and "rng_state" not in state and "layout_change" not in state:
        # tools/convert_checkpoint.py writes weights only: dropout restarts from --seed
        warn_rank_0(f"checkpoint in {args.load} has no RNG state (a converted, weights-only "
                    f"checkpoint); random streams start from --seed")
    elif not args.no_load_rng and "rng_state" in state:
        rng_states = state["rng_state"]
        dp_rank = mpu.get_data_parallel_rank()
        set_rng_state(rng_states[dp_rank] if dp_rank < len(rng_states) else rng_states[0])
    train_state.consumed_train_samples = state.get("consumed_train_samples", 0)
    train_state.consumed_valid_samples = state.get("consumed_valid_samples", 0)
    print_rank_0(f"> loaded checkpoint from {args.load} at iteration {iteration}")
    return state["iteration"]

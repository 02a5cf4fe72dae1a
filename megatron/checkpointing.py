"""Save and load training checkpoints (Megatron's layout), atomically and without pickled code.

Layout::

    <save>/iter_0000100/mp_rank_{tp:02d}_{pp:03d}/model_optim_rng.pt
    <save>/latest_checkpointed_iteration.txt

A save goes to ``<save>/.tmp_iter_0000100`` first; rank 0 renames it to ``iter_0000100``
once every file is complete, then rewrites the tracker (also via a temporary file). A crash
at any point leaves the previous checkpoint and tracker untouched. Loading uses
``torch.load(weights_only=True)``, so a checkpoint cannot execute code.
"""
import inspect
import os
import random
import shutil

import numpy as np
import torch
import torch.distributed as dist

from . import mpu
from .arguments import args_to_dict
from .errors import CheckpointError
from .utils import print_rank_0, raise_if_any_rank_failed, unwrap_model, warn_rank_0

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
CHECKPOINT_FORMAT = "megatron-tds/1"

#: Settings that must agree between a checkpoint and the flags that load it.
MODEL_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "kv_channels",
              "ffn_hidden_size", "padded_vocab_size", "max_position_embeddings", "hidden_bias",
              "tensor_model_parallel_size", "pipeline_model_parallel_size",
              # T5 (absent from GPT-2 checkpoints, so never compared for them)
              "t5_ff", "untie_embeddings", "relative_attention_num_buckets")


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
    text = open(path).read().strip()
    if text == "release":
        return 0
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"{path} should hold an iteration number, found {text!r}") from None


def _write_atomic(path, write):
    tmp = f"{path}.tmp{os.getpid()}"
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
def _is_engine(model):
    return getattr(model, "megatron_kind", None) is not None


def optimizer_shard_name(root, iteration, tp_rank, pp_rank, dp_rank):
    """Per-data-parallel-rank optimizer file (DeepSpeed engines shard optimizer state)."""
    return os.path.join(os.path.dirname(checkpoint_name(root, iteration, tp_rank, pp_rank)),
                        f"optim_dp_rank_{dp_rank:03d}.pt")


_ENGINE_COUNTERS = ("global_steps", "global_samples", "skipped_steps", "micro_steps")


def _main_state(iteration, model, optimizer, lr_scheduler, args, train_state, rng_states):
    state = {
        "format": CHECKPOINT_FORMAT, "iteration": iteration, "args": args_to_dict(args),
        "model": unwrap_model(model).state_dict(),
        "rng_state": rng_states,
        "consumed_train_samples": train_state.consumed_train_samples,
        "consumed_valid_samples": train_state.consumed_valid_samples,
    }
    if optimizer is not None and not args.no_save_optim and not _is_engine(model):
        state["optimizer"] = optimizer.state_dict()
    if lr_scheduler is not None:
        state["lr_scheduler"] = lr_scheduler.state_dict()
    if _is_engine(model):
        state["engine"] = {k: int(getattr(model, k, 0)) for k in _ENGINE_COUNTERS}
    return state


def save_checkpoint(iteration, model, optimizer, lr_scheduler, args, train_state):
    """Write a complete checkpoint for ``iteration`` (collective: every rank calls it).

    Data-parallel rank 0 of each (tp, pp) writes the model, schedule, RNG and progress. A
    DeepSpeed engine's optimizer state may be sharded across data-parallel ranks (ZeRO-1,
    bf16), so there every rank writes its own optimizer file next to it.

    Args:
        iteration: steps completed.
        model: the model (DDP-wrapped or not) or a DeepSpeed / tds engine.
        optimizer: MegatronOptimizer or the engine's optimizer, or None.
        lr_scheduler: AnnealingLR or None.
        args: the run's args (saved, and checked when loading).
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
        state = _main_state(iteration, model, optimizer, lr_scheduler, args, train_state,
                            rng_states)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        _write_atomic(path, lambda tmp: torch.save(state, tmp))
    if _is_engine(model) and optimizer is not None and not args.no_save_optim:
        shard = optimizer_shard_name(tmp_root, iteration, tp, pp, dp)
        os.makedirs(os.path.dirname(shard), exist_ok=True)
        _write_atomic(shard, lambda tmp: torch.save(optimizer.state_dict(), tmp))
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

    def write(tmp):
        with open(tmp, "w") as handle:
            handle.write(str(iteration))

    _write_atomic(os.path.join(root, TRACKER_FILENAME), write)


# ---------------------------------------------------------------- load
def _check_compatible(saved, args, path):
    diffs = [f"{k}: checkpoint {saved.get(k)!r}, flags {getattr(args, k, None)!r}"
             for k in MODEL_KEYS if k in saved and saved.get(k) != getattr(args, k, None)]
    if not diffs:
        return
    hint = ""
    if any(d.startswith(("tensor_model", "pipeline_model")) for d in diffs):
        hint = ("; reshard it to this layout with tools/convert_checkpoint.py "
                "--target-tensor-parallel-size/--target-pipeline-parallel-size")
    raise CheckpointError(f"checkpoint {path} was made for a different model:\n    "
                          + "\n    ".join(diffs) + f"\n  fix the flags to match it{hint}")


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
    _check_compatible(state.get("args", {}), args, path)
    return state


def _load_optimizer(model, optimizer, state, args, iteration):
    """The optimizer state: in the main file, or this rank's shard for engines."""
    hint = "pass --no-load-optim (or --finetune) to load the weights only"
    if not _is_engine(model):
        if "optimizer" not in state:
            raise CheckpointError(f"checkpoint in {args.load} has no optimizer state; {hint}")
        optimizer.load_state_dict(state["optimizer"])
        return
    shard = optimizer_shard_name(args.load, iteration, mpu.get_tensor_model_parallel_rank(),
                                 mpu.get_pipeline_model_parallel_rank(),
                                 mpu.get_data_parallel_rank())
    if not os.path.isfile(shard):
        raise CheckpointError(f"optimizer shard {shard} is missing (a different data-parallel "
                              f"size, or a checkpoint saved without optimizer state); {hint}")
    shard_state = _load_engine_optimizer_state(shard)
    params = inspect.signature(optimizer.load_state_dict).parameters
    if "state_dict_list" in params:
        # ZeRO / bf16 optimizers take every dp rank's state and pick their own; their fp32
        # master weights must come from the shard, not be re-derived from fp16/bf16 weights.
        states = [None] * mpu.get_data_parallel_world_size()
        states[mpu.get_data_parallel_rank()] = shard_state
        extra = {"load_from_fp32_weights": True} if "load_from_fp32_weights" in params else {}
        optimizer.load_state_dict(states, **extra)
    else:
        optimizer.load_state_dict(shard_state)
    for key, value in state.get("engine", {}).items():
        setattr(model, key, value)


def _load_engine_optimizer_state(path):
    """weights_only load that also admits DeepSpeed's plain records in optimizer states.

    ZeRO and bf16 optimizer states pickle a few DeepSpeed objects: the loss scaler and
    fragment addresses. They are plain attribute holders (no ``__setstate__``, no
    ``__reduce__``), so allowing exactly these classes still executes no pickled code.
    """
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    records = [fragment_address, LossScaler, DynamicLossScaler, ZeroStageEnum]
    with torch.serialization.safe_globals(records):
        return torch.load(path, map_location="cpu", weights_only=True)


def load_checkpoint(model, optimizer, lr_scheduler, args, train_state):
    """Resume from ``args.load`` if it holds a checkpoint (collective). Returns the iteration.

    A missing tracker starts from scratch with a warning (so ``--save`` and ``--load`` can
    name the same folder for automatic resume). An incompatible or incomplete checkpoint
    raises :class:`CheckpointError` on every rank.
    """
    if not args.load:
        return 0
    iteration = read_tracker(args.load)
    if iteration is None:
        warn_rank_0(f"no checkpoint in {args.load} ({TRACKER_FILENAME} is missing); "
                    f"starting from scratch")
        return 0
    state, error = None, None
    try:
        state = _read_own_file(args, iteration)
    except CheckpointError as exc:
        error = exc
    raise_if_any_rank_failed(error, CheckpointError)
    unwrap_model(model).load_state_dict(state["model"])
    load_optim = optimizer is not None and not args.no_load_optim and not args.finetune
    error = None
    if load_optim:
        try:
            _load_optimizer(model, optimizer, state, args, iteration)
        except CheckpointError as exc:
            error = exc
        raise_if_any_rank_failed(error, CheckpointError)
    elif hasattr(optimizer, "refresh_fp32_params"):
        optimizer.refresh_fp32_params()  # DeepSpeed fp16/bf16: master weights from the model
    if args.finetune:
        print_rank_0(f"> loaded weights from {args.load} (iteration {iteration}) to fine-tune")
        return 0
    if lr_scheduler is not None and "lr_scheduler" in state:
        lr_scheduler.load_state_dict(state["lr_scheduler"])
    if not args.no_load_rng and "rng_state" not in state:
        # tools/convert_checkpoint.py writes weights only: dropout restarts from --seed
        warn_rank_0(f"checkpoint in {args.load} has no RNG state (a converted, weights-only "
                    f"checkpoint); random streams start from --seed")
    elif not args.no_load_rng:
        rng_states = state["rng_state"]
        dp_rank = mpu.get_data_parallel_rank()
        set_rng_state(rng_states[dp_rank] if dp_rank < len(rng_states) else rng_states[0])
    train_state.consumed_train_samples = state.get("consumed_train_samples", 0)
    train_state.consumed_valid_samples = state.get("consumed_valid_samples", 0)
    print_rank_0(f"> loaded checkpoint from {args.load} at iteration {iteration}")
    return state["iteration"]

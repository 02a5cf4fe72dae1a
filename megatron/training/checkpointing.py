"""Save and resume a training run: its model, optimizer, schedule, RNG and data position.

The format on disk (Megatron's layout, the tracker, atomic publication, weights-only loads)
is :mod:`megatron.checkpoint`'s; this module decides what a run puts into it and how a run
takes it back, through the backend's :class:`~.state_io.OptimizerStateIO`. A save goes to
``<save>/.tmp/iter_*`` first, each file flushed to disk and hashed as it is written; rank 0
publishes the folder with the manifest of every file's digest once every rank's files are
complete, then rewrites the tracker, so a crash (of a process or of a node) at any point
leaves the previous checkpoint in place, and a failure on one rank (a full disk) stops every
rank with the same error. A resume verifies every file it reads against the manifest
(:mod:`.checkpoint_integrity` decides, on every rank alike, what a damaged one means).
"""
import os
import random
import shutil
from typing import Any, Dict, Optional

import numpy as np
import torch
import torch.distributed as dist

from .. import mpu
from ..checkpoint.format import (  # noqa: F401 (TRACKER_FILENAME, read_tracker, write_tracker:
    CHECKPOINT_FORMAT, TRACKER_FILENAME, check_compatible, checkpoint_name,  # public here)
    iteration_dir, megatron_v2_name, optimizer_shard_name, publish_iteration, read_tracker,
    write_checkpoint_file, write_tracker)
from ..checkpoint.layout_change import read_at_new_layout, saved_layout_differs, weights_for_run
from ..checkpoint.manifest import check_file, verification
from ..checkpoint.sharding import module_classes
from ..config.run_config import RunConfig
from ..resilience.agreement import agree, agree_on_call, agree_on_value
from ..config import args_to_dict
from ..common.errors import CheckpointDigestError, CheckpointError, MegatronError
from ..common.utils import print_rank_0, warn_rank_0
from ..resilience import checkpoint_integrity as integrity
from ..resilience.async_save import SAVE_FAILED_HINT, AsyncCheckpointWriter
from .schedule_change import resume_schedule


# ---------------------------------------------------------------- RNG state
def get_rng_state() -> Dict[str, Any]:
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


def set_rng_state(state: Dict[str, Any]) -> None:
    random.setstate(state["random"])
    np_state = state["np"]
    np.random.set_state(("MT19937", np_state["keys"].numpy().astype(np.uint32), np_state["pos"],
                         np_state["has_gauss"], np_state["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    mpu.get_cuda_rng_tracker().set_states(state["tracker"])


def _gather_rng_states():
    """Every data x context rank's RNG state (in that group's order), for its rank-0 writer."""
    state = get_rng_state()
    group = mpu.get_data_parallel_group(with_context_parallel=True)
    if dist.get_world_size(group) == 1:
        return [state]
    states = [None] * dist.get_world_size(group)
    dist.all_gather_object(states, state, group=group)
    return states


# ---------------------------------------------------------------- save
def _main_state(iteration, backend, cfg, train_state, rng_states):
    io = backend.state_io
    state = {
        "format": CHECKPOINT_FORMAT, "iteration": iteration, "args": args_to_dict(cfg),
        "model": backend.module().state_dict(),
        # how each tensor is split (megatron.checkpoint.sharding): layout change reads it
        "sharding": _sharding_record(backend.module()), "family": cfg.family,
        "module_classes": module_classes(backend.module()),  # a structural match's (resume)
        "rng_state": rng_states,
        "consumed_train_samples": train_state.consumed_train_samples,
        "consumed_valid_samples": train_state.consumed_valid_samples,
    }
    if not cfg.checkpoint.no_save_optim:
        if not io.sharded:
            state["optimizer"] = io.state_dict()
        names = io.param_names()
        if names is not None:  # lets a resume at another layout re-slice the state
            state["optimizer_param_names"] = names
    state["lr_scheduler"] = backend.lr_scheduler.state_dict()
    counters = io.counters()
    if counters:
        state["engine"] = counters
    return state


def _sharding_record(module):
    from ..checkpoint.sharding import pipeline_chunk_of, sharding_record

    return sharding_record(module, mpu.get_pipeline_model_parallel_rank(),
                           pipeline_chunk_of(module))


def _write_file(path, state):
    """One complete file (atomically and durably: a killed writer or a crashed node leaves
    no half file); returns its digest, hashed as it was written, for the manifest."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return write_checkpoint_file(path, state)


def _write_files(files):
    """Write ``(path, state)`` pairs; returns their ``(path, digest)`` pairs."""
    return [(path, _write_file(path, state)) for path, state in files]


def _publish(root, tmp_root, iteration, digests):
    """Rank 0, once every rank's files are complete: the manifest, the folder into place,
    then the tracker."""
    publish_iteration(root, tmp_root, iteration, digests=digests)
    print(f"> saved checkpoint at iteration {iteration} to {root}", flush=True)


def _expert_place(dp_rank):
    """``(ep rank for the file names or None at ep 1, whether this rank writes the main
    file)``: at ep > 1 the ranks of one (tp, pp) hold different experts, so the first
    rank of each expert-data-parallel group writes its ep rank's file."""
    if mpu.get_expert_model_parallel_world_size() <= 1:
        return None, dp_rank == 0
    return mpu.get_expert_model_parallel_rank(), mpu.get_expert_data_parallel_rank() == 0


def _prepare_folder(tmp_root, iteration):
    """Rank 0: an empty temporary iteration folder (a failed save's leftovers go)."""
    if dist.get_rank() == 0:
        shutil.rmtree(iteration_dir(tmp_root, iteration), ignore_errors=True)
        os.makedirs(iteration_dir(tmp_root, iteration), exist_ok=True)


def save_step(what: str, iteration: int, root: str) -> str:
    """The name of one step of a save, for the message every rank raises when it fails."""
    return f"{what} of the checkpoint of iteration {iteration} to {root}"


def new_async_writer() -> Any:
    """Collective: the background writer of ``--async-save`` (:mod:`.async_save`)."""
    # through the module's names, so a test's patch of _write_file or publish_iteration
    # reaches the writer
    return AsyncCheckpointWriter(lambda path, state: _write_file(path, state),
                                 lambda *a, **k: _publish(*a, **k))


def save_checkpoint(iteration: int, backend: Any, cfg: RunConfig, train_state: Any,
                    writer: Optional[Any] = None) -> None:
    """Write a complete checkpoint for ``iteration`` (collective: every rank calls it).

    Data-parallel rank 0 of each (tp, pp) writes the model, schedule, RNG and progress (with
    context parallelism: rank 0 of the data x context group; with expert parallelism,
    ep > 1, the first rank of each expert-data-parallel group writes its ep rank's folder).
    A backend whose optimizer state is sharded across data-parallel ranks (the distributed
    optimizer, DeepSpeed's ZeRO-1, bf16) has every rank write its own optimizer file next
    to it. Each step that can fail on
    one rank alone (preparing the folder, writing the files, publishing) ends in one
    agreement (:func:`megatron.resilience.agreement.agree`), so a full disk on one node stops every rank
    with the same :class:`CheckpointError`, and the tracker still names the previous
    checkpoint.

    Args:
        iteration: steps completed.
        backend: the :class:`~megatron.training.backend.TrainingBackend`.
        cfg: the run configuration (saved, and checked when loading).
        train_state: object with ``consumed_train_samples`` / ``consumed_valid_samples``.
        writer: an :class:`~.async_save.AsyncCheckpointWriter` (``--async-save``): the
            files are snapshotted and written in the background (the previous background
            write is waited for first); None writes them before returning.

    Raises:
        CheckpointError: on every rank, naming the ranks that failed and why.
    """
    if writer is not None:
        writer.wait()  # one write at a time; raises (on every rank) if the previous one failed
    root = cfg.checkpoint.save
    tmp_root = os.path.join(root, ".tmp")
    rng_states = _gather_rng_states()
    agree_on_call(save_step("preparing the folder", iteration, root), _prepare_folder,
                  tmp_root, iteration, error_type=CheckpointError, hint=SAVE_FAILED_HINT)
    # the ranks of a data x context group hold the same shard: rank 0 of it writes, and a
    # sharded optimizer (ZeRO over that group) gets one file per rank of it
    tp, pp, dp = (mpu.get_tensor_model_parallel_rank(), mpu.get_pipeline_model_parallel_rank(),
                  mpu.get_data_parallel_rank(with_context_parallel=True))
    ep_rank, first = _expert_place(dp)
    files = []
    if first:
        state = _main_state(iteration, backend, cfg, train_state, rng_states)
        files.append((checkpoint_name(tmp_root, iteration, tp, pp, ep_rank), state))
    if backend.state_io.sharded and not cfg.checkpoint.no_save_optim:
        files.append((optimizer_shard_name(tmp_root, iteration, tp, pp, dp, ep_rank),
                      backend.state_io.state_dict()))
    if writer is not None:
        writer.submit(root, tmp_root, iteration, files)
        return
    written = agree_on_call(save_step("writing the files", iteration, root), _write_files,
                            files, error_type=CheckpointError, hint=SAVE_FAILED_HINT)
    digests = integrity.gather_digests(written, iteration_dir(tmp_root, iteration))
    agree_on_call(f"publishing the checkpoint of iteration {iteration} to {root}",  # as async
                  publish_iteration if dist.get_rank() == 0 else lambda *a, **k: None,
                  root, tmp_root, iteration, digests=digests, error_type=CheckpointError,
                  hint=SAVE_FAILED_HINT)
    print_rank_0(f"> saved checkpoint at iteration {iteration} to {root}")


# ---------------------------------------------------------------- load
def _read_own_file(cfg, iteration):
    root = cfg.checkpoint.load
    tp, pp = mpu.get_tensor_model_parallel_rank(), mpu.get_pipeline_model_parallel_rank()
    path = checkpoint_name(root, iteration, tp, pp, _run_ep_rank())
    if not os.path.isfile(path) and pp == 0 and _run_ep_rank() is None and \
            os.path.isfile(megatron_v2_name(root, iteration, tp)):
        path = megatron_v2_name(root, iteration, tp)
    check_file(path)  # against the manifest, before a byte of it is used
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file {path} is missing: the checkpoint in {root} is "
                              f"incomplete or was made with another layout")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"cannot read checkpoint file {path}: {exc}") from None
    check_compatible(state.get("args", {}), cfg, path)
    _check_family(state, cfg, path)
    return state


def _run_ep_rank():
    """This rank's ep rank in file names (None at expert-parallel size 1)."""
    return mpu.get_expert_model_parallel_rank() \
        if mpu.get_expert_model_parallel_world_size() > 1 else None


def _check_family(state, cfg, path):
    """A checkpoint that names its model family must be the run's (checkpoints written
    before the name was saved, or by a provider run, name none)."""
    saved = state.get("family")
    if saved and cfg.family and saved != cfg.family:
        raise CheckpointError(f"checkpoint {path} holds a {saved!r} model but this run trains "
                              f"{cfg.family!r}; load it with that family, or point --load "
                              f"at a {cfg.family!r} checkpoint")


def _load_optimizer(backend, state, cfg, iteration):
    """The optimizer state of this (tp, pp): the main file's, or the data-parallel ranks'
    files (which may have been saved at another data-parallel size, or by another
    optimizer: the backend's state IO reads them by parameter name then)."""
    io = backend.state_io
    io.load_saved(state, cfg.checkpoint.load, iteration, mpu.get_tensor_model_parallel_rank(),
                  mpu.get_pipeline_model_parallel_rank())
    io.load_counters(_engine_counters(state, cfg))


def _load_at_new_layout(backend, cfg, iteration, load_optim):
    """Another tp or pp: this rank's slice of the whole checkpoint (megatron.checkpoint)."""
    module = backend.module()
    shapes = {k: list(v.shape) for k, v in module.state_dict().items()}
    rank = read_at_new_layout(cfg.checkpoint.load, iteration, cfg, load_optim,
                              own=_sharding_record(module),
                              own_layout={"classes": module_classes(module), "shapes": shapes})
    backend.module().load_state_dict(rank.model)
    if rank.optimizer is not None:
        backend.state_io.load_named(rank.optimizer)
        if backend.state_io.sharded:
            backend.state_io.load_counters(_engine_counters(rank.first, cfg))
    warn_rank_0(
        f"resuming {rank.description} at tp={cfg.parallel.tp}, pp={cfg.parallel.pp}: "
        f"weights{', Adam state' if load_optim else ''}, the learning-rate schedule's step "
        f"and the data position carried over; random streams restart from --seed")
    return dict(rank.first, layout_change=True)


def _load_state(backend, cfg, iteration, load_optim):
    """Load the weights (and optimizer) for this rank; return the main file's state."""
    if saved_layout_differs(cfg.checkpoint.load, iteration, cfg):
        return _load_at_new_layout(backend, cfg, iteration, load_optim)
    state = _read_own_file(cfg, iteration)
    backend.module().load_state_dict(state["model"])
    if load_optim:
        _load_optimizer(backend, state, cfg, iteration)
    return state


def _engine_counters(state, cfg):
    """The saved DeepSpeed engine counters, with ``micro_steps`` for this run's gas (the
    engine steps when it reaches a multiple of gas: a checkpoint saved at another gas would
    shift the accumulation boundary). A checkpoint saved by the DDP backend has none; they
    follow from the iteration and the consumed samples."""
    counters = dict(state.get("engine", {}))
    steps = counters.setdefault("global_steps", state["iteration"])
    counters.setdefault("global_samples", state.get("consumed_train_samples", 0))
    counters.setdefault("skipped_steps", 0)
    counters["micro_steps"] = steps * cfg.batch.gas
    return counters


def _contents(cfg):
    """What ``--load`` holds, as this rank sees it: ``(index of the family's foreign format,
    None)``, or ``(None, the tracker's iteration or None when there is no tracker)``."""
    fmt = _foreign_format(cfg)
    if fmt is not None:
        return cfg.model_family.foreign_checkpoints.index(fmt), None
    return None, read_tracker(cfg.checkpoint.load)


def _agreed_contents(cfg):
    """Collective: :func:`_contents`, the same on every rank, as ``(foreign format or None,
    iteration or None)``.

    A tracker that one rank cannot read (a lost mount, a half-synced copy on a node-local
    disk) or reads differently would otherwise make that rank raise, or start from scratch,
    alone while the others load: every rank now raises the same :class:`CheckpointError`.
    """
    found, error = None, None
    try:
        found = _contents(cfg)
    except Exception as exc:  # every rank learns of it below (a bug keeps its traceback)
        error = exc
    formats = cfg.model_family.foreign_checkpoints if cfg.model_family is not None else ()

    def in_words(contents):
        index, iteration = contents
        if index is not None:
            return f"a {formats[index].DESCRIPTION}"
        return "no tracker" if iteration is None else f"iteration {iteration}"

    index, iteration = agree_on_value(
        found, error, f"reading the tracker of {cfg.checkpoint.load}", in_words,
        error_type=CheckpointError,
        hint="every rank must see the same --load folder (a shared file system, or the same "
             "copy on every node)")
    return (formats[index] if index is not None else None), iteration


def _foreign_format(cfg):
    """The run's model family's foreign checkpoint format the ``--load`` folder holds, or
    None (a native checkpoint, or a family with none)."""
    family = cfg.model_family  # the run's object: no lookup by name
    for fmt in family.foreign_checkpoints if family is not None else ():
        if fmt.detect(cfg.checkpoint.load):
            return fmt
    return None


def _load_foreign(fmt, backend, cfg, load_optim):
    """Load another project's checkpoint (e.g. Megatron-LM's): every rank reads the whole
    model and keeps its slice for the run's layout. Weights, the iteration and the consumed
    samples carry over (the LR schedule continues from the iteration); the optimizer and
    random state start fresh."""
    root = cfg.checkpoint.load
    describe = getattr(fmt, "describe", None)  # the format's own words for what it found
    found = (describe(root) if describe else None) or fmt.DESCRIPTION
    full = fmt.read_full(root, None, {"num_attention_heads": cfg.model.num_attention_heads,
                                      "true_vocab_size": cfg.model.true_vocab_size})
    backend.module().load_state_dict(weights_for_run(full, cfg, root))
    print_rank_0(f"> {root} holds a {found}: its weights, saved at "
                 f"tp={full.args['tensor_model_parallel_size']}, "
                 f"pp={full.args.get('pipeline_model_parallel_size', 1)}, loaded at "
                 f"tp={cfg.parallel.tp}, pp={cfg.parallel.pp}")
    warn_rank_0(f"{root} is a {fmt.DESCRIPTION}: it has no manifest of digests, so its files "
                f"were loaded unverified")
    if load_optim:
        warn_rank_0(f"{root} is a {found}: only its weights, iteration, consumed samples and "
                    f"LR schedule position were taken; its optimizer state is not read, so "
                    f"Adam starts fresh (pass --no-load-optim or --finetune to say so)")
    state = {"iteration": full.iteration, "foreign": fmt.DESCRIPTION, **full.extras}
    return state


def _agreed_load(cfg, load, *args, verified=True):
    """Collective: ``load(*args)`` on every rank; a failure on any rank (one rank's disk or
    file) raises on every rank, except, when ``verified``, a failed verification, returned
    for the agreed decision of :func:`.checkpoint_integrity.damaged_or_none`. Returns
    ``(state, this rank's CheckpointDigestError or None)``."""
    state, error, damage = None, None, None
    try:
        state = load(*args)
    except CheckpointDigestError as exc:
        damage, error = (exc, None) if verified else (None, exc)
    except (MegatronError, OSError) as exc:
        error = exc
    agree(error, f"loading the checkpoint in {cfg.checkpoint.load}", error_type=CheckpointError)
    return state, damage


def _load_verified(backend, cfg, iteration, load_optim):
    """Collective: load ``iteration``, each file verified as it is read; when a file fails
    on any rank, every rank falls back to the newest older checkpoint that verifies (a
    resumed run: ``--load`` = ``--save``) or raises. Returns ``(state, iteration loaded)``."""
    damaged = []
    while True:
        with verification(not cfg.checkpoint.no_verify_checkpoint) as scope:
            state, damage = _agreed_load(cfg, _load_state, backend, cfg, iteration, load_optim)
        older = integrity.damaged_or_none(cfg, iteration, damage, damaged)
        if older is None:
            break
        iteration = older
    integrity.set_aside_damaged(cfg, damaged, iteration)
    integrity.report(cfg, iteration, scope)
    return state, iteration


def _restore_rng(cfg, state):
    if cfg.checkpoint.no_load_rng:
        return
    if "rng_state" in state:
        rng_states = state["rng_state"]
        dp_rank = mpu.get_data_parallel_rank(with_context_parallel=True)
        set_rng_state(rng_states[dp_rank] if dp_rank < len(rng_states) else rng_states[0])
    elif "foreign" in state:
        warn_rank_0(f"checkpoint in {cfg.checkpoint.load} is a {state['foreign']}: random "
                    f"streams start from --seed")
    elif "layout_change" not in state:
        # tools/convert_checkpoint.py writes weights only: dropout restarts from --seed
        warn_rank_0(f"checkpoint in {cfg.checkpoint.load} has no RNG state (a converted, "
                    f"weights-only checkpoint); random streams start from --seed")


def load_checkpoint(backend: Any, cfg: RunConfig, train_state: Any) -> int:
    """Resume from ``--load`` if it holds a checkpoint (collective). Returns the iteration.

    A missing tracker starts from scratch: one line when ``--load`` is ``--save`` (the run
    scripts' automatic resume: a first run), a warning otherwise; a ``--load`` folder that does not exist was
    already refused by validation unless the run asked for it (``--load-if-exists``, or
    ``--load`` = ``--save``). An incompatible or incomplete checkpoint raises
    :class:`CheckpointError` on every rank. Every file read is verified against the
    checkpoint's manifest first (unless ``--no-verify-checkpoint``); a damaged checkpoint is
    replaced by the newest older one that verifies when ``--load`` is ``--save``, and raises
    :class:`~megatron.common.errors.CheckpointDigestError` on every rank otherwise
    (:mod:`.checkpoint_integrity`). A folder in one of the model family's foreign formats
    (``foreign_checkpoints``: Megatron-LM's for GPT-2) is loaded weights-first through it
    (:func:`_load_foreign`), unverified (it has no manifest), and the log says so.
    """
    ckpt = cfg.checkpoint
    if not ckpt.load:
        return 0
    load_optim = not ckpt.no_load_optim and not ckpt.finetune
    foreign, iteration = _agreed_contents(cfg)
    if foreign is None and iteration is None:
        if ckpt.save and os.path.abspath(ckpt.save) == os.path.abspath(ckpt.load):
            # the run scripts' automatic resume (--load = --save): a first run is normal
            print_rank_0(f"> new run: no checkpoint in {ckpt.load} yet")
        else:
            warn_rank_0(f"no checkpoint in {ckpt.load} ({TRACKER_FILENAME} is missing); "
                        f"starting from scratch")
        return 0
    if foreign is not None:
        state = _agreed_load(cfg, _load_foreign, foreign, backend, cfg, load_optim,
                             verified=False)[0]
        iteration, load_optim = state["iteration"], False
    else:
        state, iteration = _load_verified(backend, cfg, iteration, load_optim)
    if not load_optim:
        backend.state_io.after_weights_only_load()
    if ckpt.finetune:
        print_rank_0(f"> loaded weights from {ckpt.load} (iteration {iteration}) to fine-tune")
        return 0
    if "lr_scheduler" in state:
        resume_schedule(backend.lr_scheduler, state, cfg)
    _restore_rng(cfg, state)
    train_state.consumed_train_samples = state.get("consumed_train_samples", 0)
    train_state.consumed_valid_samples = state.get("consumed_valid_samples", 0)
    print_rank_0(f"> loaded checkpoint from {ckpt.load} at iteration {iteration}")
    return state["iteration"]

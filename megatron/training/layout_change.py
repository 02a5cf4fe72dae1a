"""Resume a checkpoint at another (tp, pp) layout, with its optimizer state (issue 14).

``--load`` of a checkpoint saved at (tp, pp, dp) into a run at (tp', pp', dp') with another
tp or pp comes here (:func:`saved_layout_differs` decides; a change of dp alone needs none of
this: the DDP backend's optimizer state is replicated across dp, and a DeepSpeed ZeRO
engine re-partitions its own, see ``EngineBackend.load_optimizer_files``).

Every rank reads the whole checkpoint: the (tp, pp) main files and, for a run saved by a
DeepSpeed engine, each (tp, pp)'s data-parallel rank 0 optimizer file. The weights and each
Adam moment (``exp_avg``, ``exp_avg_sq``, keyed like the weights through the parameter names
the checkpoint records) are merged into whole-model tensors with the conversion tools' key
tables (:func:`~megatron.checkpoint_conversion.native_reader.merge_layout`), their vocabulary
rows re-padded for tp' (new padding rows are zero, and masked out of the logits), and this
rank keeps its slice (:func:`~megatron.checkpoint_conversion.native_writer.stage_state`).
The step count, the param groups' hyper-parameters, the fp16 loss scaler (DDP backend), the
LR schedule and the data position carry over unchanged; random streams restart from
``--seed`` (each layout draws dropout masks differently anyway).

Cost: each rank holds the whole model and its two moments in CPU memory once while loading.

What cannot move this way: optimizer state that DeepSpeed partitions into flat buffers
(ZeRO stages 1-2, its fp16/bf16 optimizers) has no per-parameter layout to re-slice; such a
checkpoint resumes at its own tp and pp (any dp), or moves with ``--no-load-optim``.
"""
import os

import torch

from .. import mpu
from ..errors import CheckpointError
from ..utils import warn_rank_0
from .backend import uses_pipeline_engine
from .checkpointing import LAYOUT_KEYS, check_compatible, optimizer_shard_name

_MOMENTS = ("exp_avg", "exp_avg_sq")
_HINT = ("resume at the saved layout, or pass --no-load-optim to move the weights, LR "
         "schedule and data position without the optimizer state")


def _rank_states(root, iteration):
    """``{(tp, pp): main file state}`` of the checkpoint, with its saved args and folder."""
    from ..checkpoint_conversion.native_reader import (_check_layout, iteration_dir,
                                                       load_rank_file, rank_files)

    folder = iteration_dir(root, iteration)
    files = rank_files(folder)
    if (0, 0) not in files:
        raise CheckpointError(f"checkpoint {folder} has no mp_rank_00_000 (or mp_rank_00) file")
    states = {(0, 0): load_rank_file(files[(0, 0)])}
    saved = dict(states[(0, 0)].get("args") or {})
    tp, pp = saved["tensor_model_parallel_size"], saved.get("pipeline_model_parallel_size", 1)
    _check_layout(files, tp, pp, folder)
    for key in files:
        if key not in states:
            states[key] = load_rank_file(files[key])
    return states, saved, folder


def saved_layout_differs(root, iteration, args):
    """Whether the checkpoint's (tp, pp) differs from the run's (reads one file's args)."""
    from ..checkpoint_conversion.native_reader import iteration_dir, rank_files

    files = rank_files(iteration_dir(root, iteration))
    if (0, 0) not in files:
        return False  # the normal path reports the missing file
    try:
        saved = torch.load(files[(0, 0)], map_location="cpu", weights_only=True,
                           mmap=True).get("args", {})
    except Exception:
        return False  # the normal path reports the unreadable file
    return any(k in saved and saved[k] != args.get(k) for k in LAYOUT_KEYS[:2])


def _saved_adam(state, root, iteration, tp_rank, pp_rank):
    """``(torch optimizer state dict, parameter names, loss scaler state)`` of one (tp, pp)."""
    names = state.get("optimizer_param_names")
    if "optimizer" in state:  # DDP backend: MegatronOptimizer's {"optimizer", "grad_scaler"}
        adam, scaler = state["optimizer"]["optimizer"], state["optimizer"].get("grad_scaler")
    else:  # engine backend: per-data-parallel-rank files; rank 0's is as good as any
        from .backend_engine import load_engine_optimizer_file

        path = optimizer_shard_name(root, iteration, tp_rank, pp_rank, 0)
        if not os.path.isfile(path):
            raise CheckpointError(f"checkpoint in {root} has no optimizer state ({path} is "
                                  f"missing); pass --no-load-optim to load the weights only")
        adam, scaler = load_engine_optimizer_file(path), None
        if not {"state", "param_groups"} <= set(adam):
            raise CheckpointError(
                f"checkpoint in {root} holds DeepSpeed-partitioned optimizer state (ZeRO, or "
                f"DeepSpeed's fp16/bf16 optimizer), which cannot be re-sliced for another "
                f"tensor- or pipeline-parallel size; {_HINT}")
    if names is None:
        raise CheckpointError(f"checkpoint in {root} does not record its optimizer's parameter "
                              f"names (saved by an older megatron-tds); {_HINT}")
    return adam, names, scaler


def _full_moments(states, saved, folder, keys, root, iteration):
    """Whole-model Adam moments ``{moment: {key: tensor}}``, the step, groups and scaler."""
    from ..checkpoint_conversion.native_reader import merge_layout
    from ..checkpoint_conversion.optimizer_reshard import named_adam_state

    named, groups, scaler = {}, None, None
    for (tp_rank, pp_rank), state in states.items():
        adam, names, rank_scaler = _saved_adam(state, root, iteration, tp_rank, pp_rank)
        named[(tp_rank, pp_rank)], rank_groups = named_adam_state(adam, names)
        if (tp_rank, pp_rank) == (0, 0):
            groups, scaler = rank_groups, rank_scaler
    first = next(iter(named[(0, 0)].values()), None)
    if first is None:
        raise CheckpointError(f"checkpoint in {root} has an empty optimizer state (saved "
                              f"before the first step?); {_HINT}")
    moments = {m: merge_layout(keys, saved, lambda t, p, m=m: {k: v[m] for k, v in
                                                                named[(t, p)].items()},
                               f"{folder} ({m})")
               for m in _MOMENTS}
    return moments, first["step"], groups, scaler


def _target_args(saved, args):
    """The saved args with this run's layout and padded vocabulary."""
    from ..checkpoint_conversion.native_writer import check_layout, layout_args

    target = layout_args(saved, args.parallel.tp, args.parallel.pp)
    target["padded_vocab_size"] = args.padded_vocab_size
    check_layout(target, args.parallel.tp, args.parallel.pp)
    return target


def _this_rank(full, target, keys, true_vocab):
    """This rank's slice of whole-model tensors, re-padded for its vocabulary size."""
    from ..checkpoint_conversion.native_writer import stage_state
    from ..checkpoint_conversion.vocab_padding import repad_vocab_rows

    full = repad_vocab_rows(full, true_vocab, target["padded_vocab_size"], keys.VOCAB_KEYS)
    pp = target["pipeline_model_parallel_size"]
    bounds = keys.stage_bounds(target, pp)[mpu.get_pipeline_model_parallel_rank()] \
        if uses_pipeline_engine(pp) else None
    return stage_state(full, target, mpu.get_tensor_model_parallel_rank(), bounds)


def _load_optimizer(backend, moments, step, groups, scaler, target, keys, true_vocab):
    from ..checkpoint_conversion.optimizer_reshard import adam_state_dict, param_names

    adam = backend.named_optimizer()
    if adam is None:
        raise CheckpointError(
            f"this run's {backend.name} optimizer keeps DeepSpeed-partitioned state (ZeRO, or "
            f"DeepSpeed's fp16/bf16 optimizer), which cannot take Adam moments from another "
            f"tensor- or pipeline-parallel layout; {_HINT}")
    own = {m: _this_rank(moments[m], target, keys, true_vocab) for m in _MOMENTS}
    names = param_names(backend.module(), adam)
    missing = [n for n in names if n not in own[_MOMENTS[0]]]
    if missing:
        raise CheckpointError(f"the checkpoint has no Adam moments for {missing[:3]}")
    named = {n: {"step": step.clone() if torch.is_tensor(step) else step,
                 **{m: own[m][n] for m in _MOMENTS}} for n in names}
    adam.load_state_dict(adam_state_dict(named, groups, names,
                                         adam.state_dict()["param_groups"]))
    backend.load_scaler_state(scaler)


def load_at_new_layout(backend, args, iteration, load_optim):
    """Load ``args.load`` at ``iteration`` into this run's layout (every rank; no collectives).

    Loads the weights and, with ``load_optim``, the optimizer into ``backend``; returns the
    (0, 0) file's state (iteration, LR schedule, consumed samples, engine counters) for the
    caller to restore the rest, without RNG states.

    Raises:
        CheckpointError: another model, an incomplete checkpoint, or optimizer state that
            cannot move (see the module docstring).
    """
    from ..checkpoint_conversion.native_reader import check_complete, family_of, key_map, \
        merge_layout
    from ..checkpoint_conversion.vocab_padding import resolve_true_vocab_size

    states, saved, folder = _rank_states(args.load, iteration)
    check_compatible(saved, args, folder, ignore=LAYOUT_KEYS)
    true_vocab = resolve_true_vocab_size(saved, args.get("true_vocab_size"))
    if saved.get("true_vocab_size") and args.get("true_vocab_size") and \
            saved["true_vocab_size"] != args.get("true_vocab_size"):
        raise CheckpointError(f"checkpoint {folder} has {saved['true_vocab_size']} vocabulary "
                              f"entries, this run's tokenizer {args.get('true_vocab_size')}")
    keys = key_map(family_of(saved))
    target = _target_args(saved, args)
    weights = check_complete(keys, merge_layout(keys, saved, lambda t, p: states[(t, p)]
                                                .get("model", {}), folder), saved, folder)
    optimizer = _full_moments(states, saved, folder, keys, args.load, iteration) \
        if load_optim else None
    backend.module().load_state_dict(_this_rank(weights, target, keys, true_vocab))
    if optimizer is not None:
        _load_optimizer(backend, *optimizer, target, keys, true_vocab)
    first = dict(states[(0, 0)])
    first.pop("rng_state", None)
    warn_rank_0(
        f"resuming {folder} (tp={saved['tensor_model_parallel_size']}, "
        f"pp={saved.get('pipeline_model_parallel_size', 1)}) at tp={args.parallel.tp}, "
        f"pp={args.parallel.pp}: weights{', Adam state' if load_optim else ''}, LR schedule "
        f"and data position carried over; random streams restart from --seed")
    return first

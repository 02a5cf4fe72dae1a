"""Resume a checkpoint at another (tp, pp) layout, with its optimizer state (issue 14).

``--load`` of a checkpoint saved at (tp, pp, dp) into a run at (tp', pp', dp') with another
tp or pp comes here (:func:`saved_layout_differs` decides; a change of dp alone needs none of
this: the DDP backend's optimizer state is replicated across dp, and a DeepSpeed ZeRO
engine re-partitions its own, see ``EngineBackend.load_optimizer_files``).

Every rank reads the whole checkpoint: the (tp, pp) main files and, for a run saved by a
DeepSpeed engine, each (tp, pp)'s optimizer files. The weights and the optimizer state are
merged into whole-model tensors with the conversion tools' key tables
(:func:`~megatron.checkpoint_conversion.native_reader.merge_layout`), their vocabulary rows
re-padded for tp' (new padding rows are zero, and masked out of the logits), and this rank
keeps its slice (:func:`~megatron.checkpoint_conversion.native_writer.stage_state`). The
optimizer state is keyed like the weights: by the parameter names each checkpoint records
for our AdamW (DDP backend, or an fp32 engine without ZeRO), and by DeepSpeed's own
``param_slice_mappings`` for ZeRO-1/2 partitions (:mod:`.zero_state`, fp32 master weights
included). The step count, the param groups' hyper-parameters, the LR schedule, the data
position and the fp16 loss scaler (between runs of the same backend) carry over; random
streams restart from ``--seed`` (each layout draws dropout masks differently anyway).

Cost: each rank holds the whole model and its optimizer state in CPU memory once while
loading.

What cannot move this way: DeepSpeed's fp16/bf16 optimizers without ZeRO (flat buffers with
no recorded per-parameter layout); such a checkpoint resumes at its own layout, or moves
with ``--no-load-optim``.
"""

import torch

from .. import mpu
from ..errors import CheckpointError
from ..utils import warn_rank_0
from .backend import uses_pipeline_engine
from .checkpointing import LAYOUT_KEYS, check_compatible, saved_optimizer_files

_MOMENTS = ("exp_avg", "exp_avg_sq")
_HINT = ("resume at the saved layout, or pass --no-load-optim to move the weights, LR "
         "schedule and data position without the optimizer state")


def _rank_states(root, iteration):
    """``{(tp, pp): main file state}`` of the checkpoint, with its saved args and folder."""
    from ..checkpoint_conversion.native_reader import (check_rank_layout, iteration_dir,
                                                       load_rank_file, rank_files)

    folder = iteration_dir(root, iteration)
    files = rank_files(folder)
    if (0, 0) not in files:
        raise CheckpointError(f"checkpoint {folder} has no mp_rank_00_000 (or mp_rank_00) file")
    states = {(0, 0): load_rank_file(files[(0, 0)])}
    saved = dict(states[(0, 0)].get("args") or {})
    tp, pp = saved["tensor_model_parallel_size"], saved.get("pipeline_model_parallel_size", 1)
    check_rank_layout(files, tp, pp, folder)
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


def _named_state(state, root, iteration, tp_rank, pp_rank):
    """One (tp, pp)'s optimizer state by parameter name.

    Returns:
        ``({name: {"exp_avg", "exp_avg_sq", "step"[, "fp32"]}}, param groups or None,
        loss scaler or None)``; ``fp32`` (the master weight) only from ZeRO, whose model
        weights may be fp16.
    """
    from ..checkpoint_conversion.optimizer_reshard import named_adam_state
    from .backend_engine import load_engine_optimizer_file
    from .zero_state import is_zero_state, named_from_saved

    names = state.get("optimizer_param_names")
    unnamed = CheckpointError(f"checkpoint in {root} does not record its optimizer's "
                              f"parameter names (saved by an older megatron-tds); {_HINT}")
    if "optimizer" in state:  # DDP backend: MegatronOptimizer's {"optimizer", "grad_scaler"}
        if names is None:
            raise unnamed
        named, groups = named_adam_state(state["optimizer"]["optimizer"], names)
        return named, groups, {"ddp": state["optimizer"].get("grad_scaler")}
    paths = saved_optimizer_files(root, iteration, tp_rank, pp_rank)
    first = load_engine_optimizer_file(paths[0])
    if is_zero_state(first):  # each dp rank holds a partition: all of them
        shards = [first] + [load_engine_optimizer_file(p) for p in paths[1:]]
        shapes = {k: v.shape for k, v in state["model"].items()}
        named, step = named_from_saved(shards, shapes, paths[0])
        for entry in named.values():
            entry["step"] = step
        return named, None, {"deepspeed": first.get("loss_scaler")}
    if {"state", "param_groups"} <= set(first):  # our AdamW, replicated on every dp rank
        if names is None:
            raise unnamed
        named, groups = named_adam_state(first, names)
        return named, groups, None
    raise CheckpointError(f"checkpoint in {root} holds the state of DeepSpeed's fp16/bf16 "
                          f"optimizer without ZeRO, which cannot be re-sliced for another "
                          f"tensor- or pipeline-parallel size; {_HINT}")


def _full_moments(states, saved, folder, keys, root, iteration):
    """Whole-model optimizer tensors ``{"exp_avg"|"exp_avg_sq"[|"fp32"]: {key: tensor}}``,
    the step, the param groups (or None) and the loss scaler (or None)."""
    from ..checkpoint_conversion.native_reader import merge_layout

    named, groups, scaler = {}, None, None
    for (tp_rank, pp_rank), state in states.items():
        named[(tp_rank, pp_rank)], rank_groups, rank_scaler = \
            _named_state(state, root, iteration, tp_rank, pp_rank)
        if (tp_rank, pp_rank) == (0, 0):
            groups, scaler = rank_groups, rank_scaler
    first = next(iter(named[(0, 0)].values()), None)
    if first is None:
        raise CheckpointError(f"checkpoint in {root} has an empty optimizer state (saved "
                              f"before the first step?); {_HINT}")
    kinds = [k for k in ("exp_avg", "exp_avg_sq", "fp32")
             if all(k in e for n in named.values() for e in n.values())]
    moments = {m: merge_layout(keys, saved, lambda t, p, m=m: {k: v[m] for k, v in
                                                                named[(t, p)].items()},
                               f"{folder} ({m})")
               for m in kinds}
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


def _load_optimizer(backend, own_weights, moments, step, groups, scaler, slice_of):
    """Give this rank's slice of the optimizer state to the backend's optimizer."""
    from ..checkpoint_conversion.optimizer_reshard import adam_state_dict

    own = {m: slice_of(moments[m]) for m in moments}
    own.setdefault("fp32", {k: v.float() for k, v in own_weights.items()})  # fp32 sources
    names = [n for n, _ in backend.module().named_parameters()]
    missing = [n for n in names if n not in own["exp_avg"]]
    if missing:
        raise CheckpointError(f"the checkpoint has no optimizer state for {missing[:3]}")
    adam = backend.named_optimizer()
    if adam is None:  # DeepSpeed's ZeRO: through each parameter's slice of its partitions
        backend.load_named_optimizer({n: {k: own[k][n] for k in own} for n in names}, step)
    else:
        from ..checkpoint_conversion.optimizer_reshard import param_names

        order = param_names(backend.module(), adam)
        named = {n: {"step": step.clone() if torch.is_tensor(step) else step,
                     **{m: own[m][n] for m in _MOMENTS}} for n in order}
        template = adam.state_dict()["param_groups"]
        adam.load_state_dict(adam_state_dict(named, groups or template, order, template))
    if scaler and not backend.load_scaler_state(scaler):
        warn_rank_0("the fp16 loss scale restarts from --initial-loss-scale (the checkpoint "
                    "was saved by the other training backend)")


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
    if optimizer is not None and "fp32" in optimizer[0]:
        weights.update(optimizer[0]["fp32"])  # ZeRO's fp32 masters: exact, where weights are fp16

    def slice_of(full):
        return _this_rank(full, target, keys, true_vocab)

    own_weights = slice_of(weights)
    backend.module().load_state_dict(own_weights)
    if optimizer is not None:
        _load_optimizer(backend, own_weights, *optimizer, slice_of)
    first = dict(states[(0, 0)])
    first.pop("rng_state", None)
    warn_rank_0(
        f"resuming {folder} (tp={saved['tensor_model_parallel_size']}, "
        f"pp={saved.get('pipeline_model_parallel_size', 1)}) at tp={args.parallel.tp}, "
        f"pp={args.parallel.pp}: weights{', Adam state' if load_optim else ''}, LR schedule "
        f"and data position carried over; random streams restart from --seed")
    return first

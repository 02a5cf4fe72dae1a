"""Read a checkpoint for a rank of another (tp, pp) layout, with its optimizer state.

A checkpoint saved at (tp, pp, dp) that a run at (tp', pp', dp') loads with another tp or pp
comes here (:func:`saved_layout_differs` decides; a change of dp alone needs none of this:
DDP optimizer state is replicated across dp, and a DeepSpeed ZeRO engine re-partitions its
own).

Every rank reads the whole checkpoint: the (tp, pp) main files and, for a run saved by a
DeepSpeed engine or the distributed optimizer, each (tp, pp)'s optimizer files. A checkpoint
saved at expert-parallel size ep > 1 (one folder per ep rank) is put together first as if
saved at ep 1 (:mod:`.expert_state`), and a change of ep alone comes here too; the run's ep
rank keeps its experts. The weights and the optimizer state are
merged into whole-model tensors with the model's key map (:func:`.native_reader.merge_layout`),
their vocabulary rows re-padded for tp' (new padding rows are zero, and masked out of the
logits), and this rank keeps its slice (:func:`.native_writer.stage_state`). The optimizer
state is keyed like the weights: by the parameter names each checkpoint records for our
AdamW (DDP backend, or an fp32 engine without ZeRO), and by DeepSpeed's own
``param_slice_mappings`` for ZeRO-1/2 partitions (:mod:`.zero_state`, fp32 master weights
included). The result is data (:class:`RankState`); the training package gives it to the
run's optimizer.

Cost: each rank holds the whole model and its optimizer state in CPU memory once while
loading.

What cannot move this way: DeepSpeed's fp16/bf16 optimizers without ZeRO (flat buffers with
no recorded per-parameter layout); such a checkpoint resumes at its own layout, or moves
with ``--no-load-optim``.
"""
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch

from .. import mpu
from ..common.errors import CheckpointError
from ..config.run_config import RunConfig
from .expert_state import collapse_named, distributed_named, read_ep_states
from .format import (EP_KEY, LAYOUT_KEYS, check_compatible, check_rank_layout, ep_rank_files,
                     iteration_dir, load_rank_file, saved_ep, saved_optimizer_files,
                     uses_pipeline_engine)
from .chunks import placement_of, vpp_of
from .key_maps import key_map_for
from .native_reader import check_complete, merge_layout
from .native_writer import check_layout, layout_args, stage_state
from .optimizer_names import MOMENTS, named_adam_state
from .sharding import experts_of, has_records, merge_recorded, slice_recorded
from .structural_match import FIX, match_names, pipeline_order, signature
from .vocab_padding import repad_vocab_rows, resolve_true_vocab_size
from .zero_state import is_zero_state, load_engine_optimizer_file, named_from_saved

HINT = ("resume at the saved layout, or pass --no-load-optim to move the weights, LR "
        "schedule and data position without the optimizer state")


@dataclass
class NamedOptimizerState:
    """This rank's slice of a checkpoint's Adam state, by parameter name.

    Attributes:
        named: ``{name: {"exp_avg", "exp_avg_sq", "fp32"}}``; ``fp32`` is the master weight
            (ZeRO's, else the fp32 weight itself).
        step: the optimizer step count.
        groups: the saved param groups' hyper-parameters, or None (ZeRO records none).
        scaler: ``{"ddp": ...}`` or ``{"deepspeed": ...}`` fp16 loss-scaler state, or None.
    """

    named: Dict[str, Dict[str, torch.Tensor]]
    step: Any
    groups: Optional[List[dict]]
    scaler: Optional[dict]


@dataclass
class RankState:
    """What a rank of the new layout loads.

    Attributes:
        model: this rank's model state dict.
        optimizer: its optimizer state, or None when not asked for.
        first: the saved (tp 0, pp 0) file's state (iteration, LR schedule, consumed
            samples, engine counters), without RNG states.
        description: the saved layout, for messages.
    """

    model: Dict[str, torch.Tensor]
    optimizer: Optional[NamedOptimizerState]
    first: dict
    description: str


def _rank_states(root, iteration):
    """``{(tp, pp): main file state}`` of the checkpoint (at ep > 1 with every ep rank's
    experts in its model: :mod:`.expert_state`), ``{(tp, pp): {ep_rank: state}}`` as saved,
    its saved args and folder."""
    folder = iteration_dir(root, iteration)
    files = ep_rank_files(folder)
    if (0, 0, 0) not in files:
        raise CheckpointError(f"checkpoint {folder} has no mp_rank_00_000 (or mp_rank_00, "
                              f"mp_rank_00_000_000) file")
    first = load_rank_file(files[(0, 0, 0)])
    saved = dict(first.get("args") or {})
    tp, pp = saved["tensor_model_parallel_size"], saved.get("pipeline_model_parallel_size", 1)
    check_rank_layout(files, tp, pp, folder, ep=saved_ep(first))
    states, by_ep = read_ep_states(files, {(0, 0, 0): first})
    return states, by_ep, saved, folder


def saved_layout_differs(root: str, iteration: int, cfg: RunConfig) -> bool:
    """Whether the checkpoint's (tp, pp, v, placement) differs from the run's (reads one
    file's args; v: chunks per pipeline rank, 1 for checkpoints that do not record it; the
    placement: ZB-V's V or the loop of every other schedule)."""
    files = ep_rank_files(iteration_dir(root, iteration))
    if (0, 0, 0) not in files:
        return False  # the normal path reports the missing file
    try:
        saved = torch.load(files[(0, 0, 0)], map_location="cpu", weights_only=True,
                           mmap=True).get("args", {})
    except Exception:
        return False  # the normal path reports the unreadable file
    if uses_pipeline_engine(saved.get(LAYOUT_KEYS[1], 1)) and \
            (vpp_of(saved), placement_of(saved)) != \
            (cfg.parallel.vpp, placement_of({"pipeline_schedule": cfg.parallel.pipeline_schedule})):
        return True  # the same pp, other chunks on each rank
    if int(saved.get(EP_KEY) or 1) != int(cfg.get(EP_KEY) or 1):
        return True  # other experts on each rank
    return any(k in saved and saved[k] != cfg.get(k) for k in LAYOUT_KEYS[:2])


def named_optimizer_state(state, root, iteration, tp_rank, pp_rank, default_names=None,
                          ep_rank=0):
    """One (tp, pp)'s optimizer state by parameter name, whatever wrote it.

    Args:
        state: that (tp, pp)'s main file (its ``model``, ``optimizer`` or
            ``optimizer_param_names``).
        root, iteration: the checkpoint (where its ``optim_dp_rank_*`` files lie).
        tp_rank, pp_rank: which rank folder.
        default_names: the parameter names of the optimizer's positions where the
            checkpoint records none (releases before the record); only a resume at the
            saved layout, whose optimizer orders its parameters as the saved one did, may
            pass them.
        ep_rank: which ep rank's folder ``state`` is of (a checkpoint saved at ep > 1).

    Returns:
        ``({name: {"exp_avg", "exp_avg_sq", "step"[, "fp32"]}}, param groups or None,
        loss scaler or None)``; ``fp32`` (the master weight) only from ZeRO, whose model
        weights may be fp16.
    """
    names = state.get("optimizer_param_names") or default_names
    unnamed = CheckpointError(f"checkpoint in {root} does not record its optimizer's "
                              f"parameter names (saved by an older megatron-tds); {HINT}")
    if "optimizer" in state:  # replicated: MegatronOptimizer's {"optimizer", "grad_scaler"}
        if names is None:
            raise unnamed
        named, groups = named_adam_state(state["optimizer"]["optimizer"], names)
        return named, groups, {"ddp": state["optimizer"].get("grad_scaler")}
    if saved_ep(state) > 1:  # the dense slices in every ep folder, the experts in their own
        return distributed_named({ep_rank: state}, root, iteration, tp_rank, pp_rank,
                                 named_from_slices)[ep_rank]
    paths = saved_optimizer_files(root, iteration, tp_rank, pp_rank)
    first = load_engine_optimizer_file(paths[0])
    shards = [first] + [load_engine_optimizer_file(p) for p in paths[1:]]
    shapes = {k: v.shape for k, v in state["model"].items()}
    if "distributed_optimizer" in first:  # each dp rank holds slices of the parameters
        named, groups = named_from_slices(shards, shapes, paths[0])
        return named, groups, {"ddp": first.get("grad_scaler")}
    if is_zero_state(first):  # DeepSpeed's ZeRO: each dp rank holds a partition
        named, step = named_from_saved(shards, shapes, paths[0])
        for entry in named.values():
            entry["step"] = step
        return named, None, {"deepspeed": first.get("loss_scaler")}
    if {"state", "param_groups"} <= set(first):  # AdamW stepped by DeepSpeed's engine
        if names is None:
            raise unnamed
        named, groups = named_adam_state(first, names)
        return named, groups, None
    raise CheckpointError(f"checkpoint in {root} holds the state of DeepSpeed's fp16/bf16 "
                          f"optimizer without ZeRO, which has no per-parameter layout to "
                          f"read; {HINT}")


def named_from_slices(shards, shapes, where, keep=None):
    """Every data-parallel rank's distributed-optimizer state (rank order) -> named state.

    Each file holds the torch optimizer's state of its slices and, per state position, the
    slice's ``(parameter name, offset, length)``; a parameter's slices are put back in
    offset order. ``keep(name)``, when given, picks the parameters to read (an
    expert-parallel checkpoint's dense and expert slices lie in different sets of files:
    :mod:`.expert_state`).

    Returns:
        ``({name: {"exp_avg", "exp_avg_sq", "step"}}, param groups)``.
    """
    pieces = {}
    for shard in shards:
        torch_state = shard["optimizer"]
        positions = [i for g in torch_state["param_groups"] for i in g["params"]]
        for pos, (name, offset, numel) in zip(positions, shard["pieces"]):
            if keep is not None and not keep(name):
                continue
            moments = torch_state["state"].get(pos)
            if moments is None:
                raise CheckpointError(f"{where}: the distributed optimizer's state has no "
                                      f"moments (saved before the first step?)")
            pieces.setdefault(name, []).append((offset, numel, moments))
    named = {}
    for name, parts in pieces.items():
        if name not in shapes:
            raise CheckpointError(f"{where}: optimizer state names {name}, which the model "
                                  f"lacks")
        parts.sort(key=lambda part: part[0])
        if sum(n for _, n, _ in parts) != shapes[name].numel():
            raise CheckpointError(f"{where}: the slices of {name} cover "
                                  f"{sum(n for _, n, _ in parts)} of its "
                                  f"{shapes[name].numel()} elements (a data-parallel rank's "
                                  f"file is missing or from another run)")
        named[name] = {k: torch.cat([m[k].reshape(-1) for _, _, m in parts]).view(shapes[name])
                       for k in MOMENTS}
        named[name]["step"] = parts[0][2]["step"]
    groups = [{k: v for k, v in g.items() if k != "params"}
              for g in shards[0]["optimizer"]["param_groups"]]
    return named, groups


def _named_of(by_ep, root, iteration, tp_rank, pp_rank):
    """One (tp, pp)'s optimizer state by name (every ep rank's experts at ep > 1)."""
    if len(by_ep) == 1:
        return named_optimizer_state(by_ep[0], root, iteration, tp_rank, pp_rank)
    record = by_ep[0].get("sharding") or {}
    if "optimizer" in by_ep[0]:  # replicated: each ep rank's main file holds its own
        found = {e: named_optimizer_state(s, root, iteration, tp_rank, pp_rank, ep_rank=e)
                 for e, s in by_ep.items()}
    else:
        found = distributed_named(by_ep, root, iteration, tp_rank, pp_rank, named_from_slices)
    named, groups, scaler = {e: f[0] for e, f in found.items()}, found[0][1], found[0][2]
    where = f"{iteration_dir(root, iteration)} (tp {tp_rank}, pp {pp_rank})"
    return collapse_named(named, record, where), groups, scaler


def _full_moments(states, saved, folder, merge, root, iteration):
    """Whole-model optimizer tensors ``{"exp_avg"|"exp_avg_sq"[|"fp32"]: {key: tensor}}``,
    the step, the param groups (or None) and the loss scaler (or None); ``states``:
    ``{(tp, pp): {ep_rank: main file state}}``."""
    named, groups, scaler = {}, None, None
    for (tp_rank, pp_rank), by_ep in states.items():
        named[(tp_rank, pp_rank)], rank_groups, rank_scaler = \
            _named_of(by_ep, root, iteration, tp_rank, pp_rank)
        if (tp_rank, pp_rank) == (0, 0):
            groups, scaler = rank_groups, rank_scaler
    first = next(iter(named[(0, 0)].values()), None)
    if first is None:
        raise CheckpointError(f"checkpoint in {root} has an empty optimizer state (saved "
                              f"before the first step?); {HINT}")
    kinds = [k for k in ("exp_avg", "exp_avg_sq", "fp32")
             if all(k in e for n in named.values() for e in n.values())]
    moments = {m: merge(lambda t, p, m=m: {k: v[m] for k, v in named[(t, p)].items()},
                        f"{folder} ({m})")
               for m in kinds}
    return moments, first["step"], groups, scaler


def _target_args(saved, cfg, keys):
    """The saved args with this run's layout and padded vocabulary."""
    target = layout_args(saved, cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.vpp,
                         cfg.parallel.pipeline_schedule)
    target["padded_vocab_size"] = cfg.model.padded_vocab_size
    check_layout(target, cfg.parallel.tp, cfg.parallel.pp, keys=keys)
    return target


def _this_rank(full, target, keys, true_vocab):
    """This rank's slice of whole-model tensors, re-padded for its vocabulary size."""
    full = repad_vocab_rows(full, true_vocab, target["padded_vocab_size"], keys.VOCAB_KEYS)
    pp = target["pipeline_model_parallel_size"]
    bounds = keys.stage_bounds(target, pp)[mpu.get_pipeline_model_parallel_rank()] \
        if uses_pipeline_engine(pp) else None
    return stage_state(full, target, mpu.get_tensor_model_parallel_rank(), bounds, keys)


def _check_vocab(saved, cfg, folder):
    run_vocab = cfg.model.true_vocab_size
    if saved.get("true_vocab_size") and run_vocab and saved["true_vocab_size"] != run_vocab:
        raise CheckpointError(f"checkpoint {folder} has {saved['true_vocab_size']} vocabulary "
                              f"entries, this run's tokenizer {run_vocab}")


def weights_for_run(full: Any, cfg: RunConfig, where: str) -> Dict[str, torch.Tensor]:
    """This rank's model state dict of a whole model (a :class:`~.native_reader.FullCheckpoint`
    read from any format) for the run's layout and padded vocabulary.

    Raises:
        CheckpointError: the model's sizes differ from the run's flags, or the vocabulary
            must be re-padded and its real size is unknown.
    """
    check_compatible(full.args, cfg, where, ignore=LAYOUT_KEYS)
    _check_vocab(full.args, cfg, where)
    true_vocab = resolve_true_vocab_size(full.args, cfg.model.true_vocab_size)
    keys = key_map_for(full.args, cfg.model_family)
    return _this_rank(full.state, _target_args(full.args, cfg, keys), keys, true_vocab)


def _uses_record(states, cfg, own, folder, own_layout=None):
    """Whether to move this checkpoint by its sharding record (:mod:`.sharding`), and how
    its names become the run's model's: ``(True, None)`` when the saved names include every
    tensor of the run's model; ``(True, {saved: own})`` for a family without a key map
    whose serial model names its tensors unlike its pipeline (the same family's checkpoint,
    matched by structure: :mod:`.structural_match`); ``(False, None)``: GPT-2's and T5's
    serial and pipeline models name their tensors differently, so between pp = 1 and pp > 1
    (and for checkpoints written before the record) their key maps translate."""
    if own is None or not has_records(states.values()):
        return False, None
    saved = set().union(*(s["sharding"] for s in states.values()))
    if set(own) <= saved:
        return True, None
    family = cfg.model_family
    if family is None or family.keys is not None:
        return False, None
    if states[(0, 0)].get("family") == cfg.family:  # this family, saved at another pp
        return True, _structural_names(states, cfg, own, folder, own_layout or {})
    missing = sorted(set(own) - saved)
    raise CheckpointError(f"checkpoint {folder} has no "
                          f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}"
                          f": it was saved by another model (the {family.name!r} family "
                          f"has no key map to translate names)")


def _structural_names(states, cfg, own, folder, own_layout):
    """``{saved name: own name}``: the checkpoint's pipeline names matched to the run's
    serial model by structure (:func:`.structural_match.match_names`)."""
    saved_pp = max(p for _, p in states) + 1
    if cfg.parallel.pp > 1:
        raise CheckpointError(
            f"checkpoint {folder} was saved at pp={saved_pp} by a model whose tensor names "
            f"are not this pipeline's ({', '.join(sorted(set(own))[:3])} ...): a pipeline "
            f"stage holds part of the model, which cannot be matched to a whole one by "
            f"structure; resume it at pp=1 (any tp) and save, or {FIX}")
    records, tp = {}, cfg.parallel.tp
    for state in states.values():
        for key, record in state["sharding"].items():
            records.setdefault(key, record)
    shapes, seen = {}, set()
    for (t, _), state in sorted(states.items()):
        for key, tensor in state.get("model", {}).items():
            if (t, key) in seen:  # a tied module's copy on another stage
                continue
            seen.add((t, key))
            dim = records[key][0]
            shape = shapes.setdefault(key, list(tensor.shape))
            if dim >= 0 and t > 0:
                shape[dim] += tensor.shape[dim]  # whole = the shards side by side
    classes = {}
    for state in states.values():
        classes.update(state.get("module_classes") or {})
    saved = pipeline_order({k: list(s.get("model", {})) for k, s in states.items()})
    sig_saved = {k: signature(k, shapes[k], records[k], classes.get(k)) for k in saved}
    own_classes, own_shapes = own_layout.get("classes", {}), own_layout.get("shapes", {})
    sig_own = {}
    for key, record in own.items():
        shape = list(own_shapes.get(key, []))
        if record[0] >= 0 and shape:
            shape[record[0]] *= tp
        sig_own[key] = signature(key, shape, record, own_classes.get(key) if classes else None)
    return match_names(saved, sig_saved, list(own), sig_own, f"checkpoint {folder}")


def _recorded_merge_and_slice(states, cfg, own, true_vocab, folder, renamed=None,
                              own_names=None):
    """The record-driven ``merge(getter, where)`` and ``slice_of(full, strict)``; with
    ``renamed`` (``{saved name: own name}``) the merged tensors take the run's names; with
    ``own_names`` (``{own name: whole-model name}``) too, both sides meet in whole-model
    names (:func:`_key_mapped_names`). The run's ep rank keeps its experts."""
    records = {k: s["sharding"] for k, s in states.items()}
    own_names = own_names or {k: k for k in own}
    own_named = {own_names[k]: spec for k, spec in own.items()}

    def merge(get, where):
        full = merge_recorded({k: get(*k) for k in states}, records, true_vocab, where)
        return {renamed.get(k, k): v for k, v in full.items()} if renamed else full

    def slice_of(full, strict=True):
        mine = own_named if strict else {k: v for k, v in own_named.items() if k in full}
        cut = slice_recorded(full, mine, cfg.parallel.tp, mpu.get_tensor_model_parallel_rank(),
                             cfg.model.padded_vocab_size, folder,
                             mpu.get_expert_model_parallel_world_size(),
                             mpu.get_expert_model_parallel_rank())
        return {k: cut[own_names[k]] for k in own if own_names[k] in cut}

    return merge, slice_of


def _key_mapped_names(states, cfg, own, saved, family):
    """``({saved name: whole-model name}, {own name: whole-model name})`` for a model with
    MoE layers whose family has a key map (GPT-2, T5) between pp = 1 and pp > 1: the key
    map renames (its tables know no expert tensors), the sharding record cuts; None when
    this does not apply (no MoE layer, or no record)."""
    if own is None or not has_records(states.values()):
        return None
    records = [s["sharding"] for s in states.values()] + [own]
    if not any(experts_of(spec) for record in records for spec in record.values()):
        return None
    keys = key_map_for(saved, cfg.model_family,
                       list(states[(0, 0)].get("model") or ()), family)
    layers = saved["num_layers"]

    def whole(name):
        return keys.pipe_to_full_key(name, layers) if keys.is_pipe_state({name: None}) \
            else name

    names = set().union(*(s["sharding"] for s in states.values()))
    return {k: whole(k) for k in names}, {k: whole(k) for k in own}


def _same_family(states, cfg, folder):
    """The family the checkpoint records (None: not recorded), refused if not the run's."""
    family = states[(0, 0)].get("family")
    if family and cfg.family and family != cfg.family:
        raise CheckpointError(f"checkpoint {folder} holds a {family!r} model but this run "
                              f"trains {cfg.family!r}; point --load at a {cfg.family!r} "
                              f"checkpoint")
    return family


def read_at_new_layout(root: str, iteration: int, cfg: RunConfig, load_optim: bool,
                       own: Optional[Dict[str, list]] = None,
                       own_layout: Optional[Dict[str, dict]] = None) -> "RankState":
    """This rank's part of ``root`` at ``iteration`` for the run's layout (no collectives).

    Args:
        root: the checkpoint directory (``--load``).
        iteration: the iteration to read.
        cfg: the run configuration (its layout, padded vocabulary and model settings).
        load_optim: also re-slice the optimizer state.
        own: the sharding record of this rank's model (:func:`.sharding.sharding_record`):
            with it, a checkpoint that records its sharding moves without a key map.
        own_layout: ``{"classes": .sharding.module_classes(model), "shapes": {key: shape}}``
            of this rank's model: with them, a serial model named unlike the pipeline that
            saved the checkpoint is matched by structure (:mod:`.structural_match`).

    Raises:
        CheckpointError: another model, an incomplete checkpoint, or optimizer state that
            cannot move (see the module docstring).
    """
    states, by_ep, saved, folder = _rank_states(root, iteration)
    family = _same_family(states, cfg, folder)
    check_compatible(saved, cfg, folder, ignore=LAYOUT_KEYS)
    true_vocab = resolve_true_vocab_size(saved, cfg.model.true_vocab_size)
    _check_vocab(saved, cfg, folder)
    recorded, renamed = _uses_record(states, cfg, own, folder, own_layout)
    mapped = None if recorded else _key_mapped_names(states, cfg, own, saved, family)
    if recorded or mapped:
        merge, slice_of = _recorded_merge_and_slice(states, cfg, own, true_vocab, folder,
                                                    *(mapped or (renamed,)))
        weights = merge(lambda t, p: states[(t, p)].get("model", {}), folder)
    else:
        keys = key_map_for(saved, cfg.model_family,
                           list(states[(0, 0)].get("model") or ()), family)
        target = _target_args(saved, cfg, keys)

        def merge(get, where):
            return merge_layout(keys, saved, get, where)

        def slice_of(full, strict=True):
            return _this_rank(full, target, keys, true_vocab)

        weights = check_complete(keys, merge(lambda t, p: states[(t, p)].get("model", {}),
                                             folder), saved, folder)
    moments = _full_moments(by_ep, saved, folder, merge, root, iteration) \
        if load_optim else None
    if moments is not None and "fp32" in moments[0]:
        weights.update(moments[0]["fp32"])  # ZeRO's fp32 masters: exact, where weights are fp16

    own_weights = slice_of(weights)
    optimizer = None
    if moments is not None:
        full, step, groups, scaler = moments
        sliced = {m: slice_of(full[m], strict=False) for m in full}
        sliced.setdefault("fp32", {k: v.float() for k, v in own_weights.items()})  # fp32
        named = {name: {m: sliced[m][name] for m in sliced if name in sliced[m]}
                 for name in sliced["exp_avg"]}
        optimizer = NamedOptimizerState(named, step, groups, scaler)
    first = dict(states[(0, 0)])
    first.pop("rng_state", None)
    description = (f"{folder} (tp={saved['tensor_model_parallel_size']}, "
                   f"pp={saved.get('pipeline_model_parallel_size', 1)}, v={vpp_of(saved)})")
    return RankState(own_weights, optimizer, first, description)

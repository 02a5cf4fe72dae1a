"""Read a native checkpoint of any model family and any (tp, pp) layout into one full
state dict.

The files of ``<root>/iter_N/mp_rank_{tp:02d}_{pp:03d}/model_optim_rng.pt`` are read with
``torch.load(weights_only=True)``; tensor-parallel shards are concatenated along their split
dimension, pipeline-stage keys are renamed to the whole model's, copies held by several
stages are checked to agree, and the result is checked for completeness against the model
sizes in the saved args. What differs between GPT-2 and T5 comes from the model's key map
(:mod:`.gpt2_keys`, :mod:`.t5_keys`; :func:`.key_maps.key_map_for` picks it from the saved args).
A model without a key map is merged by the sharding record its files carry (:mod:`.sharding`).
"""
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch

from ..common.errors import CheckpointError
from ..observability.progress import progress
from . import gpt2_keys
from .format import (EP_KEY, check_rank_layout, ep_rank_files, iteration_dir, load_rank_file,
                     rank_files, resolve_iteration, saved_ep)
from .key_maps import KEY_MAPS, key_map_for, key_map_named

#: Replicated tensors (LayerNorms, row-parallel biases, the tied embedding copies) must agree
#: across the ranks that hold them; they are bitwise equal after training, so a difference
#: above this means files from different runs were mixed.
REPLICA_TOLERANCE = 1e-6

#: What a weights-only conversion carries over besides the model (plain values only).
#: ``{key: tensor}``: one rank's (or the whole model's) weights.
StateDict = Dict[str, torch.Tensor]

CARRIED_KEYS = ("consumed_train_samples", "consumed_valid_samples", "lr_scheduler")


@dataclass
class FullCheckpoint:
    """A whole model in its unsplit key names (GPT2Model's, T5Model's), independent of any
    parallel layout.

    Attributes:
        state: ``{model key: full tensor}``.
        args: the saved args dict (model sizes, tokenizer, the source layout).
        iteration: the training iteration it was saved at (0 for converted HF weights).
        extras: progress carried to a converted checkpoint (:data:`CARRIED_KEYS`).
        stage_records: for a model without a key map, ``{pp_rank: sharding record}`` of
            each pipeline stage's files (:mod:`.sharding`; as read: the tp rank 0 files'):
            which tensors a stage holds and how to cut them (:mod:`.recorded_reshard`);
            None for GPT-2 and T5 (their key maps say it).
        family: the model family the files name (``"family"``), or None.
        differing_copies: keys held by several pipeline stages (a tied module) whose copies
            differ (:func:`stage_copies_differ`; recorded checkpoints only).
    """

    state: dict
    args: dict
    iteration: int = 0
    extras: dict = field(default_factory=dict)
    stage_records: Optional[Dict[int, Dict[str, list]]] = None
    family: Optional[str] = None
    differing_copies: List[str] = field(default_factory=list)


def replicas_agree(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Raise unless two copies of a replicated tensor are equal (up to REPLICA_TOLERANCE)."""
    if a.shape != b.shape or (a.float() - b.float()).abs().max().item() > REPLICA_TOLERANCE:
        raise CheckpointError(f"{what} differs between the ranks that hold it: the checkpoint "
                              f"mixes files from different runs, or tied copies drifted apart")


def merge_tensor_parallel(shards: List[StateDict], where: str,
                          split_dim: Callable[[str], Optional[int]] = gpt2_keys.tp_split_dim
                          ) -> StateDict:
    """One stage's tp shards (rank order, full-model keys) -> full tensors.

    Args:
        shards: list of state dicts, one per tensor-parallel rank.
        where: description for error messages.
        split_dim: key -> the dimension it is split on, or None when replicated (the model
            family's key table: GPT-2's by default).
    """
    keys = list(shards[0])
    for rank, shard in enumerate(shards[1:], start=1):
        if set(shard) != set(keys):
            raise CheckpointError(f"{where}: tp rank {rank} holds other tensors than tp rank 0")
    merged = {}
    for key in keys:
        dim = split_dim(key)
        if dim is None:
            for rank, shard in enumerate(shards[1:], start=1):
                replicas_agree(shards[0][key], shard[key],
                               f"{where}: replicated {key} (tp rank {rank})")
            merged[key] = shards[0][key]
        else:
            merged[key] = torch.cat([shard[key] for shard in shards], dim=dim)
    return merged


def _to_full_keys(keys, state, num_layers):
    if not keys.is_pipe_state(state):
        return dict(state)
    return {keys.pipe_to_full_key(k, num_layers): v for k, v in state.items()}


def _add_stage(keys, full, stage, pp_rank):
    """Add one stage's tensors; stages come in order, so the first copy of a tensor held by
    several stages is kept, and later copies are checked (``keys.stage_replica``)."""
    for key, tensor in stage.items():
        if key not in full:
            full[key] = tensor
            continue
        rule = keys.stage_replica(key)
        if rule == "agree":
            replicas_agree(full[key], tensor, f"{key} (pipeline stage {pp_rank})")
        elif rule != "first":
            raise CheckpointError(f"{key} appears on two pipeline stages (again on stage "
                                  f"{pp_rank})")


def check_complete(keys: Any, full: StateDict, args: Dict[str, Any], folder: str) -> StateDict:
    expected = keys.expected_keys(args)
    missing = [k for k in expected if k not in full]
    unexpected = sorted(set(full) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {folder} does not hold a {keys.describe(args)}: "
                              f"missing {missing[:3]}, unexpected {unexpected[:3]}")
    vocab = full[keys.VOCAB_KEYS[0]].shape[0]
    if vocab != args["padded_vocab_size"]:
        raise CheckpointError(f"checkpoint {folder}: word embeddings have {vocab} rows but its "
                              f"args say padded_vocab_size={args['padded_vocab_size']}")
    return {k: full[k] for k in expected}


def _check_family(first, family, path):
    """The key map of the checkpoint whose first rank file is ``first``; when ``family`` is
    given, it must be that family's."""
    args = dict(first.get("args") or {})
    keys = key_map_for(args, names=list(first.get("model") or ()),
                       saved_family=first.get("family"))
    if family is not None and family != keys.FAMILY:
        raise CheckpointError(f"{path} is not a {key_map_named(family).NAME} checkpoint (it "
                              f"holds a {keys.NAME}); use {keys.CONVERT_TOOL}")
    return keys


def merge_layout(keys: Any, args: Dict[str, Any],
                 local_state: Callable[[int, int], StateDict], where: str) -> StateDict:
    """Per-rank state dicts of the (tp, pp) layout in ``args`` -> one whole-model dict.

    Tensor-parallel shards are concatenated, pipeline-stage keys renamed to the whole
    model's, and tensors held by several stages checked to agree. Used for the weights and,
    by a resume at another layout, for each Adam moment (keyed like the weights).

    Args:
        keys: the model's key map (:mod:`.key_maps`).
        args: the saved args (layout and ``num_layers``).
        local_state: ``f(tp_rank, pp_rank) -> {local key: tensor}``, called stage by stage.
        where: description for error messages.
    """
    tp, pp = args["tensor_model_parallel_size"], args.get("pipeline_model_parallel_size", 1)
    full = {}
    for pp_rank in progress(range(pp), desc="reading stages", unit="stages"):
        stage = [_to_full_keys(keys, local_state(t, pp_rank), args["num_layers"])
                 for t in range(tp)]
        merged = merge_tensor_parallel(stage, f"{where} stage {pp_rank}",
                                       split_dim=keys.tp_split_dim)
        _add_stage(keys, full, merged, pp_rank)
    return full


def read_native(root: str, iteration: Optional[int] = None, family: Optional[str] = None,
                any_recorded: bool = False) -> FullCheckpoint:
    """Read and merge a native checkpoint into a :class:`FullCheckpoint`.

    Args:
        root: a ``--save`` directory.
        iteration: which iteration (default: the tracker's).
        family: ``gpt2`` or ``t5`` to insist on one (default: what the saved args say).
        any_recorded: accept a checkpoint of any family that records its sharding, whatever
            ``family`` says (native -> native conversion cuts it by that record).

    Raises:
        CheckpointError: missing, incomplete, mixed or other-family checkpoint.
    """
    iteration = resolve_iteration(root, iteration)
    folder = iteration_dir(root, iteration)
    files, loaded = rank_files(folder), {}
    if (0, 0) not in files and (0, 0, 0) in ep_rank_files(folder):
        files, loaded = _expert_parallel(folder)
    if (0, 0) not in files:
        raise CheckpointError(f"checkpoint {folder} has no mp_rank_00_000 (or mp_rank_00) file")
    first = loaded.get((0, 0)) or load_rank_file(files[(0, 0)])
    args = dict(first.get("args") or {})
    required = ("num_layers", "padded_vocab_size", "tensor_model_parallel_size")
    if not all(k in args for k in required):
        raise CheckpointError(f"{files[(0, 0)]} has no saved model args: not a megatron-tds "
                              f"checkpoint")
    tp, pp = args["tensor_model_parallel_size"], args.get("pipeline_model_parallel_size", 1)
    if _recorded_only(first):
        return _read_recorded(first, files, folder, args, None if any_recorded else family,
                              iteration, tp, pp, loaded)
    keys = _check_family(first, family, files[(0, 0)])
    check_rank_layout(files, tp, pp, folder)

    def model_of(tp_rank, pp_rank):
        key = (tp_rank, pp_rank)
        state = first if key == (0, 0) else loaded.get(key) or load_rank_file(files[key])
        return state.get("model", {})

    full = merge_layout(keys, args, model_of, folder)
    extras = {k: first[k] for k in CARRIED_KEYS if k in first}
    return FullCheckpoint(check_complete(keys, full, args, folder), args,
                          int(first.get("iteration", iteration)), extras)


def _recorded_only(first: dict) -> bool:
    """A checkpoint of a model without a key map (not GPT-2 or T5) that records its
    sharding (:mod:`.sharding`): it is read by that record. A provider run names no family:
    its checkpoint is read so when its tensors are not GPT-2's or T5's."""
    if not first.get("sharding"):
        return False
    family = first.get("family")
    if family is not None:
        return family not in ("gpt2", "t5")
    names = list(first.get("model") or ())
    return not any(keys.matches(dict(first.get("args") or {}), names) for keys in KEY_MAPS)


def _expert_parallel(folder):
    """An ep > 1 checkpoint's ``({(tp, pp): path of ep rank 0's file}, {(tp, pp): state
    with every ep rank's experts})`` (:mod:`.expert_state`): read as if saved at ep 1."""
    from .expert_state import read_ep_states

    files = ep_rank_files(folder)
    first = load_rank_file(files[(0, 0, 0)])
    args = dict(first.get("args") or {})
    check_rank_layout(files, args.get("tensor_model_parallel_size", 1),
                      args.get("pipeline_model_parallel_size", 1), folder, ep=saved_ep(first))
    states, _ = read_ep_states(files, {(0, 0, 0): first})
    for key, state in states.items():  # whole models now: every expert in each (tp, pp)
        states[key] = dict(state, args=dict(state.get("args") or {}, **{EP_KEY: 1}))
    return {(t, p): path for (t, p, e), path in files.items() if e == 0}, states


def _read_recorded(first, files, folder, args, family, iteration, tp, pp,
                   loaded=None) -> FullCheckpoint:
    """:func:`read_native` of a recorded checkpoint: whole tensors under the model's own
    (layout-independent) names, vocabulary rows unpadded when the real size is saved."""
    from .sharding import has_records, merge_recorded

    if family is not None and family != first["family"]:
        held = f"a {first['family']!r} model" if first["family"] else \
            "a model that is not GPT-2 or T5 (saved by a provider run)"
        raise CheckpointError(f"{folder} holds {held}, not {family!r}; "
                              f"tools/convert_checkpoint.py reshards it native -> native, "
                              f"and converts it to Hugging Face with --family "
                              f"package.module:FAMILY when the family declares its name "
                              f"table (hf_names), else with the model's own tool (e.g. "
                              f"examples/llama/convert_llama.py; docs/new_model.md)")
    check_rank_layout(files, tp, pp, folder)
    loaded = loaded or {}
    states = {key: first if key == (0, 0) else loaded.get(key) or load_rank_file(path)
              for key, path in files.items()}
    if not has_records(states.values()):
        raise CheckpointError(f"{folder}: some rank files carry no sharding record, so "
                              f"they were not saved with the others; the checkpoint mixes "
                              f"files from different runs")
    full = merge_recorded({k: s.get("model", {}) for k, s in states.items()},
                          {k: s["sharding"] for k, s in states.items()},
                          args.get("true_vocab_size"), folder)
    extras = {k: first[k] for k in CARRIED_KEYS if k in first}
    stage_records = {p: dict(states[(0, p)]["sharding"]) for p in range(pp)}
    return FullCheckpoint(full, args, int(first.get("iteration", iteration)), extras,
                          stage_records=stage_records, family=first["family"],
                          differing_copies=stage_copies_differ(
                              {k: s.get("model", {}) for k, s in states.items()}))


def stage_copies_differ(states: Dict[tuple, StateDict]) -> List[str]:
    """Keys that several pipeline stages hold (a tied module) whose copies differ on some
    tensor-parallel rank (beyond :data:`REPLICA_TOLERANCE`): a pipeline keeps only the tied
    weights equal, so anything else in a tied module goes stale on the stage that does not
    use it.

    Args:
        states: ``{(tp_rank, pp_rank): {key: tensor}}``.
    """
    first: Dict[tuple, torch.Tensor] = {}
    differ = set()
    for (t, p), state in sorted(states.items(), key=lambda item: (item[0][1], item[0][0])):
        for key, tensor in state.items():
            seen = first.setdefault((t, key), tensor)
            if seen is not tensor and (seen.shape != tensor.shape or (
                    seen.float() - tensor.float()).abs().max().item() > REPLICA_TOLERANCE):
                differ.add(key)
    return sorted(differ)

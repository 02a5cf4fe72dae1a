"""Reshard a checkpoint by its sharding record: native -> native for a model without a key map.

A checkpoint of a model built from the mpu layers whose tensor names do not depend on the
layout (examples/llama/llama_model.py) says by itself how each tensor is split
(:mod:`.sharding`). :func:`.native_reader.read_native` merges it into whole tensors and keeps
each pipeline stage's record (``FullCheckpoint.stage_records``); here the whole tensors are
re-padded for the target tensor-parallel size (vocabulary rows as a training run there pads
them: :func:`~.vocab_padding.target_padded_size`), the target checked against the record
(each split dimension must divide by tp x stride), and each target rank's file is cut by the
same record, which it carries on.

The pipeline size stays the source's (a tensor stays on its recorded stage and chunk, so each
target file of stage p holds what the source files of stage p held), or becomes 1 (every
tensor on stage 0: the names do not depend on the layout, a tied module's included, as
:class:`megatron.model.spec_model.SpecModel` names it), unless the copies of a tensor held by
several stages differ (a tied module holding more than the tied weights, whose other tensors
went stale on the stage that does not use them: which copy is the model's is not known).
Re-cutting into another
number of stages would need the model's partition (which layer specs count,
``partition_method``), which neither the record nor the files hold; a run at the new pipeline
size reads the record itself (``--load``).
"""
from typing import Any, Dict, List, Optional

import torch

from ..common.errors import CheckpointError, ConfigError
from .chunks import VPP_KEY, vpp_of
from .native_reader import FullCheckpoint
from .sharding import Record, slice_recorded
from .vocab_padding import resolve_true_vocab_size, target_padded_size

#: Saved settings that count whole attention heads per tensor-parallel rank; the record knows
#: tensor sizes, not heads, so these are checked by name when the args hold them.
HEAD_COUNTS = ("num_attention_heads", "num_key_value_heads")


def _pipeline_problem(ckpt: FullCheckpoint, pp: int) -> Optional[str]:
    """Why the stages of ``ckpt`` cannot become ``pp`` stages, or None."""
    source = len(ckpt.stage_records)  # the stages the state is cut for
    if pp == source:
        return None
    if pp == 1:
        differ = [k for k in _shared_keys(ckpt.stage_records) if k in ckpt.differing_copies]
        if not differ:
            return None
        return (f"the checkpoint's {', '.join(differ[:3])} is held by several pipeline "
                f"stages (a tied module) and the copies differ: the pipeline keeps only the "
                f"tied weights equal, so this one went stale on a stage that does not use it "
                f"and which copy is the model's is unknown; tie only the shared weight "
                f"(megatron.model.lm_head.tied_embedding_specs), or resume a run at pp=1 "
                f"from it (--load: it reads the record)")
    return (f"the checkpoint holds a {ckpt.family!r} model, which has no key map: its "
            f"pipeline size ({source}) changes in a conversion only to 1 (the record says "
            f"which stage holds each tensor, not how the model partitions its layers "
            f"into {pp} stages); change the pipeline size by resuming a run at the new "
            f"layout (--load with the new --pipeline-model-parallel-size: it reads the "
            f"record), or convert with --target-pipeline-parallel-size {source} or 1")


def _shared_keys(stage_records: Dict[int, Record]) -> List[str]:
    """Keys recorded on more than one stage, or as tied (chunk -1)."""
    seen: Dict[str, int] = {}
    for record in stage_records.values():
        for key, spec in record.items():
            seen[key] = seen.get(key, 0) + (2 if spec[4] < 0 else 1)
    return sorted(k for k, n in seen.items() if n > 1)


def _one_stage(stage_records: Dict[int, Record]) -> Dict[int, Record]:
    """Every stage's tensors on stage 0, chunk 0 (a serial model holds them all)."""
    return {0: {key: list(spec[:3]) + [0, 0] + list(spec[5:]) for p in sorted(stage_records)
                for key, spec in stage_records[p].items()}}


def recorded_layout_problems(ckpt: FullCheckpoint, tp: int, pp: int) -> List[str]:
    """What keeps the recorded checkpoint ``ckpt`` from splitting into ``tp`` x ``pp``.

    Args:
        ckpt: whole tensors (vocabulary rows padded for ``tp``) and their stage records.
        tp, pp: target sizes.
    """
    problems = [p for p in [_pipeline_problem(ckpt, pp)] if p]
    bad = []
    for record in ckpt.stage_records.values():
        for key, (dim, stride) in ((k, v[:2]) for k, v in record.items()):
            size = ckpt.state[key].shape[dim] if dim >= 0 else 0
            if dim >= 0 and size % (tp * stride) and key not in bad:
                bad.append(key)
                problems.append(f"{key}: dimension {dim} (size {size}) is not divisible by "
                                f"--target-tensor-parallel-size {tp}"
                                f"{f' x its stride {stride}' if stride > 1 else ''}")
    problems += [f"{name} ({ckpt.args[name]}) is not divisible by "
                 f"--target-tensor-parallel-size {tp}"
                 for name in HEAD_COUNTS if ckpt.args.get(name) and ckpt.args[name] % tp]
    return problems


def check_recorded_layout(ckpt: FullCheckpoint, tp: int, pp: int) -> None:
    """Raise ConfigError unless ``ckpt`` (a recorded checkpoint) splits into ``tp`` x ``pp``.

    Args:
        ckpt: whole tensors padded for ``tp``, with ``stage_records``.
        tp, pp: target sizes.
    """
    if tp < 1 or pp < 1:
        raise ConfigError(f"target sizes must be >= 1, got tp={tp}, pp={pp}")
    problems = recorded_layout_problems(ckpt, tp, pp)
    if len(problems) > 6:
        problems = problems[:6] + [f"... ({len(problems) - 6} more)"]
    if problems:
        raise ConfigError("; ".join(problems))


def _repad(tensor: torch.Tensor, dim: int, true_vocab: Optional[int], padded: int,
           key: str) -> torch.Tensor:
    """``tensor`` with ``padded`` vocabulary rows on ``dim``: the real ones kept, the rest 0
    (unchanged when it already has ``padded``)."""
    rows = tensor.shape[dim]
    if rows == padded:
        return tensor
    if true_vocab is None or true_vocab > min(rows, padded):
        raise CheckpointError(f"cannot re-pad {key} from {rows} to {padded} vocabulary rows "
                              f"without knowing the real vocabulary size (got {true_vocab}); "
                              f"pass --true-vocab-size")
    real = tensor.narrow(dim, 0, true_vocab)
    shape = list(tensor.shape)
    shape[dim] = padded - true_vocab
    return torch.cat([real, real.new_zeros(shape)], dim=dim)


def reshard_recorded(ckpt: FullCheckpoint, tp: int, pp: int, divisible_by: Optional[int] = None,
                     true_vocab: Optional[int] = None) -> FullCheckpoint:
    """:func:`~.native_writer.reshard` of a recorded checkpoint: the vocabulary rows re-padded
    for ``tp`` as the record marks them, the args of the target layout, the layout checked.

    Args:
        ckpt: :func:`~.native_reader.read_native` of a checkpoint without a key map.
        tp, pp: target layout (``pp``: the source's, or 1 when no tensor is on several
            stages).
        divisible_by: target ``--make-vocab-size-divisible-by`` (default: the source's).
        true_vocab: real vocabulary rows (default: the saved ``true_vocab_size``, else the
            tokenizer files the args name).
    """
    divisible_by = divisible_by or ckpt.args.get("make_vocab_size_divisible_by") or 128
    true_vocab = resolve_true_vocab_size(ckpt.args, true_vocab)
    padded = target_padded_size(ckpt.args, tp, divisible_by, true_vocab)
    vocab = {key: spec[0] for record in ckpt.stage_records.values()
             for key, spec in record.items() if spec[2]}
    state = dict(ckpt.state)
    for key, dim in vocab.items():
        state[key] = _repad(state[key], max(dim, 0), true_vocab, padded, key)
    args = dict(ckpt.args)
    args.update(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                padded_vocab_size=padded, make_vocab_size_divisible_by=divisible_by)
    if true_vocab is not None:
        args["true_vocab_size"] = true_vocab
    out = FullCheckpoint(state, args, ckpt.iteration, dict(ckpt.extras),
                         stage_records=ckpt.stage_records, family=ckpt.family)
    check_recorded_layout(out, tp, pp)
    if pp != len(ckpt.stage_records):  # to one stage (the only change allowed)
        out.stage_records = _one_stage(ckpt.stage_records)
    # the same stages and chunks as the source, or one stage
    args[VPP_KEY] = vpp_of(ckpt.args) if pp > 1 else 1
    return out


def recorded_rank_state(ckpt: FullCheckpoint, tp_rank: int, pp_rank: int) -> Dict[str, Any]:
    """One target rank file's model, sharding record and family.

    Args:
        ckpt: :func:`reshard_recorded`'s result (args of the target layout).
        tp_rank, pp_rank: the target rank.
    """
    own: Record = ckpt.stage_records[pp_rank]
    model = slice_recorded(ckpt.state, own, ckpt.args["tensor_model_parallel_size"], tp_rank,
                           ckpt.args["padded_vocab_size"], "the converted checkpoint")
    return {"model": model, "sharding": {k: list(v) for k, v in own.items()},
            "family": ckpt.family}

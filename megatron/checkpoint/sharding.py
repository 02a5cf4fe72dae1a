"""The sharding record: how each saved tensor is split, written with the checkpoint.

The mpu layers mark their parameters (``tensor_model_parallel``, ``partition_dim``,
``partition_stride``; ``padded_vocab_rows`` for a tensor with a row per vocabulary entry,
padded to a multiple of the tensor-parallel size). :func:`sharding_record` turns that into
plain data saved in every rank file under ``"sharding"``::

    {key: [tp_dim, stride, vocab_rows, stage, chunk, experts]}   # tp_dim -1: replicated

``experts`` is the number of experts of an MoE layer's stacked expert tensor (its dim 0,
split over the expert-parallel ranks: ``expert_dim`` / ``num_experts`` on the parameter,
megatron.mpu.moe), 0 for every other tensor; records written before it have five entries.

so a checkpoint says by itself how to merge its shards and how to cut them for another
layout, with no key map for the model (:func:`merge_recorded`, :func:`slice_recorded`;
used by :mod:`.layout_change`). This holds for any model whose parameter names do not
depend on the layout, e.g. one whose serial model names its layers as its pipeline does
(``"0"``, ``"1"``, ... the layer-spec indices: examples/llama/llama_model.py). GPT-2 and T5, whose
serial and pipeline names differ, and checkpoints written before the record, use their key
maps (:mod:`.key_maps`).
"""
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ..common.errors import CheckpointError
from ..mpu.vocab_padding import mark_padded_vocab_rows  # noqa: F401 (the record's marker)

Record = Dict[str, List[int]]
StateDict = Dict[str, torch.Tensor]


def sharding_record(module: torch.nn.Module, stage: int = 0,
                    chunk_of: Optional[Callable[[str], int]] = None) -> Record:
    """The record of ``module``'s state dict (its parameters' mpu attributes).

    Args:
        module: the rank's model (serial model or pipeline stage).
        stage: this rank's pipeline stage.
        chunk_of: key -> the global model chunk holding it (virtual stages), or None.
    """
    params = dict(module.named_parameters())
    record = {}
    for key in module.state_dict():
        param = params.get(key)
        parallel = param is not None and bool(getattr(param, "tensor_model_parallel", False))
        dim = int(param.partition_dim) if parallel else -1
        stride = int(getattr(param, "partition_stride", 1)) if parallel else 1
        vocab = int(bool(getattr(param, "padded_vocab_rows", False)))
        experts = int(getattr(param, "num_experts", 0)) if param is not None and \
            getattr(param, "expert_parallel", False) else 0
        record[key] = [dim, stride, vocab, int(stage), chunk_of(key) if chunk_of else 0,
                       experts]
    return record


def module_classes(module: torch.nn.Module) -> Dict[str, str]:
    """``{state-dict key: class name of the module holding it}`` (saved beside the record:
    a layout change matches a serial model named unlike its pipeline by it,
    :mod:`.structural_match`).

    Args:
        module: the rank's model (serial model or pipeline stage).
    """
    owners = {}
    for prefix, sub in module.named_modules():
        for name in list(sub._parameters) + list(sub._buffers):
            owners[f"{prefix}.{name}" if prefix else name] = type(sub).__name__
    return {key: owners.get(key, "") for key in module.state_dict()}


def experts_of(spec: List[int]) -> int:
    """The experts a recorded tensor stacks on dim 0 (0: not an expert tensor)."""
    return spec[5] if len(spec) > 5 else 0


def pipeline_chunk_of(module: torch.nn.Module) -> Optional[Callable[[str], int]]:
    """key -> global model chunk for a tds PipelineModule (layer-spec keys ``"3.<...>"``;
    -1 for tied modules, which live on several chunks); None for other modules."""
    owner = getattr(module, "chunk_owner", None)
    if owner is None:
        return None

    def chunk_of(key):
        head = key.split(".", 1)[0]
        return owner(int(head)) if head.isdigit() else -1

    return chunk_of


def has_records(states) -> bool:
    """Whether every rank file's state carries a sharding record."""
    return all(isinstance(s.get("sharding"), dict) and s["sharding"] for s in states)


def _merge_dim(shards: List[torch.Tensor], dim: int, stride: int) -> torch.Tensor:
    """Inverse of the mpu split: rank r holds pieces ``r, r + tp, ...`` of ``tp x stride``."""
    if stride == 1:
        return torch.cat(shards, dim=dim)
    pieces = [torch.chunk(s, stride, dim=dim) for s in shards]
    return torch.cat([pieces[r][j] for j in range(stride) for r in range(len(shards))], dim=dim)


def split_dim(full: torch.Tensor, dim: int, stride: int, tp: int, tp_rank: int
              ) -> torch.Tensor:
    """This rank's shard of ``full`` as the mpu layers cut it (``stride`` pieces each)."""
    if full.shape[dim] % (tp * stride):
        raise CheckpointError(f"a tensor of size {full.shape[dim]} on dimension {dim} does "
                              f"not split into {tp} x {stride} pieces; choose a "
                              f"--tensor-model-parallel-size that divides it")
    pieces = torch.chunk(full, tp * stride, dim=dim)
    return torch.cat(pieces[tp_rank::tp], dim=dim).clone()


def merge_recorded(states: Dict[tuple, StateDict], records: Dict[tuple, Record],
                   true_vocab: Optional[int], where: str) -> StateDict:
    """Whole tensors from every (tp, pp[, ep]) file's tensors, as their records say.

    Args:
        states: ``{(tp_rank, pp_rank): {key: tensor}}`` (weights, or one optimizer moment),
            or ``{(tp_rank, pp_rank, ep_rank): ...}`` with expert parallelism (the ep ranks'
            files hold different experts; their other tensors are replicas).
        records: each file's sharding record.
        true_vocab: real vocabulary rows (padding rows are dropped); None keeps them.
        where: the checkpoint, for messages.
    """
    tp = 1 + max(key[0] for key in states)
    by_key: Dict[str, Dict[Tuple[int, int], torch.Tensor]] = {}
    spec: Dict[str, List[int]] = {}
    for file_key, state in states.items():
        t, p, e = (tuple(file_key) + (0,))[:3]
        for key, tensor in state.items():
            if key not in records[file_key]:
                raise CheckpointError(f"{where}: {key} (tp {t}, pp {p}) is missing from the "
                                      f"file's sharding record; the file is damaged")
            spec[key] = records[file_key][key]
            by_key.setdefault(key, {}).setdefault((e if experts_of(spec[key]) else 0, t),
                                                  tensor)
    full = {}
    for key, shards in by_key.items():
        dim, stride, vocab = spec[key][:3]
        eps = sorted({e for e, _ in shards})
        parts = [_merge_tp({t: s for (e2, t), s in shards.items() if e2 == e}, tp, dim, stride,
                           key, where) for e in eps]
        tensor = torch.cat(parts, dim=0) if len(parts) > 1 else parts[0]
        experts = experts_of(spec[key])
        if experts and tensor.shape[0] != experts:
            raise CheckpointError(f"{where}: {key} holds {tensor.shape[0]} of its {experts} "
                                  f"experts (expert-parallel files {eps}); the checkpoint is "
                                  f"incomplete")
        if vocab and true_vocab is not None:
            tensor = tensor.narrow(dim, 0, true_vocab)
        full[key] = tensor
    return full


def _merge_tp(shards, tp, dim, stride, key, where):
    if dim < 0:
        return shards[min(shards)]
    missing = [t for t in range(tp) if t not in shards]
    if missing:
        raise CheckpointError(f"{where}: {key} lacks tensor-parallel shards {missing}; "
                              f"the checkpoint is incomplete")
    return _merge_dim([shards[t] for t in range(tp)], dim, stride)


def slice_recorded(full: StateDict, own: Record, tp: int, tp_rank: int,
                   padded_vocab: Optional[int], where: str, ep: int = 1,
                   ep_rank: int = 0) -> StateDict:
    """This rank's state dict: for each key its model holds (``own``, the record of the
    run's model), the whole tensor re-padded and cut for (``tp``, ``tp_rank``), an expert
    tensor first cut to this rank's experts (``ep``, ``ep_rank``).

    Args:
        full: whole tensors (:func:`merge_recorded`), vocabulary rows unpadded.
        own: the sharding record of this rank's model.
        tp, tp_rank: the run's tensor-parallel size and rank.
        padded_vocab: the run's padded vocabulary rows.
        where: the checkpoint, for messages.
        ep, ep_rank: the run's expert-parallel size and rank.
    """
    missing = sorted(set(own) - set(full))
    if missing:
        raise CheckpointError(f"{where} has no {', '.join(missing[:4])}"
                              f"{' ...' if len(missing) > 4 else ''}: it was saved by "
                              f"another model (its tensors: {', '.join(sorted(full)[:4])} ...)")
    out = {}
    for key, spec in own.items():
        (dim, stride, vocab), tensor = spec[:3], full[key]
        experts = experts_of(spec)
        if experts:
            if tensor.shape[0] != experts or experts % ep:
                raise CheckpointError(f"{where}: {key} has {tensor.shape[0]} experts; this "
                                      f"run's model has {experts}, split over "
                                      f"--expert-model-parallel-size {ep}")
            per = experts // ep
            tensor = tensor[ep_rank * per:(ep_rank + 1) * per]
        if vocab and padded_vocab is not None and tensor.shape[dim] > padded_vocab:
            raise CheckpointError(f"{where}: {key} has {tensor.shape[dim]} vocabulary rows, "
                                  f"more than this run's {padded_vocab}; pass "
                                  f"--true-vocab-size")
        if vocab and padded_vocab is not None and tensor.shape[dim] != padded_vocab:
            shape = list(tensor.shape)
            shape[dim] = padded_vocab - tensor.shape[dim]
            tensor = torch.cat([tensor, tensor.new_zeros(shape)], dim=dim)  # new rows: 0
        out[key] = split_dim(tensor, dim, stride, tp, tp_rank) if dim >= 0 else tensor.clone()
    return out

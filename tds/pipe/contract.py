"""The typed stage-boundary contract: what each position of the inter-stage tuple is.

A pipeline model carries three lists, one entry per position of the tuple that stage k
sends to stage k+1 (CPM-Pretrain's TDS attributes):

- ``_input_type``: ``'float'``, ``'int'`` or ``'bool'``;
- ``_input_grad``: whether the position's gradient travels back to the previous stage;
- ``_input_pipe_partitioned``: whether it is split across the tensor-parallel ranks for
  the send and all-gathered on receipt (p2p volume / tp).

As in CPM's TDS, every tensor travels in its own dtype (the probe sends it with the
shapes), so ``'float'`` and ``'int'`` only describe: CPM's T5 declares its float attention
masks ``'int'`` and they arrive as the floats they are. The one conversion CPM's TDS made
was for ``'bool'`` positions (sent as half, turned back into bool); bool tensors travel as
bool here, so a ``'bool'`` position must hold a bool tensor. What is checked: the number
of positions, a gradient position holding a floating-point tensor, a ``'bool'`` position
holding a bool tensor, a partitioned size dividing tp, and (every step) the shapes the
probe learned.

GPT-2: ``(hidden, attention_mask)`` -> ``['float', 'bool']``, ``[True, False]``,
``[True, False]``.
"""
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch

TYPE_NAMES = ("bool", "float", "int")
"""The declarations ``_input_type`` may hold (tensors travel in their own dtype)."""


@dataclass(frozen=True)
class StageContract:
    """Validated per-position description of the tensors crossing a stage boundary."""

    types: Tuple[str, ...]
    grads: Tuple[bool, ...]
    partitioned: Tuple[bool, ...]

    @classmethod
    def build(cls, types: Sequence[str], grads: Sequence[bool],
              partitioned: Optional[Sequence[bool]]) -> "StageContract":
        """Check the three lists against each other; raise ValueError naming the position.

        Args:
            types: per-position ``'float'`` / ``'int'`` / ``'bool'``.
            grads: per-position bool.
            partitioned: per-position bool, or None for all False.
        """
        types = tuple(types)
        grads = tuple(bool(g) for g in grads)
        partitioned = tuple(bool(p) for p in partitioned) if partitioned is not None \
            else (False,) * len(types)
        if not (len(types) == len(grads) == len(partitioned)):
            raise ValueError(
                f"pipeline stage contract: _input_type has {len(types)} positions, _input_grad "
                f"{len(grads)}, _input_pipe_partitioned {len(partitioned)}; give one entry per "
                f"tensor of the tuple passed between stages")
        for pos, kind in enumerate(types):
            if kind not in TYPE_NAMES:
                raise ValueError(f"pipeline stage contract: position {pos} has _input_type "
                                 f"{kind!r}; use one of {sorted(TYPE_NAMES)}")
            if grads[pos] and kind != "float":
                raise ValueError(f"pipeline stage contract: position {pos} is {kind!r} but "
                                 f"_input_grad[{pos}] is True; only 'float' positions can carry "
                                 f"a gradient")
        return cls(types, grads, partitioned)

    def check_shapes(self, tensors: Sequence[torch.Tensor], meta, where: str) -> None:
        """Check a tuple against the shapes and dtypes learned by the probe.

        Raises:
            ValueError naming the position, both shapes and the call that relearns them.
        """
        if len(tensors) != len(meta):
            raise ValueError(f"{where}: the stage produced {len(tensors)} tensors, the first "
                             f"batch had {len(meta)}")
        for pos, (tensor, (shape, dtype)) in enumerate(zip(tensors, meta)):
            if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
                raise ValueError(
                    f"{where}: position {pos} is {tuple(tensor.shape)} {tensor.dtype}, but the "
                    f"first batch's was {tuple(shape)} {dtype}; shapes are learned once: call "
                    f"engine.reset_activation_shape() before a batch of another shape")

    def __len__(self):
        return len(self.types)

    def check_tensors(self, tensors: Sequence[torch.Tensor], tp_size: int, where: str) -> None:
        """Check a real tuple against the contract (count, dtype kind, divisibility).

        Raises:
            ValueError naming the position and ``where`` (e.g. "stage 0 output").
        """
        if not isinstance(tensors, tuple):
            raise ValueError(f"{where}: the stage produced a {type(tensors).__name__}, not a "
                             f"tuple; return a tuple of the {len(self)} tensor(s) the contract "
                             f"describes (_input_type={list(self.types)})")
        if len(tensors) != len(self):
            raise ValueError(f"{where}: the stage produced {len(tensors)} tensors but the "
                             f"contract describes {len(self)} positions "
                             f"(_input_type={list(self.types)})")
        for pos, (tensor, kind) in enumerate(zip(tensors, self.types)):
            if not torch.is_tensor(tensor):
                raise ValueError(f"{where}: position {pos} is a {type(tensor).__name__}, "
                                 f"not a tensor")
            if self.grads[pos] and not tensor.is_floating_point():
                raise ValueError(f"{where}: position {pos} is a {tensor.dtype} tensor but "
                                 f"_input_grad[{pos}] is True; only a floating-point tensor "
                                 f"can carry a gradient back (set it to False)")
            if kind == "bool" and tensor.dtype != torch.bool:
                raise ValueError(f"{where}: position {pos} is a {tensor.dtype} tensor but "
                                 f"_input_type[{pos}] is 'bool'; a bool position must hold a "
                                 f"bool tensor (or declare it 'float' / 'int': tensors travel "
                                 f"in their own dtype)")
            if self.partitioned[pos] and tensor.numel() % tp_size:
                raise ValueError(
                    f"{where}: position {pos} (shape {tuple(tensor.shape)}, {tensor.numel()} "
                    f"elements) is marked _input_pipe_partitioned but its size does not divide "
                    f"the tensor-parallel size {tp_size}")


def contract_of(module: torch.nn.Module) -> StageContract:
    """The contract a pipeline module declares (the ``_input_*`` attributes)."""
    missing = [name for name in ("_input_type", "_input_grad") if not hasattr(module, name)]
    if missing:
        raise ValueError(f"{type(module).__name__} lacks {', '.join(missing)}: a tds pipeline "
                         f"module declares _input_type and _input_grad (and optionally "
                         f"_input_pipe_partitioned), one entry per inter-stage tensor")
    return StageContract.build(module._input_type, module._input_grad,
                               getattr(module, "_input_pipe_partitioned", None))

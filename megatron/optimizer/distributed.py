"""Megatron-LM's distributed optimizer (ZeRO stage 1): each data-parallel rank updates 1/dp.

The gradient buffers (:mod:`megatron.distributed`) are reduce-scattered, so data-parallel
rank ``r`` holds the reduced gradients of the ``r``-th slice of every bucket; this optimizer
holds the Adam state of those slices only (1/dp of the unsharded optimizer's memory) and
updates them in place in the flat parameter buffer, whose slices the data-parallel ranks
then all-gather (:meth:`megatron.distributed.DataParallel.start_param_sync`). A parameter
cut by a slice boundary is updated in parts by two ranks. The step is
:class:`~.optimizer.MegatronOptimizer`'s (loss scale, overflow skip, clipping) over the
slices: the norm sums each rank's slices over every rank (each element of the model once).

Checkpoints: each data-parallel rank saves its slices' state keyed by ``(parameter name,
offset, length)``; a resume at any data-parallel size (and, through the named state, any
tp / pp) reassembles whole parameters' moments and cuts its own slices again
(megatron/training/state_io.py).
"""
import inspect
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import nn

from .optimizer import MegatronOptimizer


class Piece(NamedTuple):
    """The part of parameter ``name`` from element ``offset`` on, ``numel`` long, that this
    rank updates."""
    name: str
    offset: int
    numel: int


class DistributedOptimizer(MegatronOptimizer):
    """A torch optimizer over this rank's slices of the gradient buffers.

    Args:
        template: the torch optimizer built over the model's parameters (its class, defaults
            and param groups, e.g. the weight-decay split, are kept; its parameters are not
            stepped).
        grad_scaler, clip_grad, skip_nonfinite: as :class:`MegatronOptimizer`'s.
        grads: the :class:`~megatron.distributed.DataParallel` with sharded buffers.
        model_parallel: as :class:`MegatronOptimizer`'s (only its tp rank is read here).
    """

    def __init__(self, template: torch.optim.Optimizer, grad_scaler, clip_grad: float,
                 skip_nonfinite: bool, grads: Any, model_parallel=None):
        names = {id(p): n for n, p in grads.module.named_parameters()}
        group_of = {id(p): i for i, g in enumerate(template.param_groups) for p in g["params"]}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": []}
                  for g in template.param_groups]
        self.pieces: List[Piece] = []
        self.owners: List[torch.Tensor] = []
        self._index: Dict[int, int] = {}  # id(slice parameter) -> index in pieces / owners
        for owner, offset, data, grad in grads.shard_pieces():
            if id(owner) not in group_of:
                raise ValueError(f"distributed optimizer: parameter {names.get(id(owner))} has a "
                                 f"gradient buffer but is in no param group of the optimizer")
            shard = nn.Parameter(data)  # a view of the flat parameter buffer
            shard.grad = grad           # a view of its reduced gradient slice
            groups[group_of[id(owner)]]["params"].append(shard)
            self._index[id(shard)] = len(self.pieces)
            self.pieces.append(Piece(names[id(owner)], offset, data.numel()))
            self.owners.append(owner)
        accepted = inspect.signature(type(template).__init__).parameters
        optimizer = type(template)(groups, **{k: v for k, v in template.defaults.items()
                                              if k in accepted})
        super().__init__(optimizer, grad_scaler, clip_grad, skip_nonfinite, grads,
                         model_parallel)

    def piece_of(self, shard: torch.Tensor) -> Piece:
        """The :class:`Piece` a slice parameter of the torch optimizer updates."""
        return self.pieces[self._index[id(shard)]]

    def _norm_terms(self, params) -> Tuple[List[bool], Any]:
        """Every slice counts where its parameter would (tp / pp / tied rules), and the sum
        runs over all ranks: the data-parallel ranks hold disjoint slices."""
        from .. import mpu

        tp_rank = self.model_parallel[0] if self.model_parallel else \
            mpu.get_tensor_model_parallel_rank()
        return [mpu.counts_toward_norm(self.owners[self._index[id(s)]], tp_rank)
                for s in params], None

    def _experts(self, params) -> List[bool]:
        """Slices need no sum over the expert-parallel group: the norm sums every rank's
        slices already (the experts' over their expert-data-parallel ranks, each expert on
        one expert-parallel rank)."""
        return [False] * len(params)

    def _after_update(self) -> None:
        self.grads.start_param_sync()

    def state_dict(self) -> Dict[str, Any]:
        """This rank's slices: the torch optimizer's state, with the piece of each of its
        positions (the order of its param groups)."""
        state = {"distributed_optimizer": 1, "optimizer": self.optimizer.state_dict(),
                 "pieces": [tuple(self.piece_of(s)) for s in self.params()]}
        if self.grad_scaler is not None:
            state["grad_scaler"] = self.grad_scaler.state_dict()
        return state


def build_optimizer(adam: torch.optim.Optimizer, grad_scaler: Optional[Any], clip_grad: float,
                    skip_nonfinite: bool, grads: Optional[Any],
                    model_parallel: Optional[tuple] = None) -> MegatronOptimizer:
    """The run's optimizer: the distributed one over ``grads``' slices when its buffers are
    sharded (``--use-distributed-optimizer``), else ``adam`` itself wrapped."""
    if grads is not None and grads.config.use_distributed_optimizer:
        return DistributedOptimizer(adam, grad_scaler, clip_grad, skip_nonfinite, grads,
                                    model_parallel)
    return MegatronOptimizer(adam, grad_scaler, clip_grad, skip_nonfinite, grads,
                             model_parallel)

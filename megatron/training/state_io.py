"""How a training backend's optimizer state goes into a checkpoint and comes back.

Each backend carries one of these (``backend.state_io``), so the checkpoint code
(:mod:`.checkpointing`) never asks which backend it has:

- :class:`OptimizerStateIO`: the replicated :class:`~megatron.optimizer.MegatronOptimizer`
  (every data-parallel rank holds the same state); it goes into the main file, with the
  parameter names;
- :class:`DistributedStateIO`: the distributed optimizer; each data-parallel rank writes its
  slices to its own ``optim_dp_rank_*.pt`` file, keyed by parameter name and offset;
- ``EngineStateIO`` (:mod:`.engine_state_io`): DeepSpeed's engine (``--deepspeed``).

Whatever wrote a checkpoint's optimizer state (this project's replicated or distributed
optimizer, or DeepSpeed's ZeRO-1 / engine files of earlier releases), a run that cannot load
it as it is reads it by parameter name (:func:`megatron.checkpoint.layout_change.
named_optimizer_state`) and cuts its own part: so a resume at another data-parallel size,
or with the other optimizer, is exact.
"""
from typing import Any, Dict, List, Optional

import torch

from .. import mpu
from ..checkpoint.layout_change import NamedOptimizerState, named_optimizer_state
from ..checkpoint.optimizer_names import HYPER_PARAMETERS, adam_state_dict, param_names
from ..checkpoint.zero_state import _new_step
from ..common.errors import CheckpointError
from ..optimizer import DistributedOptimizer
from ..common.utils import warn_rank_0


class OptimizerStateIO:
    """The replicated optimizer in a checkpoint (the base of the others).

    Attributes:
        sharded: each data-parallel rank saves its own optimizer file.
    """

    sharded = False

    def __init__(self, backend):
        self.backend = backend

    def state_dict(self) -> dict:
        """What the checkpoint holds of the optimizer."""
        return self.backend.optimizer.state_dict()

    def named_optimizer(self) -> Optional[Any]:
        """The torch optimizer stepping the model's own parameters (its state is per
        parameter, so a checkpoint can name it and another layout can re-slice it), or None
        when the optimizer holds slices or flat partitions instead."""
        return self.backend.optimizer.optimizer  # AdamW over the fp32 parameters themselves

    def param_names(self) -> Optional[List[str]]:
        """Names of :meth:`named_optimizer`'s parameters in its state order, or None."""
        named = self.named_optimizer()
        return None if named is None else param_names(self.backend.module(), named)

    def load_saved(self, state: dict, root: str, iteration: int, tp_rank: int,
                   pp_rank: int) -> None:
        """Restore the optimizer from the checkpoint of this (tp, pp): the main file's own
        state where it holds this optimizer's, else by name from whatever wrote it."""
        if "optimizer" in state and not self.sharded:
            self.backend.optimizer.load_state_dict(state["optimizer"])
            return
        named, groups, scaler = named_optimizer_state(
            state, root, iteration, tp_rank, pp_rank, default_names=adamw_order(
                self.backend.module()), ep_rank=mpu.get_expert_model_parallel_rank())
        self.load_named(NamedOptimizerState(named, _step_of(named), groups, scaler))

    def counters(self) -> Dict[str, int]:
        """Backend counters saved with a checkpoint."""
        return {}

    def load_counters(self, counters: Dict[str, int]) -> None:
        """Restore :meth:`counters`."""

    def after_weights_only_load(self) -> None:
        """Called when weights were loaded without optimizer state."""

    def load_scaler(self, scaler: dict) -> bool:
        """Restore an fp16 loss scaler saved by another writer (``{"ddp": ...}`` or
        ``{"deepspeed": ...}``); False when this run scales its loss but cannot use it."""
        grad_scaler = self.backend.optimizer.grad_scaler
        if grad_scaler is None:
            return True
        if scaler.get("ddp") is not None:
            grad_scaler.load_state_dict(scaler["ddp"])
            return True
        return not any(v is not None for v in scaler.values())

    def load_named(self, state: NamedOptimizerState) -> None:
        """Restore this rank's optimizer from per-parameter state (any writer's)."""
        names = [n for n, p in self.backend.module().named_parameters() if p.requires_grad]
        missing = [n for n in names if n not in state.named]
        if missing:
            raise CheckpointError(f"the checkpoint has no optimizer state for {missing[:3]}")
        self._load_named_state(state)
        if state.scaler and not self.load_scaler(state.scaler):
            warn_rank_0("the fp16 loss scale restarts from --initial-loss-scale (the checkpoint "
                        "was saved by DeepSpeed's engine)")

    def _load_named_state(self, state):
        load_named_adam(self.named_optimizer(), self.backend.module(), state)


class DistributedStateIO(OptimizerStateIO):
    """The distributed optimizer: this rank's slices, one file per data-parallel rank."""

    sharded = True

    def named_optimizer(self) -> Optional[Any]:
        return None  # slices, named in their own file

    def _load_named_state(self, state: NamedOptimizerState) -> None:
        optimizer: DistributedOptimizer = self.backend.optimizer
        torch_optimizer = optimizer.optimizer
        _set_hyper_parameters(torch_optimizer, state.groups)
        for group in torch_optimizer.param_groups:
            for shard in group["params"]:
                piece = optimizer.piece_of(shard)
                full = state.named[piece.name]
                cut = {k: full[k].reshape(-1)[piece.offset:piece.offset + piece.numel]
                       .to(shard.device, torch.float32).clone()
                       for k in ("exp_avg", "exp_avg_sq")}
                step = full.get("step", state.step)
                torch_optimizer.state[shard] = {"step": _new_step(_as_number(step), group,
                                                                  shard.device), **cut}


def state_io_for(optimizer: Any):
    """The state IO class for this project's optimizer."""
    return DistributedStateIO if isinstance(optimizer, DistributedOptimizer) else \
        OptimizerStateIO


def load_named_adam(adam, module, state: NamedOptimizerState) -> None:
    """Give a torch AdamW over ``module``'s parameters the named moments and step."""
    order = param_names(module, adam)
    step = state.step
    named = {n: {"step": _step_for(state.named[n].get("step", step)),
                 "exp_avg": state.named[n]["exp_avg"],
                 "exp_avg_sq": state.named[n]["exp_avg_sq"]} for n in order}
    template = adam.state_dict()["param_groups"]
    adam.load_state_dict(adam_state_dict(named, state.groups or template, order, template))


def adamw_order(module) -> List[str]:
    """The parameter names in the order the project's AdamW holds them
    (:func:`megatron.optimizer.get_param_groups`: matrices, then biases and norms): the
    order of a checkpoint saved at this layout without names."""
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    return [n for n, p in named if p.dim() > 1] + [n for n, p in named if p.dim() <= 1]


def _set_hyper_parameters(optimizer, groups) -> None:
    if not groups:
        return
    if len(groups) != len(optimizer.param_groups):
        raise CheckpointError(f"the checkpoint has {len(groups)} optimizer param groups, the "
                              f"run {len(optimizer.param_groups)}")
    for saved, group in zip(groups, optimizer.param_groups):
        group.update({k: saved[k] for k in HYPER_PARAMETERS if k in saved})


def _step_of(named):
    first = next(iter(named.values()), {})
    return first.get("step")


def _as_number(step):
    return float(step) if torch.is_tensor(step) else float(step or 0)


def _step_for(step):
    return step.clone() if torch.is_tensor(step) else step

"""How a training backend's optimizer state goes into a checkpoint and comes back.

Each backend carries one of these (``backend.state_io``), so the checkpoint code
(:mod:`.checkpointing`) never asks which backend it has, and the backend itself only trains:

- :class:`OptimizerStateIO` (the DDP backend): our :class:`~megatron.optimizer.MegatronOptimizer`
  over the fp32 parameters; its state goes into the main file, with the parameter names;
- ``EngineStateIO`` (:mod:`.engine_state_io`): a DeepSpeed engine's optimizer, whose state
  each data-parallel rank writes to its own file (ZeRO partitions, fp16/bf16 flat buffers).
"""
from typing import Any, Dict, List, Optional

import torch

from ..checkpoint.layout_change import NamedOptimizerState
from ..checkpoint.optimizer_names import adam_state_dict, param_names
from ..errors import CheckpointError
from ..utils import warn_rank_0


class OptimizerStateIO:
    """The DDP backend's optimizer in a checkpoint (the base of the engines' too).

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
        when the optimizer holds flat partitions instead (DeepSpeed's ZeRO, fp16, bf16)."""
        return self.backend.optimizer.optimizer  # AdamW over the fp32 parameters themselves

    def param_names(self) -> Optional[List[str]]:
        """Names of :meth:`named_optimizer`'s parameters in its state order, or None."""
        named = self.named_optimizer()
        return None if named is None else param_names(self.backend.module(), named)

    def load(self, state: dict) -> None:
        """Restore the optimizer from the main file's ``optimizer`` entry."""
        self.backend.optimizer.load_state_dict(state)

    def load_files(self, paths: List[str]) -> None:
        """Restore a sharded optimizer from every saved data-parallel rank's file of this
        (tp, pp) (``paths`` in rank order; their number is the saved dp size)."""
        raise NotImplementedError

    def counters(self) -> Dict[str, int]:
        """Backend counters saved with a checkpoint."""
        return {}

    def load_counters(self, counters: Dict[str, int]) -> None:
        """Restore :meth:`counters`."""

    def after_weights_only_load(self) -> None:
        """Called when weights were loaded without optimizer state."""

    def load_scaler(self, scaler: dict) -> bool:
        """Restore an fp16 loss scaler saved at another layout (``{"ddp": ...}`` or
        ``{"deepspeed": ...}``); False when this run scales its loss but cannot use it."""
        grad_scaler = self.backend.optimizer.grad_scaler
        if grad_scaler is None:
            return True
        if scaler.get("ddp") is not None:
            grad_scaler.load_state_dict(scaler["ddp"])
            return True
        return not any(v is not None for v in scaler.values())

    def load_named(self, state: NamedOptimizerState) -> None:
        """Restore this rank's optimizer from per-parameter state (another layout's)."""
        names = [n for n, _ in self.backend.module().named_parameters()]
        missing = [n for n in names if n not in state.named]
        if missing:
            raise CheckpointError(f"the checkpoint has no optimizer state for {missing[:3]}")
        self._load_named_state(state)
        if state.scaler and not self.load_scaler(state.scaler):
            warn_rank_0("the fp16 loss scale restarts from --initial-loss-scale (the checkpoint "
                        "was saved by the other training backend)")

    def _load_named_state(self, state):
        load_named_adam(self.named_optimizer(), self.backend.module(), state)


def load_named_adam(adam, module, state: NamedOptimizerState) -> None:
    """Give a torch AdamW over ``module``'s parameters the named moments and step."""
    order = param_names(module, adam)
    step = state.step
    named = {n: {"step": step.clone() if torch.is_tensor(step) else step,
                 "exp_avg": state.named[n]["exp_avg"],
                 "exp_avg_sq": state.named[n]["exp_avg_sq"]} for n in order}
    template = adam.state_dict()["param_groups"]
    adam.load_state_dict(adam_state_dict(named, state.groups or template, order, template))

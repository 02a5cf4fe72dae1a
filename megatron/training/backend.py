"""The training backend: one object, chosen once, that trains the model whatever the path.

:func:`~.backend_factory.build_backend` is the only place that decides how a run trains:

- ``ddp`` and ``pipeline`` (:class:`~.backend_step.StepBackend`): the project's own step,
  the same at every layout (gradient buffers reduced over the data-parallel ranks, the
  replicated or distributed optimizer, autocast over fp32 masters, loss scaling,
  clipping); at pp > 1 tds's pipeline schedule runs the forward and backward passes;
- ``deepspeed`` (``--deepspeed`` at pp 1, :class:`~.backend_engine.EngineBackend`):
  DeepSpeed's engine, which owns precision, ZeRO and the data-parallel reduction.

Both take AdamW (no decay on biases and norms) and the LR schedule with the same settings,
so they take the same steps. The loop (megatron/training/loop.py) and the checkpoints
(checkpointing.py) talk to the backend's small interface (:class:`TrainingBackend`, its
``state_io`` for checkpoints) and never ask which one it is.
"""
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from ..config.run_config import RunConfig
from ..optimizer.learning_rates import AnnealingLR
from ..optimizer import get_param_groups
from ..optimizer.adamw import build_adamw


class TrainingBackend:
    """What the loop and the checkpoints use. Subclasses set the attributes below.

    Attributes:
        name: ``ddp``, ``deepspeed`` or ``pipeline`` (for logs and messages only).
        model: the trained object (DDP-wrapped module or engine), what providers receive.
        optimizer: the optimizer the checkpoints save (ours, or the engine's).
        lr_scheduler: :class:`~megatron.optimizer.learning_rates.AnnealingLR`.
        state_io: how the optimizer state goes into a checkpoint and comes back
            (:class:`~.state_io.OptimizerStateIO`).
    """

    name = "abstract"
    batch_draws = None
    """The run's :class:`~.batch_draws.SeededBatchFn` (None: a provider run's own batch):
    the loop says where the run is, the backend which micro-batch a call is for."""

    def __init__(self, model, optimizer, lr_scheduler, cfg: RunConfig, state_io_class):
        self.model, self.optimizer, self.lr_scheduler, self.cfg = \
            model, optimizer, lr_scheduler, cfg
        self.state_io = state_io_class(self)

    def train_step(self, forward_step_func: Callable, data_iterator: Optional[Iterator]
                   ) -> Tuple[List[Dict[str, Any]], Any, Any]:
        """One optimizer step over the global batch.

        Returns:
            ``(per_micro_batch, updated, grad_norm)``: stats dicts of device tensors,
            False when an fp16 overflow skipped the step, the gradient norm (a device
            tensor, a float, or None when the step was skipped).
        """
        raise NotImplementedError

    def eval_step(self, forward_step_func: Callable,
                  data_iterator: Optional[Iterator]) -> List[Dict[str, Any]]:
        """Forward passes of one global batch; returns the per-micro-batch stats."""
        raise NotImplementedError

    def micro_batch(self, index: int) -> Any:
        """Context of the forward step of micro-batch ``index``: the batch function's draws
        are seeded for it (:mod:`.batch_draws`)."""
        from .batch_draws import micro_batch

        return micro_batch(self.batch_draws, index)

    def train(self) -> None:
        self.model.train()

    def eval(self) -> None:
        self.model.eval()

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    @property
    def loss_scale(self) -> float:
        return 1.0

    def take_back_skipped_steps(self, count: int) -> None:
        """``count`` steps since the last call were skipped on the device (an fp16 overflow
        the step did not read): the loop learns it at log time. The DDP backend advanced its
        LR schedule for them and takes those steps back."""

    def module(self) -> Any:
        """The bare model (no DDP or engine wrapper): what the checkpoints hold."""
        from ..common.utils import unwrap_model

        return unwrap_model(self.model)


def build_optimizer_and_scheduler(module: Any, cfg: RunConfig) -> Tuple[Any, AnnealingLR]:
    """AdamW over ``module``'s parameters (no decay on biases and norms) and the LR schedule,
    for DeepSpeed's engine, which wraps the plain torch optimizer itself.

    Args:
        module: the model whose parameters to optimize.
        cfg: the run configuration (its ``optim`` section).

    Returns:
        ``(optimizer, lr_scheduler)``.
    """
    o = cfg.optim
    adam = build_adamw(get_param_groups([module], o.weight_decay), lr=o.lr,
                       betas=o.adam_betas, eps=o.adam_eps, weight_decay=o.weight_decay)
    lr_scheduler = AnnealingLR(adam, o.lr, o.min_lr, o.lr_warmup_iters, o.lr_decay_iters,
                               o.lr_decay_style)
    return adam, lr_scheduler

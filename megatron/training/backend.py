"""The training backend: one object, chosen once, that trains the model whatever the path.

:func:`build_backend` is the only place that decides how a run trains:

- ``ddp`` (:class:`~.backend_ddp.DDPBackend`): torch DDP over the data-parallel group,
  our AdamW wrapper (autocast over fp32 masters, loss scaling, clipping);
- ``deepspeed`` (``--deepspeed``) and ``pipeline`` (``--pipe-parallel-size`` > 1):
  (:class:`~.backend_engine.EngineBackend`) a DeepSpeed engine, tds's pipeline engine for
  the second, which owns precision, ZeRO and the data-parallel reduction.

Both take the optimizer and LR schedule from :func:`build_optimizer_and_scheduler`, so a
pipeline run and a plain run of the same model take the same steps. The loop
(megatron/training/loop.py) and the checkpoints (checkpointing.py) talk to the backend's
small interface (:class:`TrainingBackend`) and never ask which one it is.
"""
import inspect

from .. import mpu
from ..learning_rates import AnnealingLR
from ..optimizer import MegatronOptimizer, build_grad_scaler, get_param_groups
from ..optimizer.adamw import build_adamw


class TrainingBackend:
    """What the loop and the checkpoints use. Subclasses set the attributes below.

    Attributes:
        name: ``ddp``, ``deepspeed`` or ``pipeline`` (for logs and messages only).
        model: the trained object (DDP-wrapped module or engine), what providers receive.
        optimizer: the optimizer the checkpoints save (ours, or the engine's).
        lr_scheduler: :class:`~megatron.learning_rates.AnnealingLR`.
        shards_optimizer: each data-parallel rank saves its own optimizer file (ZeRO).
    """

    name = "abstract"
    shards_optimizer = False

    def __init__(self, model, optimizer, lr_scheduler, cfg):
        self.model, self.optimizer, self.lr_scheduler, self.cfg = \
            model, optimizer, lr_scheduler, cfg

    def train_step(self, forward_step_func, data_iterator):
        """One optimizer step over the global batch.

        Returns:
            ``(per_micro_batch, updated, grad_norm)``: stats dicts of device tensors,
            False when an fp16 overflow skipped the step, the gradient norm (a device
            tensor, a float, or None when the step was skipped).
        """
        raise NotImplementedError

    def eval_step(self, forward_step_func, data_iterator):
        """Forward passes of one global batch; returns the per-micro-batch stats."""
        raise NotImplementedError

    def train(self):
        self.model.train()

    def eval(self):
        self.model.eval()

    @property
    def lr(self):
        return self.optimizer.param_groups[0]["lr"]

    @property
    def loss_scale(self):
        return 1.0

    def module(self):
        """The bare model (no DDP or engine wrapper): what the checkpoints hold."""
        from ..utils import unwrap_model

        return unwrap_model(self.model)

    def counters(self):
        """Backend-specific counters to save with a checkpoint (a dict of ints)."""
        return {}

    def load_counters(self, counters):
        """Restore :meth:`counters` from a checkpoint."""

    def load_optimizer_state(self, state):
        """Restore the optimizer from ``state`` (the main file's ``optimizer`` entry)."""
        self.optimizer.load_state_dict(state)

    def load_optimizer_files(self, paths):
        """Restore a sharding backend's optimizer from every saved data-parallel rank's file
        of this (tp, pp) (``paths`` in rank order; their number is the saved dp size)."""
        raise NotImplementedError

    def named_optimizer(self):
        """The torch optimizer stepping the model's own parameters (its state is per
        parameter, so a checkpoint can name it and another layout can re-slice it), or None
        when the optimizer holds flat partitions instead (DeepSpeed's ZeRO, fp16, bf16)."""
        return None

    def load_named_optimizer(self, named, step):
        """Restore an optimizer without :meth:`named_optimizer` from per-parameter state
        (``{name: {"fp32", "exp_avg", "exp_avg_sq"}}`` and the step count)."""
        raise NotImplementedError

    def load_scaler_state(self, scaler):
        """Restore the fp16 loss scaler saved by a run at another layout.

        Args:
            scaler: ``{"ddp": our scaler's state}`` or ``{"deepspeed": DeepSpeed's scaler}``
                (either may be None: that run had no loss scaling).

        Returns:
            False when this run scales its loss but cannot use the saved scaler (the other
            backend's), True otherwise.
        """
        return True

    def after_weights_only_load(self):
        """Called when weights were loaded without optimizer state."""


def build_optimizer_and_scheduler(module, cfg, for_engine):
    """AdamW over ``module``'s parameters (no decay on biases and norms) and the LR schedule.

    Args:
        module: the model whose parameters to optimize.
        cfg: the run configuration (its ``optim`` and ``precision`` sections).
        for_engine: a DeepSpeed engine wraps the plain torch optimizer itself (it owns
            precision and clipping); otherwise it is wrapped in :class:`MegatronOptimizer`.

    Returns:
        ``(optimizer, lr_scheduler)``.
    """
    o = cfg.optim
    # fused AdamW on CUDA (also inside DeepSpeed's engine, which steps this optimizer)
    adam = build_adamw(get_param_groups([module], o.weight_decay), lr=o.lr,
                       betas=o.adam_betas, eps=o.adam_eps, weight_decay=o.weight_decay)
    optimizer = adam if for_engine else \
        MegatronOptimizer(adam, build_grad_scaler(cfg.precision), o.clip_grad,
                          cfg.skip_nonfinite_steps)
    lr_scheduler = AnnealingLR(optimizer, o.lr, o.min_lr, o.lr_warmup_iters, o.lr_decay_iters,
                               o.lr_decay_style)
    return optimizer, lr_scheduler


def _call_provider(model_provider, pipeline):
    """``model_provider(pipeline=...)`` when it takes the argument, else Megatron's ``()``."""
    if "pipeline" in inspect.signature(model_provider).parameters:
        return model_provider(pipeline=pipeline)
    return model_provider()


def _report_parameters(model):
    count = sum(p.numel() for p in model.parameters())
    state = mpu.get_parallel_state()
    if state.dp_rank == 0:
        print(f" > number of parameters on (tensor, pipeline) model parallel rank "
              f"({state.tp_rank}, {state.pp_rank}): {count}", flush=True)


def uses_pipeline_engine(pp):
    """Whether ``pp`` pipeline stages train through tds's pipeline engine (with stage-keyed
    checkpoints): the one rule, used by the factory below and the checkpoint writer."""
    return pp > 1


def build_backend(cfg, model_provider):
    """Build the model through ``model_provider`` and the backend that trains it.

    Args:
        cfg: the run configuration.
        model_provider: ``f(pipeline: bool) -> module`` (a tds ``PipelineModule`` when
            ``pipeline``), or Megatron's ``f() -> module``.

    Returns:
        A :class:`TrainingBackend`.
    """
    pipeline = uses_pipeline_engine(cfg.parallel.pp)
    engine = pipeline or cfg.parallel.deepspeed
    if engine:
        from .backend_engine import EngineBackend, attach_deepspeed_comm

        attach_deepspeed_comm(cfg)  # a PipelineModule needs it while it is built
    model = _call_provider(model_provider, pipeline)
    if cfg.get("compile"):  # --compile: regional, each transformer layer in place
        from ..model.compile import compile_layers

        compile_layers(model)
    _report_parameters(model)
    if engine:
        return EngineBackend.build(model, cfg, pipeline)
    from .backend_ddp import DDPBackend

    return DDPBackend.build(model, cfg)

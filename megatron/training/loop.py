"""pretrain(): the generic loop that drives any model.

    pretrain(family=GPT2)                                   # a model family of megatron-tds
    pretrain(train_valid_test_dataset_provider, model_provider, forward_step_func)  # Megatron

A :class:`~megatron.families.ModelFamily` describes its model, batch, loss and datasets once;
Megatron-style providers (for a model of your own) are accepted instead, and win where given:

- ``train_valid_test_dataset_provider([n_train, n_valid, n_test]) -> (train, valid, test)``
- ``model_provider(pipeline) -> torch.nn.Module`` (a ``PipelineModule`` when ``pipeline``;
  Megatron's ``model_provider()`` without the argument works too)
- ``forward_step_func(data_iterator, model) -> (loss, {"lm loss": loss.detach()})``

How a step runs (DDP or a DeepSpeed / tds engine) is the training backend's business
(megatron/training/backend_factory.py); this loop only counts, logs, evaluates and saves.
"""
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .. import mpu
from ..config import build_run_config, settings_check_only
from ..common.global_vars import (get_startup_times, get_tensorboard_writer, get_timers,
                           get_tokenizer)
from ..config.run_config import RunConfig
from ..initialize import initialize_megatron
from ..memory.check import startup_memory_check
from ..observability.startup_times import StartupTimes
from ..common.utils import print_rank_0
from .backend_factory import build_backend
from .checkpointing import load_checkpoint
from .data_iterators import build_train_valid_test_data_iterators, close_iterators
from .divergence import check_pending, check_weights
from ..resilience.fault_tolerance import RunGuard
from ..observability.run_summary import event_file, print_closing_line
from ..observability.training_log import log_evaluation, log_training_step, peaks_line


@dataclass
class TrainState:
    """Progress of a run: what changes while it goes (the run configuration does not)."""

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    skipped_iters: int = 0
    lr: float = 0.0
    loss_scale: float = 1.0
    steps_in_interval: int = 0
    skipped_in_interval: int = 0
    do_train: bool = False
    """The data has a training split (set when the datasets are built)."""
    do_valid: bool = False
    do_test: bool = False
    flops_per_step: float = 0.0
    """Model FLOPs of one step (the family's count; for the log's TFLOP/s and MFU)."""
    losses: list = field(default_factory=list)
    """Per-step data-parallel-averaged ``lm loss`` (floats), in step order."""
    eval_losses: list = field(default_factory=list)
    """``(iteration, validation lm loss)`` pairs."""
    routing_stats: list = field(default_factory=list)
    """MoE runs: per log line, ``{kind: float}`` of the routing statistics since the last
    one (routing losses, dropped tokens, the largest max / mean tokens per expert of a
    layer)."""


def _reduce_stats(per_micro_batch):
    """Average each stat over micro-batches and data-parallel ranks (one all-reduce); {} on
    a pipeline rank that computes no loss (its stats come at log time: :func:`_shared`)."""
    if not per_micro_batch:
        return {}
    names = sorted(per_micro_batch[0])
    local = torch.stack([torch.stack([s[n].detach().float() for s in per_micro_batch]).mean()
                         for n in names])
    group = mpu.get_data_parallel_group()
    if dist.get_world_size(group) > 1:
        dist.all_reduce(local, group=group)
        local /= dist.get_world_size(group)
    return dict(zip(names, local))


def train_step(forward_step_func: Callable, data_iterator: Optional[Iterator],
               backend: Any) -> Tuple[Dict[str, Any], Any, Any]:
    """One optimizer step over the global batch.

    Returns:
        ``(stats, updated, grad_norm)``: stats are device tensors averaged over the global
        batch; ``updated`` is False when an fp16 overflow skipped the step.
    """
    per_micro_batch, updated, grad_norm = backend.train_step(forward_step_func, data_iterator)
    return _reduce_stats(per_micro_batch), updated, grad_norm


def evaluate(forward_step_func: Callable, data_iterator: Optional[Iterator], backend: Any,
             cfg: RunConfig, phase: str = "valid", iteration: int = 0) -> float:
    """Average validation loss over ``--eval-iters`` global batches (``phase`` and
    ``iteration`` seed the batch function's draws: :mod:`.batch_draws`)."""
    backend.eval()
    totals = []
    draws = getattr(backend, "batch_draws", None)
    with torch.no_grad():
        for batch in range(cfg.logging.eval_iters):
            if draws is not None:
                draws.at(phase, iteration, batch)
            per_micro_batch = backend.eval_step(forward_step_func, data_iterator)
            totals.append(_reduce_stats(per_micro_batch)["lm loss"])
    backend.train()
    return float(torch.stack(totals).mean()) if totals else float("nan")


def _count_device_skips(state, pending, backend):
    """Read the skip flags that steps left on the device (fp16 overflows handled there):
    one host read for the interval; count them and let the backend take them back."""
    flags = [p["skipped"] for p in pending if torch.is_tensor(p["skipped"])]
    if not flags:
        return
    skipped = torch.stack(flags).cpu().tolist()  # [n] bools: the interval's one read
    it = iter(skipped)
    for p in pending:
        if torch.is_tensor(p["skipped"]):
            p["skipped"] = next(it)
    count = sum(skipped)
    state.skipped_iters += count
    state.skipped_in_interval += count
    backend.take_back_skipped_steps(count)


_STEP_KEYS = ("grad norm", "skipped")
"""What a pending step holds besides the stats its forward steps returned."""


def _shared(backend, pending):
    """``pending`` with every step's stats on every rank (a pipeline computes them on its
    loss stage: one broadcast for the interval, :meth:`StepBackend.share_stats`)."""
    share = getattr(backend, "share_stats", None)
    if share is None or not pending:
        return pending
    rows = share([{k: v for k, v in p.items() if k not in _STEP_KEYS} for p in pending])
    return [dict(p, **row) for p, row in zip(pending, rows)]


def _flush_interval(cfg: RunConfig, state, pending, backend, timers, writer):
    """Check, record and log the steps since the last log line."""
    pending = _shared(backend, pending)
    _count_device_skips(state, pending, backend)
    check_pending(cfg, state.iteration, pending)
    state.lr = backend.lr
    state.loss_scale = backend.loss_scale
    # [n, k] stats of the interval, on every rank (_shared): one host read for all of them
    names = ["lm loss"] + sorted(k for k in (pending[0] if pending else {})
                                 if k not in _STEP_KEYS and k != "lm loss")
    values = torch.stack([torch.stack([p[n].detach().float().reshape(()) for n in names])
                          for p in pending]).tolist() if pending else []
    losses = [row[0] for row in values]
    state.losses.extend(losses)
    stats = {n: sum(row[i] for row in values) / len(values) for i, n in enumerate(names)} \
        if values else {}
    norms = [p["grad norm"] for p in pending
             if p.get("grad norm") is not None and not p["skipped"]]
    if norms:  # device tensors (the project's step) or floats (DeepSpeed's): read once, here
        stats["grad norm"] = float(sum(norms)) / len(norms)
    routing = _routing(backend)
    if routing is not None:
        state.routing_stats.append(routing)
        stats.update(routing)
    compiled = _interval_compile_seconds(cfg)
    steps_s = max(timers("interval").elapsed() - compiled, 1e-6)  # the steps' time alone
    log_training_step(cfg, state, stats, steps_s, writer, compile_s=compiled)
    state.steps_in_interval = state.skipped_in_interval = 0


def _routing(backend):
    """The interval's MoE routing statistics as floats (None without MoE): the routing
    losses (their mean over the interval's micro-batches), the dropped tokens, and the
    largest max / mean tokens per expert of a layer (collective, at log time)."""
    get = getattr(backend, "routing_stats", None)
    stats = get() if callable(get) else None
    if stats is None:
        return None
    mean = stats["tokens_per_expert_mean"]
    imbalance = torch.where(mean > 0, stats["tokens_per_expert_max"] / mean.clamp(min=1e-12),
                            torch.zeros_like(mean)).max()
    values = torch.stack([stats["load_balancing_loss"], stats["z_loss"],
                          stats["dropped_tokens"], imbalance]).tolist()
    return dict(zip(("load balancing loss", "z loss", "dropped tokens",
                     "expert load max/mean"), values))


def _interval_compile_seconds(cfg: RunConfig):
    """Wall seconds of the log interval in which some rank ran ``torch.compile`` (0 without
    ``--compile``): left out of its step time, tokens/s and MFU (megatron/observability/compile_watch.py)."""
    if not cfg.kernels.compile:
        return 0.0
    from ..observability import compile_watch
    from ..observability.training_log import compile_seconds

    return compile_seconds(cfg, compile_watch.take_spans())


def _first_step_done(cfg: RunConfig, seconds):
    """Record the first step's time (host wall time: no device sync is added to it) and print
    the start-up line (megatron/observability/startup_times.py); with ``--compile`` it names the graphs the
    step compiled and this rank's compile time in it (later steps reuse them; evaluation
    compiles its own at its first call)."""
    label = "first step"
    if cfg.kernels.compile:
        from ..observability import compile_watch
        from ..model.compile import compiled_graph_count

        compile_watch.first_step_done()
        label = (f"first step (includes torch.compile of {compiled_graph_count()} graph(s), "
                 f"{compile_watch.run_seconds():.1f} s)")
    startup = get_startup_times()
    if startup is None:  # train() called outside pretrain()
        print_rank_0(f"> {label}: {seconds:.1f} s")
        return
    startup.phases.append((label, seconds))
    print_rank_0(startup.summary())


def _every(iteration, interval):
    """Whether ``iteration`` is a multiple of an optional ``interval`` (None / 0: never)."""
    return bool(interval) and iteration % interval == 0


def train(forward_step_func: Callable, backend: Any, train_iterator: Optional[Iterator],
          valid_iterator: Optional[Iterator], cfg: RunConfig, state: "TrainState",
          guard: Optional[Any] = None) -> "TrainState":
    """Run steps until ``--train-iters``, logging, evaluating and saving on the way (and
    stopping early when ``guard``, a :class:`~.fault_tolerance.RunGuard`, says so)."""
    guard = guard or RunGuard.inactive(cfg)
    timers, writer = get_timers(), get_tensorboard_writer()
    log, ckpt, iters = cfg.logging, cfg.checkpoint, cfg.batch.train_iters
    backend.train()
    pending = []  # per-step stats since the last log line, still on the device
    timers("interval").start()
    first_step = time.monotonic()  # None once the first step has ended
    draws = getattr(backend, "batch_draws", None)
    while state.iteration < iters:
        if draws is not None:
            draws.at("train", state.iteration)
        stats, updated, grad_norm = train_step(forward_step_func, train_iterator, backend)
        if first_step is not None:
            _first_step_done(cfg, time.monotonic() - first_step)
            first_step = None
        state.iteration += 1
        state.consumed_train_samples += cfg.batch.global_batch_size
        state.steps_in_interval += 1
        # a device flag (fp16 skipped on the device) is counted at log time, not read here
        skipped = ~updated if torch.is_tensor(updated) else not updated
        if skipped is True:
            state.skipped_iters += 1
            state.skipped_in_interval += 1
        pending.append(dict(stats, **{"grad norm": grad_norm, "skipped": skipped}))
        if _every(state.iteration, log.log_interval) or state.iteration == iters:
            _flush_interval(cfg, state, pending, backend, timers, writer)
            pending = []
        stop = guard.step_done(state.iteration)  # a signal stop, agreed by every rank
        if state.do_valid and log.eval_iters and _every(state.iteration, log.eval_interval) \
                and not stop:
            with guard.evaluating(state.iteration):
                loss = evaluate(forward_step_func, valid_iterator, backend, cfg, "valid",
                                state.iteration)
            state.consumed_valid_samples += log.eval_iters * cfg.batch.global_batch_size
            state.eval_losses.append((state.iteration, loss))
            log_evaluation(cfg, state.iteration, "validation", loss, writer)
        if ckpt.save and (_every(state.iteration, ckpt.save_interval) or stop):
            pending = _shared(backend, pending)
            _count_device_skips(state, pending, backend)  # the LR schedule saved is exact
            check_pending(cfg, state.iteration, pending)
            check_weights(cfg, state.iteration, backend.model)
            guard.save(state.iteration, backend, cfg, state)
        if stop or _every(state.iteration, ckpt.exit_interval):
            break
    if pending:
        _flush_interval(cfg, state, pending, backend, timers, writer)
    timers("interval").stop()
    return state


def _providers(family, cfg: RunConfig, dataset_provider, model_provider, forward_step_func):
    """The family's providers where the caller gave none, and the pipeline batch function."""
    if family is None:
        missing = [name for name, given in (("train_valid_test_dataset_provider",
                                             dataset_provider),
                                            ("model_provider", model_provider),
                                            ("forward_step_func", forward_step_func))
                   if given is None]
        if missing:
            raise TypeError(f"pretrain() needs a model family or {', '.join(missing)}")
        return dataset_provider, model_provider, forward_step_func, None
    from .batch_draws import seeded

    tokenizer = get_tokenizer()
    # every call's draws seeded by its place in the run: the same batch on every stage
    batch_fn = seeded(family.make_batch_fn(cfg, tokenizer), cfg)
    if dataset_provider is None:
        def dataset_provider(num_samples):
            print_rank_0(f"> building {family.label or family.name} datasets")
            return family.build_datasets(cfg, tokenizer, num_samples)
    if model_provider is None:
        def model_provider(pipeline=False):
            print_rank_0(f"> building {family.label or family.name} model")
            return family.build_model(cfg, pipeline)
    return (dataset_provider, model_provider,
            forward_step_func or family.forward_step(batch_fn), batch_fn)


def pretrain(train_valid_test_dataset_provider: Optional[Callable] = None,
             model_provider: Optional[Callable] = None,
             forward_step_func: Optional[Callable] = None,
             extra_args_provider: Optional[Callable] = None,
             args_defaults: Optional[Dict[str, Any]] = None,
             argv: Optional[Sequence[str]] = None,
             family: Optional[Any] = None,
             flops_per_step: Optional[Callable[[Any], float]] = None) -> "TrainState":
    """Initialise, build model/optimizer/data, resume, train, evaluate, save.

    Args:
        train_valid_test_dataset_provider: ``f([n_train, n_valid, n_test]) -> datasets``
            (default: the family's datasets).
        model_provider: ``f(pipeline) -> model`` (or Megatron's ``f() -> model``; default:
            the family's model).
        forward_step_func: ``f(data_iterator, model) -> (loss, stats)`` (default: the
            family's batch and loss).
        extra_args_provider: adds flags to the parser.
        args_defaults: defaults the entry script sets (e.g. the tokenizer type).
        argv: flags (default: ``sys.argv[1:]``).
        family: model family (a :class:`~megatron.families.ModelFamily`, or the name of a
            registered one: ``gpt2``, ``t5``): its flags, checks, model, batch, loss,
            datasets and FLOP count; it travels with the run (``cfg.model_family``).
        flops_per_step: ``f(cfg) -> model FLOPs of one step`` for the log's TFLOP/s and MFU
            (default: the family's; with neither, the log says "n/a").

    Returns:
        The final :class:`TrainState` (per-step losses, evaluation losses, iteration); None
        in the launchers' settings check (``MEGATRON_TDS_CHECK_ONLY=1``,
        :mod:`megatron.launch.check`), which only builds the run configuration.
    """
    from ..families import get_family

    family = get_family(family)
    if settings_check_only():  # raises on a problem; no process group, no model
        build_run_config(argv, family, extra_args_provider, args_defaults or {})
        return None
    cfg = initialize_megatron(extra_args_provider, args_defaults or {}, argv, family=family)
    dataset_provider, model_provider, forward_step_func, batch_fn = _providers(
        family, cfg, train_valid_test_dataset_provider, model_provider, forward_step_func)
    if flops_per_step is None and family is not None:
        flops_per_step = family.flops_per_step
    flops = flops_per_step(cfg) if flops_per_step is not None else None
    state = TrainState(flops_per_step=flops or 0.0)
    startup_memory_check(cfg, flops)  # before the model is allocated
    guard = RunGuard(cfg)  # signal stops, --async-save, --step-timeout
    try:
        _run(cfg, guard, state, dataset_provider, model_provider, forward_step_func, batch_fn)
    finally:
        guard.close()
    return state


def _run(cfg: RunConfig, guard, state, dataset_provider, model_provider, forward_step_func,
         batch_fn):
    """Build, resume, train, save, test (the body of :func:`pretrain`)."""
    startup = get_startup_times() or StartupTimes()
    with startup.phase("model, optimizer, engine"):
        backend = build_backend(cfg, model_provider, batch_fn)
    with startup.phase("checkpoint"):
        state.iteration = load_checkpoint(backend, cfg, state)
    with startup.phase("datasets"):
        train_it, valid_it, test_it = build_train_valid_test_data_iterators(
            dataset_provider, cfg, state)
    print_rank_0(f"> training from iteration {state.iteration} to {cfg.batch.train_iters}")
    if peaks_line(cfg):  # an FP8 run: which peaks its two MFU figures divide by
        print_rank_0(peaks_line(cfg))
    start = state.iteration
    train(forward_step_func, backend, train_it, valid_it, cfg, state, guard)
    ckpt = cfg.checkpoint
    if ckpt.save and state.iteration > start and guard.stopped_at is None and \
            not _every(state.iteration, ckpt.save_interval):
        check_weights(cfg, state.iteration, backend.model)
        guard.save(state.iteration, backend, cfg, state)
    if state.do_test and cfg.logging.eval_iters and guard.stopped_at is None:
        with guard.evaluating(state.iteration):
            loss = evaluate(forward_step_func, test_it, backend, cfg, "test", state.iteration)
        log_evaluation(cfg, state.iteration, "test", loss, get_tensorboard_writer())
    guard.finish()  # waits for a background save; says so after a signal stop
    close_iterators((train_it, valid_it, test_it))
    writer = get_tensorboard_writer()
    events = event_file(writer)
    if writer is not None:
        writer.close()  # complete event / W&B run files before returning
    print_closing_line(cfg, state.iteration, events)

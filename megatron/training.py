"""pretrain(): the generic loop that drives any model given its three providers.

    pretrain(train_valid_test_dataset_provider, model_provider, forward_step_func)

- ``train_valid_test_dataset_provider([n_train, n_valid, n_test]) -> (train, valid, test)``
- ``model_provider() -> torch.nn.Module`` (or a ``PipelineModule`` for pipeline runs)
- ``forward_step_func(data_iterator, model) -> (loss, {"lm loss": loss.detach()})``

Each step runs ``--gas`` micro-batches; with torch DDP the data-parallel all-reduce runs
once per step (on the last micro-batch). fp16/bf16 compute uses torch.amp autocast over
fp32 master parameters; fp16 adds a dynamic loss scaler with DeepSpeed's semantics.
"""
import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import mpu
from .checkpointing import load_checkpoint, save_checkpoint
from .data_iterators import build_train_valid_test_data_iterators
from .global_vars import get_tensorboard_writer, get_timers
from .initialize import initialize_megatron
from .model_setup import setup_model_and_optimizer
from .training_log import log_evaluation, log_training_step
from .utils import print_rank_0


@dataclass
class TrainState:
    """Progress of a run (what a checkpoint restores besides weights and optimizer)."""

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    skipped_iters: int = 0
    lr: float = 0.0
    loss_scale: float = 1.0
    steps_in_interval: int = 0
    skipped_in_interval: int = 0
    losses: list = field(default_factory=list)
    """Per-step data-parallel-averaged ``lm loss`` (floats), in step order."""
    eval_losses: list = field(default_factory=list)
    """``(iteration, validation lm loss)`` pairs."""


def autocast(args):
    """autocast to the compute dtype (a no-op in fp32)."""
    if args.compute_dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=mpu.get_device().type, dtype=args.compute_dtype)


def _is_engine(model):
    """A DeepSpeed / tds engine built by megatron.engine_setup."""
    return getattr(model, "megatron_kind", None) is not None


def _reduce_stats(per_micro_batch):
    """Average each stat over micro-batches and data-parallel ranks (one all-reduce)."""
    names = sorted(per_micro_batch[0])
    local = torch.stack([torch.stack([s[n].detach().float() for s in per_micro_batch]).mean()
                         for n in names])
    group = mpu.get_data_parallel_group()
    if dist.get_world_size(group) > 1:
        dist.all_reduce(local, group=group)
        local /= dist.get_world_size(group)
    return dict(zip(names, local))


def train_step(forward_step_func, data_iterator, model, optimizer, lr_scheduler, args):
    """One optimizer step over ``args.gas`` micro-batches.

    Returns:
        ``(stats, updated, grad_norm)``: stats are device tensors averaged over the global
        batch; ``updated`` is False when an fp16 overflow skipped the step.
    """
    if _is_engine(model):
        from .engine_setup import engine_train_step

        per_micro_batch, updated, grad_norm = engine_train_step(forward_step_func,
                                                                data_iterator, model, args)
        return _reduce_stats(per_micro_batch), updated, grad_norm
    optimizer.zero_grad()
    per_micro_batch = []
    for i in range(args.gas):
        last = i == args.gas - 1
        sync = model.no_sync() if hasattr(model, "no_sync") and not last \
            else contextlib.nullcontext()
        with sync:
            with autocast(args):
                loss, stats = forward_step_func(data_iterator, model)
            optimizer.scale_loss(loss / args.gas).backward()
        per_micro_batch.append(stats)
    updated, grad_norm = optimizer.step()
    if updated:
        lr_scheduler.step()
    return _reduce_stats(per_micro_batch), updated, grad_norm


def evaluate(forward_step_func, data_iterator, model, args):
    """Average validation loss over ``--eval-iters`` global batches."""
    model.eval()
    totals = []
    with torch.no_grad():
        for _ in range(args.eval_iters):
            if _is_engine(model):
                from .engine_setup import engine_eval_step

                per_micro_batch = engine_eval_step(forward_step_func, data_iterator, model, args)
            else:
                per_micro_batch = []
                for _ in range(args.gas):
                    with autocast(args):
                        _, stats = forward_step_func(data_iterator, model)
                    per_micro_batch.append(stats)
            totals.append(_reduce_stats(per_micro_batch)["lm loss"])
    model.train()
    return float(torch.stack(totals).mean()) if totals else float("nan")


def _check_finite(args, state, pending):
    """fp32/bf16: a non-finite loss stops the run (fp16 overflows are skipped instead).

    Checked when the interval's losses are read anyway (log line, before a save), so there
    is no extra host sync per step, and a NaN model is never saved.
    """
    if args.compute_dtype == torch.float16 or not pending:
        return
    losses = torch.stack([p["lm loss"] for p in pending])
    if not torch.isfinite(losses).all().item():
        bad = state.iteration - len(pending) + int((~torch.isfinite(losses)).nonzero()[0, 0]) + 1
        raise FloatingPointError(
            f"loss is not finite at iteration {bad} "
            f"({str(args.compute_dtype).replace('torch.', '')}); the last good checkpoint is "
            f"the latest in {args.save or '(no --save directory)'}. Lower --lr, set --clip-grad, "
            f"or check the data")


def _flush_interval(args, state, pending, optimizer, timers, writer):
    """Check, record and log the steps since the last log line."""
    _check_finite(args, state, pending)
    state.lr = optimizer.param_groups[0]["lr"]
    state.loss_scale = getattr(optimizer, "loss_scale", None) or \
        getattr(optimizer, "cur_scale", 1.0)
    losses = [float(x) for x in torch.stack([p["lm loss"] for p in pending])] if pending else []
    state.losses.extend(losses)
    stats = {"lm loss": sum(losses) / len(losses)} if losses else {}
    norms = [p["grad norm"] for p in pending if p.get("grad norm") is not None]
    if norms:
        stats["grad norm"] = sum(norms) / len(norms)
    log_training_step(args, state, stats, timers("interval").elapsed(), writer)
    state.steps_in_interval = state.skipped_in_interval = 0


def train(forward_step_func, model, optimizer, lr_scheduler, train_iterator, valid_iterator,
          args, state):
    """Run steps until ``--train-iters``, logging, evaluating and saving on the way."""
    timers, writer = get_timers(), get_tensorboard_writer()
    model.train()
    pending = []  # per-step stats since the last log line, still on the device
    timers("interval").start()
    while state.iteration < args.train_iters:
        stats, updated, grad_norm = train_step(forward_step_func, train_iterator, model,
                                               optimizer, lr_scheduler, args)
        state.iteration += 1
        state.consumed_train_samples += args.global_batch_size
        state.steps_in_interval += 1
        if not updated:
            state.skipped_iters += 1
            state.skipped_in_interval += 1
        pending.append(dict(stats, **{"grad norm": grad_norm}))
        if state.iteration % args.log_interval == 0 or state.iteration == args.train_iters:
            _flush_interval(args, state, pending, optimizer, timers, writer)
            pending = []
        if args.do_valid and args.eval_iters and state.iteration % args.eval_interval == 0:
            loss = evaluate(forward_step_func, valid_iterator, model, args)
            state.consumed_valid_samples += args.eval_iters * args.global_batch_size
            state.eval_losses.append((state.iteration, loss))
            log_evaluation(args, state.iteration, "validation", loss, writer)
        if args.save and args.save_interval and state.iteration % args.save_interval == 0:
            _check_finite(args, state, pending)
            save_checkpoint(state.iteration, model, optimizer, lr_scheduler, args, state)
        if args.exit_interval and state.iteration % args.exit_interval == 0:
            break
    if pending:
        _flush_interval(args, state, pending, optimizer, timers, writer)
    timers("interval").stop()
    return state


def pretrain(train_valid_test_dataset_provider, model_provider, forward_step_func,
             extra_args_provider=None, args_defaults=None, argv=None):
    """Initialise, build model/optimizer/data, resume, train, evaluate, save.

    Args:
        train_valid_test_dataset_provider: ``f([n_train, n_valid, n_test]) -> datasets``.
        model_provider: ``f() -> model``.
        forward_step_func: ``f(data_iterator, model) -> (loss, stats)``.
        extra_args_provider: adds flags to the parser.
        args_defaults: defaults the entry script sets (e.g. the tokenizer type).
        argv: flags (default: ``sys.argv[1:]``).

    Returns:
        The final :class:`TrainState` (per-step losses, evaluation losses, iteration).
    """
    args = initialize_megatron(extra_args_provider, args_defaults or {}, argv)
    state = TrainState()
    model, optimizer, lr_scheduler = setup_model_and_optimizer(model_provider, args)
    state.iteration = load_checkpoint(model, optimizer, lr_scheduler, args, state)
    train_it, valid_it, test_it = build_train_valid_test_data_iterators(
        train_valid_test_dataset_provider, args, state)
    print_rank_0(f"> training from iteration {state.iteration} to {args.train_iters}")
    start = state.iteration
    train(forward_step_func, model, optimizer, lr_scheduler, train_it, valid_it, args, state)
    if args.save and state.iteration > start and not (
            args.save_interval and state.iteration % args.save_interval == 0):
        save_checkpoint(state.iteration, model, optimizer, lr_scheduler, args, state)
    if args.do_test and args.eval_iters:
        loss = evaluate(forward_step_func, test_it, model, args)
        log_evaluation(args, state.iteration, "test", loss, get_tensorboard_writer())
    return state

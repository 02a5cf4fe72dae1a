"""A resume whose learning-rate schedule differs from the checkpoint's.

The schedule (peak and minimum rate, warmup, decay length and style) follows the flags, as
in a fresh run: a resume with another ``--train-iters`` (which sets the decay length when
``--lr-decay-iters`` is not given), ``--lr-decay-iters``, ``--lr``, ``--min-lr``,
``--warmup`` or ``--lr-decay-style`` changes the learning rate from the next step on. That
is what a user who extends or shortens a run usually wants, so the resume goes on, and says
so in one line: which flags changed and the learning rate of the next step under the new
schedule and under the checkpoint's. (Megatron-LM refuses such a resume unless told; its
``--use-checkpoint-lr-scheduler`` is accepted here and keeps the checkpoint's schedule.)
"""
from typing import Any, Dict, List

from ..config.run_config import RunConfig
from ..optimizer.learning_rates import schedule_lr
from ..common.utils import print_rank_0

#: The schedule's settings in a scheduler's state dict.
SCHEDULE_KEYS = ("max_lr", "min_lr", "warmup_steps", "decay_steps", "decay_style")

#: What sets the schedule: (saved args key, flag as printed, the run configuration's value).
SCHEDULE_SETTINGS = (
    ("train_iters", "--train-iters", lambda cfg: cfg.batch.train_iters),
    ("lr_decay_iters", "--lr-decay-iters", lambda cfg: cfg.optim.lr_decay_iters),
    ("lr", "--lr", lambda cfg: cfg.optim.lr),
    ("min_lr", "--min-lr", lambda cfg: cfg.optim.min_lr),
    ("lr_warmup_iters", "warmup iterations (--warmup)", lambda cfg: cfg.optim.lr_warmup_iters),
    ("lr_decay_style", "--lr-decay-style", lambda cfg: cfg.optim.lr_decay_style),
)


def flag_changes(saved_args: Dict[str, Any], cfg: RunConfig) -> List[str]:
    """``["--train-iters 300 -> 200", ...]``: the schedule settings whose value differs from
    the checkpoint's saved arguments (``--lr-decay-iters`` and the warmup as derived from
    ``--train-iters`` when not given)."""
    changes = []
    for key, flag, value in SCHEDULE_SETTINGS:
        if key in saved_args and saved_args[key] != value(cfg):
            changes.append(f"{flag} {saved_args[key]} -> {value(cfg)}")
    return changes


def schedule_differs(saved: Dict[str, Any], current: Dict[str, Any]) -> bool:
    """Whether two scheduler state dicts describe different schedules."""
    return any(saved.get(key) != current.get(key) for key in SCHEDULE_KEYS)


def resume_schedule(scheduler: Any, state: Dict[str, Any], cfg: RunConfig) -> None:
    """Load the scheduler's step from ``state`` (a checkpoint's main file); print one line when
    the checkpoint's schedule and the flags' differ (every rank loads, rank 0 prints).

    Args:
        scheduler: the run's :class:`~megatron.optimizer.learning_rates.AnnealingLR`.
        state: the checkpoint state (``lr_scheduler``, ``args``, ``iteration``).
        cfg: the run configuration (``cfg.optim.use_checkpoint_lr_scheduler``).
    """
    saved = state["lr_scheduler"]
    keep_saved = cfg.optim.use_checkpoint_lr_scheduler
    if not all(key in saved for key in SCHEDULE_KEYS):
        # A foreign checkpoint (Megatron-LM's reader) records the step count only: the
        # schedule is the flags', and there is no checkpoint schedule to keep or compare.
        scheduler.load_state_dict({"num_steps": saved["num_steps"]})
        if keep_saved:
            print_rank_0("> resume: the checkpoint records no learning-rate schedule (only "
                         "its step count): --use-checkpoint-lr-scheduler has nothing to keep; "
                         "the schedule follows the flags")
        return
    differs = schedule_differs(saved, scheduler.state_dict())
    scheduler.load_state_dict(saved, use_saved_schedule=keep_saved)
    if not differs:
        return
    changed = ", ".join(flag_changes(state.get("args", {}), cfg)) or \
        "the flags that set it"
    steps = int(saved["num_steps"])
    old, new = schedule_lr(saved, steps), schedule_lr(scheduler.state_dict(), steps)
    if keep_saved:
        print_rank_0(f"> resume: the flags change the learning-rate schedule ({changed}); "
                     f"--use-checkpoint-lr-scheduler keeps the checkpoint's: the next step "
                     f"(iteration {steps + 1}) trains at {old:.4E}")
        return
    print_rank_0(f"> resume: the learning-rate schedule changed since the checkpoint "
                 f"({changed}): the next step (iteration {steps + 1}) trains at {new:.4E} "
                 f"instead of the checkpoint schedule's {old:.4E}; pass "
                 f"--use-checkpoint-lr-scheduler to keep the checkpoint's schedule")

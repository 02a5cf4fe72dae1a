"""A resume whose learning-rate schedule differs from the checkpoint's says so and trains on
the flags' schedule; ``--use-checkpoint-lr-scheduler`` keeps the checkpoint's
(megatron/training/schedule_change.py). The rates are checked against the cosine schedule
written out here (Megatron's formula), not against the scheduler under test."""
import math
import os
import re

from gpt2_runs import gpt2_argv
from harness import run_distributed

MAX_LR, MIN_LR, WARMUP = 5e-3, 5e-4, 2  # gpt2_argv's --lr, --min-lr, --warmup (iterations)


def _cosine(step, decay):
    """Megatron's cosine schedule with linear warmup, after ``step`` steps."""
    if step <= WARMUP:
        return MAX_LR * step / WARMUP
    if step > decay:
        return MIN_LR
    ratio = (step - WARMUP) / (decay - WARMUP)
    return MIN_LR + 0.5 * (math.cos(math.pi * ratio) + 1) * (MAX_LR - MIN_LR)


def _three_runs(argv, ckpt, at, first_iters, later_iters):
    """Rank body: train ``first_iters`` stopping at ``at``; resume with ``later_iters``;
    resume the same checkpoint again with --use-checkpoint-lr-scheduler. Returns each
    resumed run's output."""
    import contextlib
    import io

    import pretrain_gpt2

    def run(*flags):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            pretrain_gpt2.main([*argv, "--save", ckpt, "--load", ckpt, *flags])
        return out.getvalue()

    run("--train-iters", str(first_iters), "--exit-interval", str(at))
    changed = run("--train-iters", str(later_iters))
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as handle:
        handle.write(str(at))
    kept = run("--train-iters", str(later_iters), "--use-checkpoint-lr-scheduler")
    return changed, kept


def _logged_lr(text, iteration):
    return float(re.search(rf"iteration\s+{iteration}/.*?learning rate: ([0-9.E+-]+)",
                           text).group(1))


def test_a_changed_train_iters_prints_the_new_rate_or_keeps_the_checkpoints(gpt2_data,
                                                                           tmp_path):
    first, later, at = 12, 8, 5
    argv = gpt2_argv(gpt2_data, "--batch-size", "2", "--log-interval", "1", "--eval-iters",
                     "0")
    changed, kept = run_distributed(_three_runs, 1, argv, str(tmp_path / "ckpt"), at, first,
                                    later, timeout=300)[0]
    line = re.search(r"> resume: the learning-rate schedule changed since the checkpoint "
                     r"\((.*?)\): the next step \(iteration (\d+)\) trains at ([0-9.E+-]+) "
                     r"instead of the checkpoint schedule's ([0-9.E+-]+)", changed)
    assert line, changed
    assert line.group(1) == f"--train-iters {first} -> {later}, --lr-decay-iters {first} -> " \
                            f"{later}"
    assert int(line.group(2)) == at + 1
    new, old = float(line.group(3)), float(line.group(4))
    assert math.isclose(new, _cosine(at, later), rel_tol=1e-4)
    assert math.isclose(old, _cosine(at, first), rel_tol=1e-4) and not math.isclose(new, old)
    for it in range(at + 1, later + 1):  # the run follows the new schedule ...
        assert math.isclose(_logged_lr(changed, it), _cosine(it, later), rel_tol=1e-3), it
    # ... or, asked to, the checkpoint's, saying so
    assert "--use-checkpoint-lr-scheduler keeps the checkpoint's: the next step (iteration " \
           f"{at + 1}) trains at {_cosine(at, first):.4E}" in kept, kept
    for it in range(at + 1, later + 1):
        assert math.isclose(_logged_lr(kept, it), _cosine(it, first), rel_tol=1e-3), it
    assert "> resume:" not in changed.split("> training from")[1]  # said once, at the load


def test_a_checkpoint_with_only_a_step_count_resumes_on_the_flags_schedule(capsys):
    """A Megatron-LM checkpoint's reader carries ``{"num_steps": n}`` only: the resume takes the
    step count and the flags' schedule, with or without --use-checkpoint-lr-scheduler (which
    then says it has nothing to keep)."""
    import random
    from types import SimpleNamespace

    import torch

    from megatron.optimizer.learning_rates import AnnealingLR
    from megatron.training.schedule_change import resume_schedule

    steps, decay = random.randint(3, 9), random.randint(12, 40)
    for keep in (False, True):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        scheduler = AnnealingLR(optimizer, MAX_LR, MIN_LR, WARMUP, decay, "cosine")
        cfg = SimpleNamespace(optim=SimpleNamespace(use_checkpoint_lr_scheduler=keep))
        resume_schedule(scheduler, {"lr_scheduler": {"num_steps": steps}}, cfg)
        assert scheduler.num_steps == steps
        assert math.isclose(optimizer.param_groups[0]["lr"], _cosine(steps, decay), rel_tol=1e-12)
        assert ("nothing to keep" in capsys.readouterr().out) == keep

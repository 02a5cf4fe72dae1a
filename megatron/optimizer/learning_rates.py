"""Learning-rate schedule: linear warmup, then constant / linear / cosine decay to min-lr."""
import math


class AnnealingLR:
    """Sets the optimizer's lr from the number of steps taken (Megatron's schedule).

    lr(n) = max_lr * n / warmup               for n <= warmup (warmup > 0)
          = min_lr + c(n) * (max_lr - min_lr)  up to decay_steps, then min_lr,
    with c = 1 - r (linear) or (1 + cos(pi r)) / 2 (cosine), r = (n - warmup)/(decay - warmup).

    Args:
        optimizer: has ``param_groups``.
        max_lr, min_lr: peak and final learning rate.
        warmup_steps: linear warmup length.
        decay_steps: step at which min_lr is reached.
        decay_style: "constant", "linear" or "cosine".
    """

    def __init__(self, optimizer, max_lr, min_lr, warmup_steps, decay_steps, decay_style):
        if decay_style not in ("constant", "linear", "cosine"):
            raise ValueError(f"unknown lr decay style {decay_style!r}")
        self.optimizer = optimizer
        self.max_lr, self.min_lr = float(max_lr), float(min_lr)
        self.warmup_steps, self.decay_steps = int(warmup_steps), max(int(decay_steps), 1)
        self.decay_style = decay_style
        self.num_steps = 0
        self.step(0)

    def get_lr(self):
        return schedule_lr(self.state_dict())

    def step(self, increment=1):
        self.num_steps += increment
        lr = self.get_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def state_dict(self):
        return {"num_steps": self.num_steps, "max_lr": self.max_lr, "min_lr": self.min_lr,
                "warmup_steps": self.warmup_steps, "decay_steps": self.decay_steps,
                "decay_style": self.decay_style}

    def load_state_dict(self, state, use_saved_schedule=False):
        """Resume the step count. The schedule itself comes from the current flags, or with
        ``use_saved_schedule`` from ``state`` (Megatron's ``--use-checkpoint-lr-scheduler``).
        """
        if use_saved_schedule:
            self.max_lr, self.min_lr = float(state["max_lr"]), float(state["min_lr"])
            self.warmup_steps = int(state["warmup_steps"])
            self.decay_steps = max(int(state["decay_steps"]), 1)
            self.decay_style = state["decay_style"]
        self.num_steps = 0
        self.step(int(state["num_steps"]))


def schedule_lr(schedule, num_steps=None):
    """The learning rate of a schedule (an :meth:`AnnealingLR.state_dict`) after
    ``num_steps`` steps (default: the schedule's own ``num_steps``)."""
    n = schedule["num_steps"] if num_steps is None else num_steps
    max_lr, min_lr = float(schedule["max_lr"]), float(schedule["min_lr"])
    warmup, decay = int(schedule["warmup_steps"]), max(int(schedule["decay_steps"]), 1)
    if warmup > 0 and n <= warmup:
        return max_lr * n / warmup
    if schedule["decay_style"] == "constant":
        return max_lr
    if n > decay:
        return min_lr
    ratio = (n - warmup) / max(decay - warmup, 1)
    coeff = 1.0 - ratio if schedule["decay_style"] == "linear" else \
        0.5 * (math.cos(math.pi * ratio) + 1.0)
    return min_lr + coeff * (max_lr - min_lr)

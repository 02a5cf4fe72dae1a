"""Loss scalers for fp16 training, with DeepSpeed's dynamic-scaling semantics.

Dynamic (``--loss-scale 0``): start at ``2**initial_scale_power``. On an overflow the step
is skipped; the scale is halved once ``hysteresis`` overflows have been absorbed (the
hysteresis budget is refilled only after a full window without overflow). The scale doubles
once ``loss_scale_window`` clean steps have followed the first clean step after an overflow
(or the start), and again every window after that: DeepSpeed's counting, to the step.
The scale never drops below ``min_loss_scale``. The state lives on the gradients' device
and is updated there (no host read per step); ``scale`` reads it for logs and checkpoints.
"""


import torch


def _flag(found_inf, device):
    """``found_inf`` (a bool or a device tensor) as a 0-dim bool tensor on ``device``."""
    if torch.is_tensor(found_inf):
        return found_inf.reshape(()).to(device) > 0
    return torch.tensor(bool(found_inf), device=device)


class ConstantGradScaler:
    """A fixed loss scale (``--loss-scale S``); overflowing steps are still skipped."""

    def __init__(self, scale):
        self.scale_tensor = torch.tensor(float(scale))

    @property
    def scale(self):
        """The scale as a float (a host read: for logs and checkpoints)."""
        return float(self.scale_tensor)

    def to(self, device):
        """Keep the scale on ``device`` (where the gradients are), so no step reads it."""
        self.scale_tensor = self.scale_tensor.to(device)
        return self

    def update(self, found_inf):
        pass

    def state_dict(self):
        return {"scale": self.scale}

    def load_state_dict(self, state):
        self.scale_tensor.fill_(float(state["scale"]))


class DynamicGradScaler:
    """Dynamic loss scale, its state on the device: :meth:`update` takes the overflow flag
    as a device tensor and decides with ``torch.where``, so a step never waits to read it.

    Args:
        initial_scale: starting scale (DeepSpeed: ``2 ** initial_scale_power``).
        min_scale: floor for the scale.
        window: clean steps since the last overflow before the scale grows.
        hysteresis: overflows absorbed before the scale is lowered.
        factor: growth / backoff factor (2 in DeepSpeed).
    """

    def __init__(self, initial_scale, min_scale=1.0, window=1000, hysteresis=2, factor=2.0):
        self.min_scale = float(min_scale)
        self.window = int(window)
        self.hysteresis = int(hysteresis)
        self.factor = float(factor)
        self.scale_tensor = torch.tensor(float(initial_scale))  # fp32, 0-dim
        self._hysteresis_left = torch.tensor(self.hysteresis)    # int64, 0-dim
        self._clean_steps = torch.tensor(0)

    @property
    def scale(self):
        """The scale as a float (a host read: for logs and checkpoints)."""
        return float(self.scale_tensor)

    def to(self, device):
        """Keep the state on ``device`` (where the gradients are), so no step reads it."""
        self.scale_tensor, self._hysteresis_left, self._clean_steps = (
            t.to(device) for t in (self.scale_tensor, self._hysteresis_left, self._clean_steps))
        return self

    def update(self, found_inf):
        """Record one step's outcome (``found_inf``: the gradients overflowed; a bool or a
        tensor, non-zero for an overflow), with DeepSpeed's counting."""
        inf = _flag(found_inf, self.scale_tensor.device)
        clean = torch.where(inf, torch.zeros_like(self._clean_steps), self._clean_steps + 1)
        stable = clean - 1
        grow = ~inf & (stable > 0) & (stable % self.window == 0)
        # an overflow lowers the scale once the hysteresis budget is spent, else spends it
        shrink = inf & (self._hysteresis_left <= 1)
        hysteresis_left = torch.where(
            inf & ~shrink, self._hysteresis_left - 1,
            torch.where(grow, torch.full_like(self._hysteresis_left, self.hysteresis),
                        self._hysteresis_left))
        scale = torch.where(shrink, (self.scale_tensor / self.factor).clamp(min=self.min_scale),
                            torch.where(grow, self.scale_tensor * self.factor,
                                        self.scale_tensor))
        self.scale_tensor, self._hysteresis_left, self._clean_steps = \
            scale, hysteresis_left, clean

    def state_dict(self):
        return {"scale": self.scale, "hysteresis_left": int(self._hysteresis_left),
                "clean_steps": int(self._clean_steps)}

    def load_state_dict(self, state):
        self.scale_tensor.fill_(float(state["scale"]))
        self._hysteresis_left.fill_(int(state["hysteresis_left"]))
        self._clean_steps.fill_(int(state["clean_steps"]))


def build_grad_scaler(precision):
    """The scaler a :class:`~megatron.config.PrecisionConfig` asks for: None outside fp16."""
    if not precision.fp16:
        return None
    if precision.loss_scale > 0:
        return ConstantGradScaler(precision.loss_scale)
    return DynamicGradScaler(2.0 ** precision.initial_scale_power, precision.min_loss_scale,
                             precision.loss_scale_window, precision.hysteresis)

"""Loss scalers for fp16 training, with DeepSpeed's dynamic-scaling semantics.

Dynamic (``--loss-scale 0``): start at ``2**initial_scale_power``. On an overflow the step
is skipped; the scale is halved once ``hysteresis`` overflows have been absorbed (the
hysteresis budget is refilled only after a full window without overflow). The scale doubles
once ``loss_scale_window`` clean steps have followed the first clean step after an overflow
(or the start), and again every window after that: DeepSpeed's counting, to the step.
The scale never drops below ``min_loss_scale``.
"""


class ConstantGradScaler:
    """A fixed loss scale (``--loss-scale S``); overflowing steps are still skipped."""

    def __init__(self, scale):
        self.scale = float(scale)

    def update(self, found_inf):
        pass

    def state_dict(self):
        return {"scale": self.scale}

    def load_state_dict(self, state):
        self.scale = float(state["scale"])


class DynamicGradScaler:
    """Dynamic loss scale.

    Args:
        initial_scale: starting scale (DeepSpeed: ``2 ** initial_scale_power``).
        min_scale: floor for the scale.
        window: clean steps since the last overflow before the scale grows.
        hysteresis: overflows absorbed before the scale is lowered.
        factor: growth / backoff factor (2 in DeepSpeed).
    """

    def __init__(self, initial_scale, min_scale=1.0, window=1000, hysteresis=2, factor=2.0):
        self.scale = float(initial_scale)
        self.min_scale = float(min_scale)
        self.window = int(window)
        self.hysteresis = int(hysteresis)
        self.factor = float(factor)
        self._hysteresis_left = self.hysteresis
        self._clean_steps = 0

    def update(self, found_inf):
        """Record one step's outcome (``found_inf``: the gradients overflowed)."""
        if found_inf:
            self._clean_steps = 0
            if self._hysteresis_left <= 1:
                self.scale = max(self.scale / self.factor, self.min_scale)
            else:
                self._hysteresis_left -= 1
            return
        self._clean_steps += 1
        stable = self._clean_steps - 1
        if stable > 0 and stable % self.window == 0:
            self._hysteresis_left = self.hysteresis
            self.scale *= self.factor

    def state_dict(self):
        return {"scale": self.scale, "hysteresis_left": self._hysteresis_left,
                "clean_steps": self._clean_steps}

    def load_state_dict(self, state):
        self.scale = float(state["scale"])
        self._hysteresis_left = int(state["hysteresis_left"])
        self._clean_steps = int(state["clean_steps"])


def build_grad_scaler(precision):
    """The scaler a :class:`~megatron.config.PrecisionConfig` asks for: None outside fp16."""
    if not precision.fp16:
        return None
    if precision.loss_scale > 0:
        return ConstantGradScaler(precision.loss_scale)
    return DynamicGradScaler(2.0 ** precision.initial_scale_power, precision.min_loss_scale,
                             precision.loss_scale_window, precision.hysteresis)

"""Training: the loop (loop.py), the backend that runs a step (backend*.py), checkpoints,
the data iterators and the log line.

    from megatron.training import pretrain
"""
_LOOP_NAMES = ("TrainState", "evaluate", "pretrain", "train", "train_step")


def __getattr__(name):
    # Lazy, so that light modules (checkpoint paths, used by the conversion tools) load
    # without the whole training stack.
    if name in _LOOP_NAMES:
        from . import loop

        return getattr(loop, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = list(_LOOP_NAMES)

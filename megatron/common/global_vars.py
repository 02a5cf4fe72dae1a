"""The run's shared objects (args, tokenizer, timers, TensorBoard writer), set once.

Megatron-style providers call ``get_args()`` / ``get_tokenizer()``; keeping all of it in
one object set by ``initialize_megatron`` (instead of a module global per item) makes the
state explicit and easy to reset between runs in one process (tests).
"""
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:  # megatron.config sits above this module
    from ..config.run_config import RunConfig


@dataclass
class RunGlobals:
    args: Optional["RunConfig"] = None
    """The frozen :class:`~megatron.config.RunConfig`."""
    tokenizer: Any = None
    """Tokenizer built with the run configuration."""
    timers: Any = None
    """``megatron.common.timers.Timers``."""
    tensorboard_writer: Optional[Any] = None
    """SummaryWriter on the rank that logs (the last), else None."""
    startup_times: Optional[Any] = None
    """:class:`~megatron.observability.startup_times.StartupTimes` of the run's start-up phases."""


_GLOBALS = RunGlobals()


def set_globals(**values):
    for key, value in values.items():
        if not hasattr(_GLOBALS, key):
            raise AttributeError(f"unknown run global {key!r}")
        setattr(_GLOBALS, key, value)


def reset_globals():
    global _GLOBALS
    _GLOBALS = RunGlobals()


def _get(name):
    value = getattr(_GLOBALS, name)
    if value is None:
        raise RuntimeError(f"{name} is not set: call megatron.initialize.initialize_megatron() "
                           f"(or megatron.training.pretrain()) first")
    return value


def get_args() -> "RunConfig":
    return _get("args")


def get_tokenizer():
    return _get("tokenizer")


def get_timers():
    return _get("timers")


def get_startup_times():
    """The run's :class:`~megatron.observability.startup_times.StartupTimes`, or None outside a run."""
    return _GLOBALS.startup_times


def get_tensorboard_writer():
    """The SummaryWriter, or None on ranks that do not log (or without --tensorboard-dir)."""
    return _GLOBALS.tensorboard_writer

"""User-facing errors, and how entry scripts turn them into an exit code.

Library code raises; only entry scripts (``pretrain_*.py``, ``tools/*.py``) exit. An error a
user can fix (a bad flag, a missing file, sizes that do not divide) is raised as one of the
classes below (all ``ValueError``s) with a message that says what is wrong and how to fix it.
:func:`run_main` prints such a message on one line and exits with status 2; anything else is
a bug and keeps its traceback.
"""
import functools
import sys


class MegatronError(ValueError):
    """Bad input a user can fix; the message says what and how."""


class ConfigError(MegatronError):
    """Inconsistent or invalid flags / config file."""


class DataError(MegatronError):
    """Missing or malformed data, vocabulary or tokenizer files."""


class CheckpointError(MegatronError):
    """A checkpoint that is missing, incomplete or made for another model."""


#: Exit status for a user error (argparse uses 2 as well).
USER_ERROR_EXIT = 2

_USER_ERRORS = (MegatronError, FileNotFoundError, NotADirectoryError, IsADirectoryError)


def run_main(main, *args, **kwargs):
    """Call ``main``; print a user error as ``error: <message>`` and exit with status 2."""
    try:
        return main(*args, **kwargs)
    except _USER_ERRORS as exc:
        rank = _rank_prefix()
        print(f"{rank}error: {exc}", file=sys.stderr, flush=True)
        sys.exit(USER_ERROR_EXIT)


def entry_point(main):
    """Decorator form of :func:`run_main` for a script's ``main()``."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        return run_main(main, *args, **kwargs)

    return wrapper


def _rank_prefix():
    if "torch.distributed" not in sys.modules:  # never initialised; importing torch costs ~1.5s
        return ""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return f"[rank {dist.get_rank()}] "
    except Exception:
        pass
    return ""

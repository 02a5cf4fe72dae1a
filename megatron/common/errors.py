"""User-facing errors, and how entry scripts turn them into an exit code.

Library code raises; only entry scripts (``pretrain_*.py``, ``tools/*.py``) exit. An error a
user can fix (a bad flag, a missing file, sizes that do not divide) is raised as one of the
classes below (all ``ValueError``s) with a message that says what is wrong and how to fix it.
:func:`run_main` prints such a message on one line and exits with status 2; anything else is
a bug and keeps its traceback.
"""
import atexit
import functools
import gc
import os
import sys
import time


class MegatronError(ValueError):
    """Bad input a user can fix; the message says what and how."""


class ConfigError(MegatronError):
    """Inconsistent or invalid flags / config file."""


class DataError(MegatronError):
    """Missing or malformed data, vocabulary or tokenizer files."""


class CheckpointError(MegatronError):
    """A checkpoint that is missing, incomplete or made for another model."""


class CheckpointDigestError(CheckpointError):
    """A checkpoint whose bytes its manifest does not vouch for: a file whose digest or size
    differs from the recorded one, a listed file that is missing, a file the manifest does
    not list, or a manifest that cannot be read (megatron/checkpoint/manifest.py)."""


class WillNotFitError(MegatronError):
    """A run the memory model predicts will not fit in the device's free memory."""


class DivergenceError(MegatronError):
    """fp32/bf16 training produced a non-finite loss, gradient norm or weight."""


def not_text(path, exc, hint, error_type=DataError):
    """The clear error for a file that should be UTF-8 text but is not (binary garbage,
    another encoding).

    Args:
        path: the file.
        exc: the ``UnicodeDecodeError`` raised while reading it.
        hint: what the file should be, e.g. "--merge-file must be a GPT-2 merges.txt".
        error_type: the error class to return.
    """
    return error_type(f"{path} is not UTF-8 text (undecodable byte at offset {exc.start}); "
                      f"{hint}")


#: Exit status for a user error (argparse uses 2 as well).
USER_ERROR_EXIT = 2

_USER_ERRORS = (MegatronError, FileNotFoundError, NotADirectoryError, IsADirectoryError)


#: Exit status of a rank that stops because another rank died (killed, crashed).
PEER_LOST_EXIT = 3

#: Exit status after Ctrl-C during start-up (the shell's 128 + SIGINT).
INTERRUPTED_EXIT = 130

# How gloo / NCCL / the TCP store say that the other end of a collective has gone away.
_PEER_LOST_SIGNS = ("Connection closed by peer", "Connection reset by peer",
                    "remote worker crash", "Broken pipe", "remote process exited")


def run_main(main, *args, **kwargs):
    """Call ``main``; print a user error as ``error: <message>`` and exit with status 2.

    A rank whose peer died (``kill -9`` of one rank, an out-of-memory kill) prints one line
    saying so and exits with status 3, instead of a traceback from inside the collective.
    Ctrl-C before the stop handler is armed (start-up; afterwards ``--exit-signal-handler``
    saves) prints one line and exits 130.
    """
    _line_buffered_output()
    _skip_the_final_collection()
    try:
        return main(*args, **kwargs)
    except _USER_ERRORS as exc:
        rank = _rank_prefix()
        print(f"{rank}error: {exc}", file=sys.stderr, flush=True)
        _let_peers_report()
        sys.exit(USER_ERROR_EXIT)
    except KeyboardInterrupt:  # Ctrl-C before the stop handler took over (start-up)
        print(f"{_rank_prefix()}interrupted (Ctrl-C) before the first step ended: nothing to "
              f"save", file=sys.stderr, flush=True)
        sys.exit(INTERRUPTED_EXIT)
    except RuntimeError as exc:
        if not _peer_lost(exc):
            raise
        first = str(exc).strip().splitlines()[0][:300]
        print(f"{_rank_prefix()}error: another rank stopped (killed or crashed; its own log "
              f"says why), so this one stops too: {first}", file=sys.stderr, flush=True)
        sys.exit(PEER_LOST_EXIT)


def _freeze_at_exit():
    gc.freeze()


def _skip_the_final_collection():
    """At exit, after every other exit handler (registered first, it runs last):
    ``gc.freeze()``, so the interpreter's final garbage collections skip what the run leaves
    (2.5 s of a one-process training run's exit on a busy CPU, 8 s per process when 8 share
    2 cores; docs/measurements/fault_tolerance.md). Files and process groups are closed by then (the run closes
    them, or their own exit handlers); the memory goes back with the process."""
    atexit.unregister(_freeze_at_exit)  # once, however often run_main is called
    atexit.register(_freeze_at_exit)


def _line_buffered_output():
    """Each printed line reaches a pipe (the run scripts' log tee, a job's output file) as it
    is printed, in one write: lines neither wait in a block buffer nor interleave with
    another rank's. Unbuffered (``PYTHONUNBUFFERED``, ``-u``) Python writes a print's pieces
    and its newline separately; ``write_through=False`` gathers a line before writing."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(line_buffering=True, write_through=False)
        except (AttributeError, ValueError):  # not a TextIOWrapper (captured by a caller)
            pass


#: Seconds a rank that stops on a user error waits for the other ranks to print theirs.
REPORT_WAIT_S = 10.0
_REPORTED_KEY = "megatron_tds/user_error_reported"


def _let_peers_report():
    """Wait (at most :data:`REPORT_WAIT_S`) until every rank has printed its error line.

    torchrun ends every rank as soon as one exits: without this, the ranks that reached the
    same error (a bad flag, an agreed failure, :mod:`megatron.resilience.agreement`) a few
    milliseconds later are stopped before they print it. Each rank counts itself in the
    job's rendezvous store and exits once all have; a rank that failed alone exits after
    the bound. Nothing is waited for without a store (one process, or a launcher without
    torchrun's agent before torch.distributed starts).
    """
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    store = _job_store() if world > 1 else None
    if store is None:
        return
    try:
        store.add(_REPORTED_KEY, 1)
        deadline = time.monotonic() + REPORT_WAIT_S
        while store.add(_REPORTED_KEY, 0) < world and time.monotonic() < deadline:
            time.sleep(0.05)
    except Exception:  # the store is gone (the job is ending): nothing to wait for
        pass


def _job_store():
    """The job's key-value store: torch.distributed's, or torchrun's agent store before
    torch.distributed started; None without either."""
    if "torch.distributed" in sys.modules:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            from torch.distributed import distributed_c10d

            return distributed_c10d._get_default_store()  # private; read only here
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return None
    try:
        from datetime import timedelta

        import torch.distributed as dist

        return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                             is_master=False, timeout=timedelta(seconds=5))
    except Exception:
        return None


def _peer_lost(exc):
    if "torch.distributed" not in sys.modules:
        return False
    import torch.distributed as dist

    network_error = getattr(dist, "DistNetworkError", ())
    return isinstance(exc, network_error) or any(sign in str(exc) for sign in _PEER_LOST_SIGNS)


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

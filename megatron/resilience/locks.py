"""Locks and temporary files that a killed process cannot turn into a hang.

- :func:`owned_lock`: an exclusive ``flock`` on a file. The kernel drops it when its owner
  dies, so a killed builder never leaves it held; the owner (host, pid, start time) is
  written into the file so a waiter can say whom it waits for. Waiting is bounded
  (``MEGATRON_TDS_LOCK_WAIT_S``, default 300 s): past the bound it raises
  :class:`LockTimeout`, and the callers fall back (PyTorch paths instead of kernels).
- :func:`remove_stale_baton`: torch's cpp_extension marks a build with a ``lock`` file
  (its "baton") and waits, forever, for it to disappear. A build killed mid-way leaves it.
  Under our lock no other builder of the folder is alive, so a baton found there is stale;
  but the killed builder's ninja and compiler outlive it, still writing into the folder, so
  those are waited for first (bounded like the lock): building alongside them, two writers
  of one object file, leaves a broken module in the cache.
- :func:`tmp_name` / :func:`remove_stale_tmps`: temporary names carry host and pid, so the
  leftovers of a dead process on this host can be recognised and removed.
"""
import contextlib
import fcntl
import glob
import logging
import os
import socket
import time

logger = logging.getLogger(__name__)

#: Default bound on waiting for a lock held by another live process, in seconds.
DEFAULT_WAIT_S = 300.0
#: After this long, say once what we wait for.
NOTICE_S = 10.0


class LockTimeout(TimeoutError):
    """Waited longer than the bound for a lock another process holds."""


def _owner_text():
    return f"host {socket.gethostname()} pid {os.getpid()} since {time.strftime('%H:%M:%S')}"


def _read_owner(fd):
    try:
        return os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "unknown owner"
    except OSError:
        return "unknown owner"


def wait_bound_s():
    """The bound on waiting for a lock (``MEGATRON_TDS_LOCK_WAIT_S``)."""
    try:
        return float(os.environ.get("MEGATRON_TDS_LOCK_WAIT_S", DEFAULT_WAIT_S))
    except ValueError:
        return DEFAULT_WAIT_S


@contextlib.contextmanager
def owned_lock(path, what="a build", wait_s=None):
    """Hold an exclusive lock on ``path`` (created if needed) for the block.

    Args:
        path: the lock file (a ``pathlib.Path`` or str).
        what: words for the log line, e.g. "the fused CPU kernels build".
        wait_s: bound on the wait (default :func:`wait_bound_s`).

    Raises:
        LockTimeout: the lock stayed held by a live process for longer than the bound.
    """
    path = str(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    bound = wait_bound_s() if wait_s is None else wait_s
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _acquire(fd, path, what, bound)
        os.ftruncate(fd, 0)
        os.pwrite(fd, _owner_text().encode(), 0)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _wait_until(done, bound, timeout_message, notice):
    """Poll ``done()`` every 0.2 s until it is true; ``notice()`` once after NOTICE_S (or half
    the bound); :class:`LockTimeout` with ``timeout_message(waited)`` after ``bound`` seconds."""
    start, told = time.monotonic(), False
    while not done():
        waited = time.monotonic() - start
        if waited >= bound:
            raise LockTimeout(timeout_message(waited))
        if not told and waited >= min(NOTICE_S, bound / 2):
            notice()
            told = True
        time.sleep(0.2)


def _try_lock(fd):
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _acquire(fd, path, what, bound):
    _wait_until(
        lambda: _try_lock(fd), bound,
        lambda waited: (f"waited {waited:.0f}s for {path} ({_read_owner(fd)}) to be released; "
                        f"remove it if that process is stuck, or raise MEGATRON_TDS_LOCK_WAIT_S"),
        lambda: logger.warning("%s waits for %s, held by %s (giving up after %.0fs)", what,
                               path, _read_owner(fd), bound))


def processes_in(directory):
    """Live processes of this host working in ``directory`` or below it: their pids, sorted.

    Read from ``/proc/PID/cwd`` (Linux; elsewhere, and for other users' processes, none are
    found). The ninja and compilers of a build run there.
    """
    target = os.path.realpath(str(directory))
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    found = []
    for entry in entries:
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cwd = os.readlink(f"/proc/{entry}/cwd")
        except OSError:  # gone, a zombie, or not ours to read
            continue
        if cwd == target or cwd.startswith(target + os.sep):
            found.append(int(entry))
    return sorted(found)


def _describe(pids):
    names = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/comm") as f:
                names.append(f"{pid} ({f.read().strip()})")
        except OSError:
            names.append(str(pid))
    return ", ".join(names)


def wait_for_leftover_processes(directory, wait_s=None):
    """Wait until no process works in ``directory`` (see :func:`processes_in`).

    Call it under our lock, where such processes are leftovers of a killed builder (its
    ninja and compilers: a SIGKILL of the Python process does not reach them).

    Args:
        directory: the build folder.
        wait_s: bound on the wait (default :func:`wait_bound_s`).

    Raises:
        LockTimeout: some are still running after the bound.
    """
    bound = wait_bound_s() if wait_s is None else wait_s
    pids = []

    def none_left():
        pids[:] = processes_in(directory)
        return not pids

    _wait_until(
        none_left, bound,
        lambda waited: (f"processes {_describe(pids)} left by a killed build still run in "
                        f"{directory} after {waited:.0f}s; end them, or raise "
                        f"MEGATRON_TDS_LOCK_WAIT_S"),
        lambda: logger.warning("waiting for %s, left running in %s by a build that was killed "
                               "(giving up after %.0fs)", _describe(pids), directory, bound))


def remove_stale_baton(directory, name="lock", wait_s=None):
    """Remove torch cpp_extension's baton file in ``directory``; call it under our lock.

    First waits (bounded) for processes the killed build left running in ``directory``
    (:func:`wait_for_leftover_processes`): they would write the same files as the new build.

    Returns:
        True when a stale baton was found (and removed).

    Raises:
        LockTimeout: the killed build's processes are still running after the bound.
    """
    baton = os.path.join(str(directory), name)
    if not os.path.exists(baton):
        return False
    wait_for_leftover_processes(directory, wait_s)
    logger.warning("removing %s, left by a kernel build that was killed", baton)
    with contextlib.suppress(FileNotFoundError):
        os.remove(baton)
    return True


def tmp_name(path):
    """A temporary name next to ``path`` that says which process writes it."""
    return f"{path}.tmp-{socket.gethostname()}-{os.getpid()}"


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def remove_stale_tmps(path):
    """Remove ``tmp_name(path)`` files left by dead processes of this host.

    Files of other hosts (a shared filesystem) are left alone: their owner cannot be checked.
    """
    host = socket.gethostname()
    for leftover in glob.glob(glob.escape(str(path)) + ".tmp-*"):
        owner = leftover.rsplit(".tmp-", 1)[1]
        owner_host, _, pid = owner.rpartition("-")
        if owner_host == host and pid.isdigit() and int(pid) != os.getpid() and \
                not _alive(int(pid)):
            with contextlib.suppress(OSError):
                os.remove(leftover)

"""The suite on every core with pytest-xdist: the default, the worker count, what workers share.

- :func:`default_to_parallel`: a plain ``python -m pytest`` runs as ``-n auto --dist
  loadgroup`` when pytest-xdist is installed. It is set here, not in pytest.ini's addopts, so
  that ``-p no:xdist`` (and an environment without pytest-xdist) still runs serially instead of
  failing on an unknown ``-n``; ``-n 0`` runs serially too.
- :func:`auto_workers`: ``-n auto`` is one worker per core this process may use (CPU affinity
  and a container's CPU quota, not the host's core count), fewer when memory is short. Most
  tests start several processes, so one worker per core already keeps every core busy.
- :class:`MarkedGroupScheduling`: ``--dist loadgroup`` keeps the tests of one
  ``xdist_group`` on one worker; here also the tests that use a module-scoped fixture of
  their module (built once per worker: so, once per run). pytest-xdist 3.8 tells its scheduler
  a test's group by appending it to the test's id, which pytest 9.2 no longer lets it change
  (so the groups are silently ignored: pytest-dev/pytest-xdist#1386); here the workers write
  each test's group to the run's folder instead, where the scheduler reads it.
- :func:`once_per_run`: a session fixture is built once per worker; the expensive ones (a
  training run) are built once per run and shared through the run's folder.
- :class:`Neighbours`: a test marked ``alone`` runs while no other test runs, on this machine:
  its locks live in a folder every test run of this project on the host shares
  (:func:`machine_folder`), so two runs at once (two clones, a developer's and CI's) wait for
  each other's ``alone`` tests too. An xdist_group only keeps tests on one worker; the other
  workers go on meanwhile.
"""
import contextlib
import fcntl
import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import pytest

#: Memory a worker may need at its peak (4 ranks, a launcher, the worker and its fork server).
WORKER_MEMORY_BYTES = 3 * 2**30
#: The controller's folder shared by its workers (locks, shared fixtures' results, groups).
RUN_FOLDER = pytest.StashKey()


def default_to_parallel(config):
    """``-n auto --dist loadgroup`` unless the command line chose (pytest_cmdline_main)."""
    if not config.pluginmanager.hasplugin("xdist") or hasattr(config, "workerinput"):
        return
    option = config.option
    if option.numprocesses is None and not option.tx:
        option.numprocesses = "auto"
    if option.numprocesses != 0 and option.dist == "no":
        option.dist = "loadgroup"  # xdist's own default, "load", ignores xdist_group


def _distributing(config):
    return not hasattr(config, "workerinput") and bool(getattr(config.option, "tx", None)) \
        and config.option.dist != "no"


def start_run(config):
    """In the controller of a parallel run: the folder its workers share (pytest_configure)."""
    if _distributing(config):
        config.stash[RUN_FOLDER] = Path(tempfile.mkdtemp(prefix="megatron-tds-run-"))


def end_run(config):
    """Remove the shared folder (pytest_unconfigure)."""
    folder = config.stash.get(RUN_FOLDER, None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


def tell_worker(node):
    """What a worker needs from the controller (pytest_configure_node): the shared folder and
    ``--dist`` (a worker parses the original command line again, without what
    :func:`default_to_parallel` set)."""
    node.workerinput["megatron_tds_run_folder"] = str(node.config.stash[RUN_FOLDER])
    node.workerinput["megatron_tds_dist"] = node.config.option.dist


def run_folder(config):
    """The folder every worker of this parallel run shares, or None outside a worker."""
    folder = getattr(config, "workerinput", {}).get("megatron_tds_run_folder")
    return Path(folder) if folder else None


def _group(item):
    """The test's xdist_group, else its module's when it uses a fixture of its module that
    outlives a test (:func:`_module_fixture_group`), else None."""
    names = {str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
             for mark in item.iter_markers("xdist_group")}
    return "_".join(sorted(names)) or _module_fixture_group(item)


def _module_fixture_group(item):
    """A module-scoped fixture is built once per worker: a reference training run, a
    converted model, compiled objects. The tests of the module that use one share a worker, so
    that it is built once per run. (Read from pytest's fixture resolution, ``_fixtureinfo``:
    where that is missing, tests are not grouped, only slower.)"""
    info = getattr(item, "_fixtureinfo", None)
    module = getattr(getattr(item, "module", None), "__name__", None)
    if info is None or module is None:
        return None
    for name in item.fixturenames:
        for fixturedef in info.name2fixturedefs.get(name, ()):
            if fixturedef.scope != "function" and \
                    getattr(fixturedef.func, "__module__", None) == module:
                return item.nodeid.split("::")[0]
    return None


def write_groups(config, items):
    """In a worker of a ``--dist loadgroup`` run: {test id: its xdist_group} into the run's
    folder, for :class:`MarkedGroupScheduling` (pytest_collection_modifyitems)."""
    folder = run_folder(config)
    if folder is None or config.workerinput.get("megatron_tds_dist") != "loadgroup":
        return
    groups = {item.nodeid: group for item in items if (group := _group(item))}
    path = folder / f"groups-{config.workerinput['workerid']}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(groups))
    os.replace(tmp, path)  # whole before the worker reports its collection


def make_scheduler(config, log):
    """:class:`MarkedGroupScheduling` for ``--dist loadgroup`` (pytest_xdist_make_scheduler)."""
    if config.option.dist != "loadgroup" or RUN_FOLDER not in config.stash:
        return None
    return MarkedGroupScheduling(config, log)


try:
    from xdist.scheduler import LoadGroupScheduling
except ImportError:  # no pytest-xdist: the suite runs serially, nothing to schedule
    LoadGroupScheduling = object


class MarkedGroupScheduling(LoadGroupScheduling):
    """pytest-xdist's loadgroup scheduling, with the groups the workers wrote down.

    Scheduling starts once every worker has collected, so each has written its file by then.
    A group is one unit of work (units with more tests are handed out first); every other
    test is a unit of its own.
    """

    def __init__(self, config, log=None):
        super().__init__(config, log)
        self._groups = {}

    def schedule(self):
        if self.collection is None:  # the first call: read the groups
            for path in sorted(self.config.stash[RUN_FOLDER].glob("groups-*.json")):
                self._groups.update(json.loads(path.read_text()))
        super().schedule()

    def _split_scope(self, nodeid):
        scope = super()._split_scope(nodeid)  # a group pytest-xdist could still append
        return self._groups.get(nodeid, scope) if scope == nodeid else scope


def _cgroup_cpus():
    """The container's CPU quota in cores (cgroup v2 or v1), or None when unlimited."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        period = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 else None
    except (OSError, ValueError):
        return None


def _available_memory():
    """Bytes of memory available now (MemAvailable, within the container's limit), or None."""
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
        if limit != "max":
            found.append(int(limit) - used)
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def auto_workers(config):
    """The worker count for ``-n auto`` / ``-n logical`` (pytest_xdist_auto_num_workers).

    ``PYTEST_XDIST_AUTO_NUM_WORKERS`` overrides it, as in pytest-xdist. Returns 0 (run in this
    process) when only one worker would run.
    """
    forced = os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS")
    if forced:
        return int(forced)
    cores = os.cpu_count() or 1
    try:
        import psutil

        # pytest-xdist's own count: physical cores for "auto", hardware threads for "logical"
        cores = psutil.cpu_count(logical=config.option.numprocesses == "logical") or cores
    except ImportError:
        pass
    limits = [cores]
    if hasattr(os, "sched_getaffinity"):
        limits.append(len(os.sched_getaffinity(0)))
    quota = _cgroup_cpus()
    if quota:
        limits.append(math.ceil(quota))
    memory = _available_memory()
    if memory is not None:
        limits.append(memory // WORKER_MEMORY_BYTES)
    workers = max(1, min(limits))
    return 0 if workers == 1 else workers


def once_per_run(config, name, build):
    """``build()``'s JSON-able result, computed once per test run.

    Under xdist the first worker to ask builds it (files it makes stay in that worker's
    temporary folder until the run ends) while holding a lock in the run's folder; the
    others wait for the lock and read the result. Without xdist: ``build()``.
    """
    folder = run_folder(config)
    if folder is None:
        return build()
    result = folder / f"{name}.json"
    with open(folder / f"{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when closed
        if result.exists():
            return json.loads(result.read_text())
        value = build()
        result.write_text(json.dumps(value))
        return value


def machine_folder():
    """The folder every test run of this project on this host shares (the ``alone`` locks)."""
    folder = Path(tempfile.gettempdir()) / "megatron-tds-tests"
    folder.mkdir(exist_ok=True)
    return folder


class Neighbours:
    """Tests marked ``alone`` run while no other worker runs a test; the rest run together.

    A readers-writer lock over ``flock`` that lets a waiting ``alone`` test go first: every
    test passes the gate, then holds the room shared (``alone``: exclusive). An ``alone``
    test keeps the gate while it waits for the room and while it runs, so no new test starts
    meanwhile; a test already running finishes first.
    """

    def __init__(self, folder):
        self._gate = open(folder / "alone-gate.lock", "a")  # noqa: SIM115 (held for the run)
        self._room = open(folder / "alone-room.lock", "a")  # noqa: SIM115

    @contextlib.contextmanager
    def hold(self, alone):
        fcntl.flock(self._gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(self._room, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        except BaseException:
            fcntl.flock(self._gate, fcntl.LOCK_UN)
            raise
        if not alone:
            fcntl.flock(self._gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(self._room, fcntl.LOCK_UN)
            if alone:
                fcntl.flock(self._gate, fcntl.LOCK_UN)

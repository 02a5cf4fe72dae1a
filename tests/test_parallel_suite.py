"""The parallel run's own machinery (tests/parallel_suite.py): the ``alone`` lock and the
worker count."""
import fcntl
import threading
import time

import pytest

import parallel_suite


def _holder(folder, alone, name, events, release=None):
    def run():
        with parallel_suite.Neighbours(folder).hold(alone):
            events.append(f"{name} in")
            if release is not None:
                release.wait(timeout=60)
            events.append(f"{name} out")

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _wait_until(condition, what):
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _gate_taken(folder):
    with open(folder / "alone-gate.lock", "a") as probe:
        try:
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(probe, fcntl.LOCK_UN)
        return False


def test_an_alone_test_waits_for_the_running_one_and_goes_before_later_ones(tmp_path):
    """Each holder opens the lock files itself, as each worker process does."""
    events, release = [], threading.Event()
    running = _holder(tmp_path, False, "running", events, release)
    _wait_until(lambda: events == ["running in"], "the first test never started")
    alone = _holder(tmp_path, True, "alone", events)
    _wait_until(lambda: _gate_taken(tmp_path), "the alone test never queued")
    later = _holder(tmp_path, False, "later", events)
    time.sleep(0.2)  # neither may start while the first test runs
    assert events == ["running in"]
    release.set()
    for thread in (running, alone, later):
        thread.join(timeout=60)
    assert events == ["running in", "running out", "alone in", "alone out", "later in",
                      "later out"]


def test_tests_that_are_not_alone_run_together(tmp_path):
    events, release = [], threading.Event()
    threads = [_holder(tmp_path, False, name, events, release) for name in ("a", "b")]
    _wait_until(lambda: sorted(events) == ["a in", "b in"], "the two tests did not overlap")
    release.set()
    for thread in threads:
        thread.join(timeout=60)


class _Option:
    numprocesses = "auto"


class _Config:
    option = _Option()


@pytest.mark.parametrize("cores, memory_gib, workers", [(2, 64, 2), (16, 64, 16),
                                                        (16, 10, 3), (1, 64, 0), (4, 2, 0)])
def test_auto_workers_fit_cores_and_memory(monkeypatch, cores, memory_gib, workers):
    monkeypatch.delenv("PYTEST_XDIST_AUTO_NUM_WORKERS", raising=False)
    monkeypatch.setattr(parallel_suite.os, "cpu_count", lambda: cores)
    monkeypatch.setattr(parallel_suite.os, "sched_getaffinity", lambda pid: set(range(cores)),
                        raising=False)
    monkeypatch.setitem(__import__("sys").modules, "psutil", None)  # count through os only
    monkeypatch.setattr(parallel_suite, "_cgroup_cpus", lambda: None)
    monkeypatch.setattr(parallel_suite, "_available_memory", lambda: memory_gib * 2**30)
    assert parallel_suite.auto_workers(_Config()) == workers


def test_auto_workers_follow_a_cpu_quota_and_the_override(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_AUTO_NUM_WORKERS", raising=False)
    monkeypatch.setattr(parallel_suite, "_cgroup_cpus", lambda: 2.5)
    monkeypatch.setattr(parallel_suite, "_available_memory", lambda: 2**40)
    assert parallel_suite.auto_workers(_Config()) <= 3
    monkeypatch.setenv("PYTEST_XDIST_AUTO_NUM_WORKERS", "5")
    assert parallel_suite.auto_workers(_Config()) == 5


@pytest.fixture(scope="module")
def _module_resource():
    return object()


def test_a_test_using_a_module_fixture_of_its_module_is_grouped_by_module(_module_resource,
                                                                            request):
    """Such tests share one worker, so the fixture is built once per run (read from pytest's
    fixture resolution: a pytest change that hides it fails here, not silently)."""
    assert parallel_suite._group(request.node) == request.node.nodeid.split("::")[0]


def test_other_tests_are_not_grouped(tmp_path, request):
    assert parallel_suite._group(request.node) is None


@pytest.mark.xdist_group("named")
def test_a_named_group_wins(_module_resource, request):
    assert parallel_suite._group(request.node) == "named"


@pytest.mark.parametrize("expression,exhaustive_in", [
    ("not slow", False), ("exhaustive or not slow", True), (None, False)])
def test_exhaustive_tests_run_only_when_the_mark_expression_names_them(expression,
                                                                       exhaustive_in):
    """A ``-m`` on the command line replaces pytest.ini's; the exhaustive matrices still stay
    out of a run whose expression does not name them (a quick ``-m "not slow"`` ran them)."""
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    marks = [] if expression is None else ["-m", expression]
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", *marks,
         "tests/test_compile_regions.py"], cwd=repo, capture_output=True, text=True,
        timeout=120).stdout
    assert "test_cuda_graphs_are_refused_where_they_cannot_run" in out, out[-2000:]
    assert ("test_every_layout_and_schedule_compiled" in out) == exhaustive_in, out[-2000:]
    chunks = "test_compiled_chunks_train_like_eager_with_one_graph_each"
    assert (f"{chunks}[gpt2]" in out) == (expression is None)  # slow, in the default run
    assert (f"{chunks}[t5]" in out) == exhaustive_in  # slow and exhaustive

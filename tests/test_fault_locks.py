"""A build killed mid-way, or a live one that never ends, must not wedge the next start.

The killed process is real (SIGKILL of a subprocess); the build it was running takes torch's
cpp_extension baton exactly as ``torch.utils.cpp_extension.load`` does, so the leftover on
disk is the one a real interrupted kernel build leaves.
"""
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from megatron.fused_kernels import build_utils
from megatron.resilience import locks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A builder doing what cpp_extension.load does with its baton, then "compiling" forever.
_KILLED_BUILD = textwrap.dedent("""
    import sys, time
    from megatron.fused_kernels.build_utils import load_native
    from torch.utils.file_baton import FileBaton

    def builder(directory):
        baton = FileBaton(str(directory / "lock"))
        assert baton.try_acquire()
        print("compiling", flush=True)
        time.sleep(600)

    load_native("fault_probe", [sys.argv[1]], builder)
""")


def _baton_builder(directory):
    """The second start: cpp_extension's protocol, then a finished 'module'."""
    from torch.utils.file_baton import FileBaton

    baton = FileBaton(str(directory / "lock"))
    if not baton.try_acquire():
        baton.wait()  # what torch does: loops while the file exists (forever if stale)
    else:
        baton.release()
    return "module"


def _start(code, *args, env=None):
    proc = subprocess.Popen([sys.executable, "-c", code, *args], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONPATH=REPO, **(env or {})))
    line = proc.stdout.readline()
    if line.startswith("> building fault_probe"):  # load_native announces a fresh build
        line = proc.stdout.readline()
    assert line.strip() == "compiling"
    return proc


@pytest.fixture
def build_root(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRON_TDS_BUILD_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(build_utils, "_LOADED", {})
    source = tmp_path / "probe.cpp"
    source.write_text(f"// {time.time()}\n")
    return tmp_path, str(source)


def test_build_killed_mid_way_does_not_block_the_next_start(build_root, caplog):
    root, source = build_root
    proc = _start(_KILLED_BUILD, source, env={"MEGATRON_TDS_BUILD_DIR": str(root / "cache")})
    directory = build_utils.build_dir("fault_probe", [source])
    assert (directory / "lock").exists()
    owner = open(directory.with_suffix(".lock")).read()
    assert f"pid {proc.pid}" in owner and socket.gethostname() in owner
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert (directory / "lock").exists()  # the stale baton, as a real killed build leaves it
    start = time.monotonic()
    with caplog.at_level(logging.WARNING):
        module = build_utils.load_native("fault_probe", [source], _baton_builder)
    assert module == "module" and time.monotonic() - start < 10
    assert not (directory / "lock").exists()
    assert str(directory / "lock") in caplog.text  # says which leftover it removed


def test_wait_for_a_live_builder_is_bounded_and_falls_back(build_root, monkeypatch, caplog):
    root, source = build_root
    proc = _start(_KILLED_BUILD, source, env={"MEGATRON_TDS_BUILD_DIR": str(root / "cache")})
    try:
        monkeypatch.setenv("MEGATRON_TDS_LOCK_WAIT_S", "2")
        lock = build_utils.build_dir("fault_probe", [source]).with_suffix(".lock")
        start = time.monotonic()
        with caplog.at_level(logging.WARNING):
            module = build_utils.load_native("fault_probe", [source], _baton_builder)
        waited = time.monotonic() - start
        assert module is None and 2 <= waited < 10  # the fallback, after the bound
        assert str(lock) in caplog.text and f"pid {proc.pid}" in caplog.text
        assert "fallback" in caplog.text
    finally:
        proc.kill()
        proc.wait(timeout=30)


def _killed_build_leftover(directory, seconds):
    """What a SIGKILLed builder leaves: its baton, and a 'compiler' still working in the folder
    (the real ninja and c++ are not children the kill reaches) that writes its output last."""
    directory.mkdir(parents=True)
    (directory / "lock").write_text("")
    code = f"import time; time.sleep({seconds}); open('module.o', 'w').write('complete')"
    return subprocess.Popen([sys.executable, "-c", code], cwd=directory)


def test_a_killed_builds_leftover_compiler_is_waited_for(build_root, caplog):
    """The next start builds only once the leftover is done: building alongside it (two
    writers of one object file) cached a module without its init function (seen under load)."""
    root, source = build_root
    directory = build_utils.build_dir("fault_probe", [source])
    leftover = _killed_build_leftover(directory, 2)
    try:
        assert locks.processes_in(directory) == [leftover.pid]
        with caplog.at_level(logging.WARNING):
            module = build_utils.load_native("fault_probe", [source],
                                             lambda d: (d / "module.o").read_text())
        assert module == "complete" and leftover.poll() == 0
        assert not (directory / "lock").exists() and str(directory / "lock") in caplog.text
    finally:
        leftover.kill()
        leftover.wait(timeout=30)


def test_wait_for_a_killed_builds_leftover_is_bounded(build_root, monkeypatch, caplog):
    root, source = build_root
    directory = build_utils.build_dir("fault_probe", [source])
    leftover = _killed_build_leftover(directory, 600)
    try:
        monkeypatch.setenv("MEGATRON_TDS_LOCK_WAIT_S", "1")
        with caplog.at_level(logging.WARNING):
            module = build_utils.load_native("fault_probe", [source], _baton_builder)
        assert module is None and leftover.poll() is None  # the fallback; nothing killed
        assert f"processes {leftover.pid} (python" in caplog.text and "fallback" in caplog.text
        assert (directory / "lock").exists()  # not removed while its build may still run
    finally:
        leftover.kill()
        leftover.wait(timeout=30)


def test_stale_temporary_files_of_dead_processes_are_removed(tmp_path):
    target = tmp_path / "index.npy"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    stale = tmp_path / f"index.npy.tmp-{host}-{dead.pid}"
    live = tmp_path / f"index.npy.tmp-{host}-{os.getppid()}"
    remote = tmp_path / f"index.npy.tmp-elsewhere-{dead.pid}"
    for path in (stale, live, remote):
        path.write_bytes(b"half")
    locks.remove_stale_tmps(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, remote.name])
    assert locks.tmp_name(target) == f"{target}.tmp-{host}-{os.getpid()}"


@pytest.mark.slow
@pytest.mark.exhaustive
def test_real_kernel_build_killed_then_started_again(tmp_path):
    """The issue's case end to end: kill -9 while the CPU kernels compile, start again
    (``-m exhaustive``: the default run covers the lock's paths with the build simulated, in
    test_build_killed_mid_way_does_not_block_the_next_start and the leftover-compiler tests)."""
    env = dict(os.environ, PYTHONPATH=REPO, MEGATRON_TDS_BUILD_DIR=str(tmp_path / "cache"),
               MEGATRON_TDS_LOCK_WAIT_S="120")
    code = ("from megatron.fused_kernels.build import load_kernels; "
            "print('module' if load_kernels('cpu') is not None else 'fallback')")
    first = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env)
    deadline = time.monotonic() + 120
    while not list((tmp_path / "cache").glob("megatron_tds_kernels_cpu_*/lock")):
        assert time.monotonic() < deadline and first.poll() is None, "the build never started"
        time.sleep(0.05)
    first.kill()
    first.wait(timeout=30)
    assert list((tmp_path / "cache").glob("megatron_tds_kernels_cpu_*/lock"))
    again = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, timeout=300,
                           capture_output=True, text=True)
    assert again.returncode == 0 and again.stdout.strip() == "module", again.stderr[-3000:]
    assert "left by a kernel build that was killed" in again.stderr


def test_a_fresh_build_is_announced_with_its_time_and_a_cached_one_is_not(build_root, capsys,
                                                                          monkeypatch):
    """A build can take minutes on a busy CPU: the start-up says so before it, and how long
    it took after; loading the cached binary says nothing."""
    root, source = build_root

    def builder(directory):
        time.sleep(0.3)
        (directory / "fault_probe.so").write_bytes(b"")  # what a real build leaves
        return "module"

    assert build_utils.load_native("fault_probe", [source], builder, what="the probe") == \
        "module"
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("> building the probe (once per machine and source change; "
                             "cached in "), out
    took = float(out[1].split(" in ")[1].split(" s")[0])
    assert out[1].startswith("> built the probe in ") and 0.3 <= took < 10, out
    monkeypatch.setattr(build_utils, "_LOADED", {})
    assert build_utils.load_native("fault_probe", [source], builder, what="the probe") == \
        "module"
    assert capsys.readouterr().out == ""

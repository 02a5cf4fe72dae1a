"""A wheel carries the kernel sources inside the package: built from a copy of the checkout,
installed into a fresh virtual environment outside it, it compiles the kernels from its own
``megatron/csrc`` and trains a tiny GPT-2 step with them."""
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

from gpt2_runs import REPO, gpt2_argv

# Not part of a build: VCS data, caches, earlier builds; and at the top, run outputs.
_SKIP_ANYWHERE = shutil.ignore_patterns(".git", "__pycache__", "*.egg-info", ".pytest_cache",
                                        "*.so")
_SKIP_TOP = {"build", "dist", "runs", "data", "demo", "checkpoints"}


def _skip(folder, names):
    top = _SKIP_TOP & set(names) if os.path.samefile(folder, REPO) else set()
    return set(_SKIP_ANYWHERE(folder, names)) | top


def _run(cmd, cwd, env, timeout=900):
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"{cmd}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout + done.stderr


def _see_running_packages(python, cwd, env):
    """Let the new venv import what the running interpreter has (torch, deepspeed, ...).

    ``--system-site-packages`` would give it the *base* interpreter's packages, which hold
    nothing when the suite itself runs in a virtual environment. A ``.pth`` file of plain
    paths adds the running interpreter's site-packages after the venv's own, without
    processing the ``.pth`` files in them: the checkout's editable install stays invisible,
    so ``megatron`` can only come from the wheel.
    """
    dirs = [p for p in sys.path if os.path.basename(p) in ("site-packages", "dist-packages")]
    assert dirs, f"no site-packages directory on the running interpreter's path: {sys.path}"
    query = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    own = subprocess.run([python, "-c", query], cwd=cwd, env=env, capture_output=True,
                         text=True, check=True).stdout.strip()
    with open(os.path.join(own, "running_interpreter.pth"), "w", encoding="utf-8") as handle:
        handle.write("\n".join(dirs) + "\n")


@pytest.mark.slow
@pytest.mark.exhaustive  # ~50 s: a wheel built and installed in a fresh venv
def test_wheel_installs_outside_checkout_and_builds_kernels(gpt2_data, tmp_path):
    # build from a copy, so the checkout gets no build/ or .egg-info folders
    src = tmp_path / "src"
    shutil.copytree(REPO, src, ignore=_skip)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
          "-w", str(tmp_path / "wheel"), str(src)], tmp_path, env)
    (wheel,) = (tmp_path / "wheel").glob("megatron_tds-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "megatron/csrc/kernels/cpu/fused_kernels_cpu.cpp" in names
    assert "megatron/csrc/data/helpers.cpp" in names
    assert not any(n.startswith("csrc/") for n in names)  # nothing outside the package

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], tmp_path, env)
    python = str(venv / "bin" / "python")
    _see_running_packages(python, tmp_path, env)
    _run([python, "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed",
          str(wheel)], tmp_path, env)

    work = tmp_path / "work"  # a cwd without megatron/ in it, and only the entry script
    work.mkdir()
    shutil.copy(os.path.join(REPO, "pretrain_gpt2.py"), work)
    env.update(MEGATRON_TDS_BUILD_DIR=str(tmp_path / "kernel_cache"), OMP_NUM_THREADS="1")
    where = _run([python, "-c", "import megatron, megatron.fused_kernels.build_utils as b; "
                  "print(megatron.__file__); print(b.CSRC_DIR)"], work, env).split()
    site = str(venv / "lib")
    assert where[0].startswith(site) and where[1].startswith(site), where
    assert where[1].endswith(os.path.join("megatron", "csrc"))

    argv = gpt2_argv(gpt2_data, "--batch-size", "2", "--train-iters", "2", "--log-interval", "1",
                     "--eval-iters", "0")
    out = _run([python, "pretrain_gpt2.py", *argv], work, env)
    assert "> fused kernels: masked softmax: fused CPU kernel; layer norm: fused CPU kernel" \
        in out, out[-3000:]
    assert "iteration        2/       2" in out
    built = list((tmp_path / "kernel_cache").glob("megatron_tds_kernels_cpu_*/*.so"))
    assert built, "no kernel binary in the fresh build cache"

"""Building the fused kernels: nvcc compile checks, failing builds, switches, startup status."""
import argparse
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import types

import pytest
import torch

from megatron import fused_kernels
from megatron.fused_kernels import build_utils
from megatron.fused_kernels import build
from megatron.model.fused_layer_norm import MixedFusedLayerNorm
from megatron.model.fused_softmax import AttnMaskType, FusedScaleMaskSoftmax

NVCC = shutil.which("nvcc")
CU_FILES = sorted(build.CSRC_DIR.rglob("*.cu"))
CUDA_MODULE = build.MODULE_NAMES["cuda"]


def nvcc_command(source, output):
    """Compile-only, with the flags the JIT build gives nvcc (torch's common ones + ours)."""
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS

    return [NVCC, "-c", str(source), "-o", str(output), *COMMON_NVCC_FLAGS, "-std=c++20",
            "-Xcompiler", "-fPIC", *build.CUDA_CFLAGS]


def bindings_command(output):
    includes = subprocess.run([sys.executable, "-m", "pybind11", "--includes"], check=True,
                              capture_output=True, text=True).stdout.split()
    source = build.KERNEL_DIR / "cuda" / "bindings.cpp"
    return [os.environ.get("CXX", "c++"), "-c", str(source), "-o", str(output), "-O1", "-fPIC",
            "-std=c++17", f"-DTORCH_EXTENSION_NAME={CUDA_MODULE}", *includes]


@pytest.fixture(scope="module")
def cuda_objects(tmp_path_factory):
    """Start every compile at once (they are independent); tests wait for their own."""
    out = tmp_path_factory.mktemp("nvcc")
    jobs = {}
    for source in CU_FILES:
        obj = out / (source.stem + ".o")
        jobs[source.name] = (obj, subprocess.Popen(nvcc_command(source, obj), text=True,
                                                   stdout=subprocess.PIPE,
                                                   stderr=subprocess.STDOUT))
    obj = out / "bindings.o"
    jobs["bindings.cpp"] = (obj, subprocess.Popen(bindings_command(obj), text=True,
                                                  stdout=subprocess.PIPE,
                                                  stderr=subprocess.STDOUT))
    yield out, jobs
    for _, proc in jobs.values():
        if proc.poll() is None:
            proc.kill()


def wait(job):
    obj, proc = job
    log, _ = proc.communicate(timeout=600)
    return obj, proc.returncode, log


@pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")
@pytest.mark.parametrize("source", [p.name for p in CU_FILES])
def test_nvcc_compiles(cuda_objects, source):
    _, jobs = cuda_objects
    obj, rc, log = wait(jobs[source])
    assert rc == 0, f"nvcc failed on {source}:\n{log}"
    assert obj.stat().st_size > 0


def test_every_cuda_source_is_built():
    assert {p.name for p in CU_FILES} == {p.name for p in build.CUDA_SOURCES if p.suffix == ".cu"}
    assert CU_FILES, "no .cu files found"


@pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")
def test_cuda_module_links_and_imports(cuda_objects):
    """Link the objects as the extension would be and import it: every launcher the bindings
    call exists, and errors come back as Python exceptions (no device here: a clean error)."""
    out, jobs = cuda_objects
    objects = []
    for name in jobs:
        obj, rc, log = wait(jobs[name])
        assert rc == 0, f"{name} failed to compile:\n{log}"
        objects.append(str(obj))
    target = out / (CUDA_MODULE + sysconfig.get_config_var("EXT_SUFFIX"))
    link = subprocess.run([NVCC, "-shared", "-o", str(target), *objects], capture_output=True,
                          text=True)
    assert link.returncode == 0, link.stderr
    probe = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location({CUDA_MODULE!r}, {str(target)!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "print(sorted(n for n in dir(m) if not n.startswith('_')))\n"
        "try:\n    print('blocks', m.norm_backward_blocks(8, 64, 1))\n"
        "except RuntimeError as e:\n    print('error', e)\n")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    for name in ("softmax_forward", "softmax_backward", "norm_forward", "norm_backward"):
        assert name in run.stdout
    if torch.cuda.is_available():
        assert "blocks" in run.stdout
    else:
        assert "error megatron-tds CUDA" in run.stdout


@pytest.fixture
def fresh_build_state(monkeypatch, tmp_path):
    """An empty build cache and no module loaded yet in this process."""
    monkeypatch.setenv("MEGATRON_TDS_BUILD_DIR", str(tmp_path))
    monkeypatch.setattr(build_utils, "_LOADED", {})
    monkeypatch.setattr(build, "_AOT_CHECKED", {"cpu": None, "cuda": None})
    monkeypatch.setattr(build, "_ERRORS", {})
    monkeypatch.setattr(build, "_MODULES", {})
    monkeypatch.setattr(fused_kernels, "_FLAGS", dict(fused_kernels._FLAGS))
    return tmp_path


def small_step(seed, softmax_fusion=True):
    """A training-time forward/backward through both ops; returns values to compare."""
    torch.manual_seed(seed)
    softmax = FusedScaleMaskSoftmax(False, False, AttnMaskType.causal, softmax_fusion,
                                    lambda s, m: s.masked_fill_(m, -10000.0), True, 0.5)
    norm = MixedFusedLayerNorm(16)
    x = torch.randn(2, 2, 8, 8, requires_grad=True)
    h = torch.randn(8, 16, requires_grad=True)
    loss = softmax(x, None).square().sum() + norm(h).square().sum()
    loss.backward()
    return softmax.last_path, loss.item(), x.grad, h.grad


@pytest.mark.parametrize("cxx", ["/bin/false", "/nonexistent/c++"])
def test_failed_build_falls_back_and_says_so_once(fresh_build_state, monkeypatch, caplog, seed,
                                                   cxx):
    monkeypatch.setenv("CXX", cxx)
    caplog.set_level(logging.WARNING)
    status = fused_kernels.load(None)
    assert status.masked_softmax.startswith("PyTorch fallback (build failed")
    assert status.layer_norm.startswith("PyTorch fallback (build failed")
    results = [small_step(seed) for _ in range(3)]  # ops keep working, no second attempt
    assert all(r[0] == "PyTorch" for r in results)
    monkeypatch.setitem(fused_kernels._FLAGS, "layernorm_fusion", False)
    expected = small_step(seed, softmax_fusion=False)
    for got in results:
        assert got[1] == pytest.approx(expected[1], rel=1e-6)
        torch.testing.assert_close(got[2], expected[2])
    warnings = [r for r in caplog.records if "fused CPU kernels" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    assert "fallback" in warnings[0].getMessage() and "\n" not in warnings[0].getMessage()


def test_environment_switch_forces_fallback(fresh_build_state, monkeypatch, caplog):
    monkeypatch.setenv(fused_kernels.ENV_DISABLE, "1")
    status = fused_kernels.load(None)
    assert fused_kernels.ENV_DISABLE in status.masked_softmax
    assert fused_kernels.get_module("cpu") is None
    assert not list(fresh_build_state.iterdir()), "nothing may be built when disabled"
    assert small_step(0)[0] == "PyTorch"


def test_arguments_and_status(monkeypatch):
    monkeypatch.setattr(fused_kernels, "_FLAGS", dict(fused_kernels._FLAGS))
    parser = fused_kernels.add_fused_kernel_args(argparse.ArgumentParser())
    args = parser.parse_args([])
    assert args.masked_softmax_fusion and args.layernorm_fusion is None  # per device
    assert parser.parse_args(["--layernorm-fusion"]).layernorm_fusion is True
    args = parser.parse_args(["--no-masked-softmax-fusion", "--no-layernorm-fusion"])
    assert not args.masked_softmax_fusion and not args.layernorm_fusion
    status = fused_kernels.load(args)
    assert "--no-masked-softmax-fusion" in status.masked_softmax
    assert "--no-layernorm-fusion" in status.layer_norm
    # the softmax takes the flag through its constructor (the model config), nothing global
    assert small_step(0, softmax_fusion=args.masked_softmax_fusion)[0] == "PyTorch"
    assert small_step(0)[0] == "fused CPU kernel"
    status = fused_kernels.load(parser.parse_args([]))
    assert status.masked_softmax == "fused CPU kernel" and status.layer_norm == "fused CPU kernel"
    assert "masked softmax: fused CPU kernel" in str(status)
    assert fused_kernels.status() is status


def test_ahead_of_time_build_spec():
    exts, cmdclass = build.aot_extensions()
    names = [e.name for e in exts]
    assert names[0] == "megatron.fused_kernels._cpu_kernels" and "build_ext" in cmdclass
    root = build.CSRC_DIR.parent
    for ext in exts:
        assert all((root / s).is_file() for s in ext.sources)
    assert ("megatron.fused_kernels._cuda_kernels" in names) == (
        torch.version.cuda is not None and build_cuda_home() is not None)


def build_cuda_home():
    from torch.utils.cpp_extension import CUDA_HOME

    return CUDA_HOME


def test_stale_ahead_of_time_module_is_ignored(monkeypatch):
    monkeypatch.setattr(build, "_AOT_CHECKED", {})
    fake = types.SimpleNamespace(source_hash=lambda: "h0000000000000000")
    monkeypatch.setattr(build.importlib, "import_module", lambda name: fake)
    assert build._ahead_of_time_module("cpu") is None
    current = types.SimpleNamespace(source_hash=lambda: f"h{build.source_hash('cpu')}")
    monkeypatch.setattr(build, "_AOT_CHECKED", {})
    monkeypatch.setattr(build.importlib, "import_module", lambda name: current)
    assert build._ahead_of_time_module("cpu") is current


def test_norms_take_the_faster_path_per_device_without_a_flag(monkeypatch):
    # Measured on an H100 (issue 38): F.layer_norm beats the fused LayerNorm; the fused
    # RMSNorm beats PyTorch's four kernels; on the CPU both twins win. A flag overrides.
    monkeypatch.setattr(fused_kernels, "_FLAGS", {"layernorm_fusion": None})
    monkeypatch.delenv(fused_kernels.ENV_DISABLE, raising=False)
    enabled = fused_kernels.norm_fusion_enabled
    assert not enabled("layer_norm", "cuda") and enabled("rms_norm", "cuda")
    assert enabled("layer_norm", "cpu") and enabled("rms_norm", "cpu")
    said = fused_kernels._norm_path(None, object(), None, "cuda")
    assert said.startswith("PyTorch (faster on CUDA") and "RMSNorm: fused CUDA kernel" in said
    assert fused_kernels._norm_path(None, object(), None, "cpu") == "fused CPU kernel"
    for flag in (True, False):
        monkeypatch.setitem(fused_kernels._FLAGS, "layernorm_fusion", flag)
        assert enabled("layer_norm", "cuda") is flag and enabled("rms_norm", "cpu") is flag
    monkeypatch.setitem(fused_kernels._FLAGS, "layernorm_fusion", None)
    monkeypatch.setenv(fused_kernels.ENV_DISABLE, "1")
    assert not enabled("rms_norm", "cpu")

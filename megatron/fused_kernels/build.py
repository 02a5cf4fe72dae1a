"""Compile the fused kernels in ``csrc/kernels`` just in time, or ahead of time from setup.py.

Two extension modules with the same functions (see csrc/kernels/bindings.h):

- ``megatron_tds_kernels_cpu``: one C++ translation unit, built with the host compiler;
- ``megatron_tds_kernels_cuda``: pybind glue (.cpp) + kernels (.cu, sm_80 and sm_90 SASS,
  compute_90 PTX for newer GPUs), built with nvcc, only on a machine with a GPU.

A JIT build goes through :func:`megatron.fused_kernels.build_utils.load_native`: cached per hash of every
source and header, the torch / CUDA / Python versions, the flags and the compiler; rank 0
builds first; any failure logs one line and returns None, and the callers fall back to
PyTorch. ``MEGATRON_TDS_BUILD_EXT=1 pip install -e .`` builds both ahead of time
(:func:`aot_extensions`); such a binary is used only while its embedded source hash
matches the sources, so an edited kernel is never silently replaced by a stale one.
"""
import hashlib
import importlib
import logging
import os
import re
import shutil
import subprocess

import torch

from .build_utils import CSRC_DIR, load_native

logger = logging.getLogger(__name__)

KERNEL_DIR = CSRC_DIR / "kernels"
HEADERS = [KERNEL_DIR / "kernel_args.h", KERNEL_DIR / "bindings.h"]
CPU_SOURCES = [KERNEL_DIR / "cpu" / "fused_kernels_cpu.cpp"]
CPU_HEADERS = [KERNEL_DIR / "cpu" / n for n in ("vec_math.h", "softmax_cpu.h", "layer_norm_cpu.h")]
CUDA_SOURCES = [KERNEL_DIR / "cuda" / n for n in ("bindings.cpp", "masked_softmax.cu",
                                                  "layer_norm.cu")]
CUDA_HEADERS = [KERNEL_DIR / "cuda" / n for n in ("common.cuh", "launchers.h")]

MODULE_NAMES = {"cpu": "megatron_tds_kernels_cpu", "cuda": "megatron_tds_kernels_cuda"}
AOT_MODULES = {"cpu": "megatron.fused_kernels._cpu_kernels",
               "cuda": "megatron.fused_kernels._cuda_kernels"}

# -ffp-contract=fast lets the compiler fuse a*b+c into FMAs (torch builds with -std=c++20,
# which turns contraction off). -fopenmp: at::parallel_for's OpenMP body is a header
# template, compiled into this module; it binds to the libgomp torch has already loaded.
CPU_CFLAGS = ["-O3", "-ffp-contract=fast", "-fopenmp"]
CPU_LDFLAGS = ["-fopenmp"]
CUDA_ARCHS = ("80", "90")
CUDA_CFLAGS = ["-O3", "-lineinfo", *[f"-gencode=arch=compute_{a},code=sm_{a}" for a in CUDA_ARCHS],
               f"-gencode=arch=compute_{CUDA_ARCHS[-1]},code=compute_{CUDA_ARCHS[-1]}"]
CUDA_HOST_CFLAGS = ["-O3"]

_ERRORS = {}  # kind -> the last build error's one-line summary (for the startup status)
_MODULES = {}  # kind -> module or None, once decided in this process


def sources(kind):
    """Files compiled for ``kind`` ("cpu" or "cuda")."""
    return list(CPU_SOURCES if kind == "cpu" else CUDA_SOURCES)


def hashed_files(kind):
    """Every file whose contents the binary depends on (sources and headers)."""
    return sources(kind) + HEADERS + (CPU_HEADERS if kind == "cpu" else CUDA_HEADERS)


def source_hash(kind):
    """Hex digest of the sources and headers of ``kind``, embedded in ahead-of-time builds."""
    digest = hashlib.sha256()
    for path in sorted(hashed_files(kind)):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _hash_define(kind):
    # An identifier, not a string literal: flags pass through a ninja (shell) command line.
    return f"-DMTDS_SOURCE_HASH_ID=h{source_hash(kind)}"


def last_error(kind):
    """One-line reason the last build of ``kind`` failed, or None."""
    return _ERRORS.get(kind)


def _summarize(text):
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    for line in lines:
        if re.search(r"\berror\b", line, re.IGNORECASE):
            return line[:300]
    return lines[-1][:300] if lines else "unknown error"


def _guarded(kind, compile_fn):
    """Wrap a builder: write the full error to build.log and raise a one-line summary."""
    def builder(directory):
        try:
            return compile_fn(directory)
        except Exception as exc:
            log = directory / "build.log"
            try:
                log.write_text(f"{type(exc).__name__}: {exc}\n")
            except OSError:
                log = None
            summary = _summarize(exc)
            _ERRORS[kind] = summary
            where = f" (full log: {log})" if log else ""
            raise RuntimeError(f"{summary}{where}") from None
    return builder


def _require(program, what):
    if shutil.which(program) is None:
        raise RuntimeError(f"no {what}: '{program}' not found on PATH")


def _compile_cpu(directory):
    _require(os.environ.get("CXX", "c++"), "C++ compiler (install g++ or set CXX)")
    from torch.utils.cpp_extension import load

    return load(name=MODULE_NAMES["cpu"], sources=[str(s) for s in CPU_SOURCES],
                extra_cflags=CPU_CFLAGS + [_hash_define("cpu")], extra_ldflags=CPU_LDFLAGS,
                build_directory=str(directory), with_cuda=False, verbose=False)


def _compile_cuda(directory):
    _require(os.environ.get("CXX", "c++"), "C++ compiler (install g++ or set CXX)")
    from torch.utils.cpp_extension import CUDA_HOME, load

    if CUDA_HOME is None:
        raise RuntimeError("no CUDA toolkit (nvcc) found; set CUDA_HOME")
    define = _hash_define("cuda")
    return load(name=MODULE_NAMES["cuda"], sources=[str(s) for s in CUDA_SOURCES],
                extra_cflags=CUDA_HOST_CFLAGS + [define],
                extra_cuda_cflags=CUDA_CFLAGS + [define],
                build_directory=str(directory), with_cuda=True, verbose=False)


def _cache_key(kind):
    # The checkout's path too: torch's build.ninja names the sources by absolute path, so
    # two checkouts sharing one folder would rebuild (under the lock) at every switch.
    key = [kind, str(KERNEL_DIR), os.environ.get("CXX", "c++"), *CPU_CFLAGS, *CPU_LDFLAGS]
    if kind == "cuda":
        from torch.utils.cpp_extension import CUDA_HOME

        key += [str(CUDA_HOME), _nvcc_version(CUDA_HOME), *CUDA_CFLAGS, *CUDA_HOST_CFLAGS]
    return tuple(key)


def _nvcc_version(cuda_home):
    nvcc = os.path.join(cuda_home, "bin", "nvcc") if cuda_home else "nvcc"
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60)
        return out.stdout.strip().splitlines()[-1]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "no-nvcc"


_AOT_CHECKED = {}


def _ahead_of_time_module(kind):
    """The module setup.py built, if present and built from the current sources."""
    if kind in _AOT_CHECKED:
        return _AOT_CHECKED[kind]
    module = None
    try:
        candidate = importlib.import_module(AOT_MODULES[kind])
    except ImportError:
        candidate = None
    if candidate is not None:
        if candidate.source_hash() == f"h{source_hash(kind)}":
            module = candidate
        else:
            logger.info("ahead-of-time %s kernels were built from other sources; "
                        "compiling the current ones instead", kind)
    _AOT_CHECKED[kind] = module
    return module


def load_kernels(kind, collective=False):
    """The compiled module for ``kind`` ("cpu" / "cuda"), or None after one logged line.

    Args:
        kind: "cpu" for the C++ twins, "cuda" for the GPU kernels.
        collective: every rank calls it together (``initialize_megatron``'s load): rank 0
            builds first and shares the outcome. The default, a lazy first use from a
            model's forward, involves no other rank (only some pipeline stages reach it).
    """
    if kind in _MODULES:  # the per-call path: no hashing, no subprocess
        return _MODULES[kind]
    what = f"fused {kind.upper()} kernels (csrc/kernels/{kind})"
    module = None if kind == "cuda" and _unsupported_gpu(what) else _ahead_of_time_module(kind)
    if module is None and kind not in _ERRORS:
        compile_fn = _compile_cpu if kind == "cpu" else _compile_cuda
        module = load_native(MODULE_NAMES[kind], hashed_files(kind), _guarded(kind, compile_fn),
                             extra_key=_cache_key(kind), what=what, collective=collective)
    if module is not None and kind == "cuda" and not _runs_on_this_gpu(module, what):
        module = None
    _MODULES[kind] = module
    return module


def _unsupported_gpu(what):
    """True (after one logged line) on a GPU older than the sm_80 the kernels are built for."""
    major, minor = torch.cuda.get_device_capability()
    if major >= int(CUDA_ARCHS[0][:-1]):
        return False
    _ERRORS["cuda"] = f"compute capability {major}.{minor} < 8.0, the kernels target sm_80+"
    logger.warning("%s unavailable, using the fallback path (%s)", what, _ERRORS["cuda"])
    return True


def _runs_on_this_gpu(module, what):
    """Launch each kernel once on tiny inputs: a binary without code for this GPU (or a
    failed PTX JIT) fails here, once, instead of in the middle of training."""
    from . import ops

    try:
        x = torch.randn(1, 1, 4, 32, device="cuda", dtype=torch.float16)
        y, dead = ops.softmax_forward(module, x, None, 1.0, True)
        ops.softmax_backward(module, x, y, dead, 1.0, True)
        w = torch.ones(32, device="cuda")
        h, mean, rstd = ops.norm_forward(module, x.view(4, 32), w, w, 1e-5, False)
        ops.norm_backward(module, h, x.view(4, 32), w, mean, rstd, True, False)
        torch.cuda.synchronize()
        return True
    except RuntimeError as exc:
        _ERRORS["cuda"] = _summarize(exc)
        logger.warning("%s unavailable, using the fallback path (%s)", what, _ERRORS["cuda"])
        return False


def aot_extensions():
    """``(ext_modules, cmdclass)`` for setup.py: the CPU module, plus CUDA when it can be built.

    The CUDA module is added when torch was built with CUDA and a toolkit is found
    (``CUDA_HOME``); ``MEGATRON_TDS_BUILD_CUDA=0`` leaves it out.
    """
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

    root = CSRC_DIR.parent

    def rel(paths):
        return [os.path.relpath(p, root) for p in paths]

    exts = [CppExtension(AOT_MODULES["cpu"], rel(CPU_SOURCES),
                         extra_compile_args={"cxx": CPU_CFLAGS + [_hash_define("cpu")]},
                         extra_link_args=CPU_LDFLAGS)]
    want_cuda = os.environ.get("MEGATRON_TDS_BUILD_CUDA", "1") != "0"
    if want_cuda and torch.version.cuda is not None and CUDA_HOME is not None:
        define = _hash_define("cuda")
        exts.append(CUDAExtension(AOT_MODULES["cuda"], rel(CUDA_SOURCES),
                                  extra_compile_args={"cxx": CUDA_HOST_CFLAGS + [define],
                                                      "nvcc": CUDA_CFLAGS + [define]}))
    return exts, {"build_ext": BuildExtension}

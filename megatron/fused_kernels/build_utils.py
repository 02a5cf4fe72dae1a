"""Compile native code (csrc/) once per source hash, load it, and fall back on failure.

Used by the fused kernels and by the data-index helpers. A build goes to
``$MEGATRON_TDS_BUILD_DIR`` (default ``~/.cache/megatron-tds``) in a folder named after
the sources' hash plus whatever else the binary depends on (torch, CUDA and Python
versions, flags), so a changed source or an upgraded torch rebuilds, and an unchanged
one loads in milliseconds. A file lock keeps concurrent builders (several ranks, several
test processes) from writing the same folder; a killed builder can neither keep it nor
leave torch's baton file behind to block the next build, the compiler it left running is
waited for rather than built alongside, and a wait for a live builder is
bounded, then the caller falls back (see :mod:`megatron.resilience.locks`). Under torch.distributed,
rank 0 builds first and tells the others whether it worked; they then load from the cache
(or fall back too).
"""
import hashlib
import logging
import os
import sys
import time
from pathlib import Path

import torch

from ..resilience.locks import owned_lock, remove_stale_baton

logger = logging.getLogger(__name__)

#: Where a wheel / ``pip install .`` puts the sources (setup.py's build_py copies csrc/ there).
PACKAGED_CSRC_DIR = Path(__file__).resolve().parents[1] / "csrc"
#: The repository's top-level csrc/ (a checkout, or ``pip install -e .``).
REPO_CSRC_DIR = Path(__file__).resolve().parents[2] / "csrc"


def find_csrc_dir():
    """The native sources: inside the installed package first, else the repository's."""
    return PACKAGED_CSRC_DIR if PACKAGED_CSRC_DIR.is_dir() else REPO_CSRC_DIR


CSRC_DIR = find_csrc_dir()
"""The csrc/ folder this installation compiles from (see :func:`find_csrc_dir`)."""

_LOADED = {}


def build_root():
    root = os.environ.get("MEGATRON_TDS_BUILD_DIR") or Path.home() / ".cache" / "megatron-tds"
    return Path(root)


def build_dir(name, sources, extra_key=()):
    """The cache folder for ``name`` built from ``sources`` (paths) and ``extra_key`` (strs)."""
    digest = hashlib.sha256()
    for src in sorted(str(s) for s in sources):
        digest.update(Path(src).read_bytes())
    for item in (torch.__version__, str(torch.version.cuda), sys.version, *extra_key):
        digest.update(str(item).encode())
    return build_root() / f"{name}_{digest.hexdigest()[:16]}"


def _try_build(name, sources, builder, extra_key, what=None, announce=False):
    """Build or load; ``announce``: say so before a build (no binary in the cache yet), which
    can take minutes on a busy CPU, and how long it took."""
    try:
        directory = build_dir(name, sources, extra_key)
        fresh = announce and not any(directory.glob("*.so"))
        if fresh:
            print(f"> building {what or name} (once per machine and source change; cached in "
                  f"{directory})", flush=True)
        start = time.monotonic()
        with owned_lock(directory.with_suffix(".lock"), what=f"the build of {name}"):
            directory.mkdir(parents=True, exist_ok=True)
            # a killed build's baton (torch would wait for it forever), once the ninja and
            # compiler that build left running in the folder have finished
            remove_stale_baton(directory)
            module = builder(directory)
        if fresh:
            print(f"> built {what or name} in {time.monotonic() - start:.1f} s", flush=True)
        return module, None
    except Exception as exc:  # any failure means: use the PyTorch/NumPy path
        lines = str(exc).strip().splitlines()
        return None, f"{type(exc).__name__}: {lines[-1] if lines else ''}"


def _rank0_status(ok):
    """Broadcast rank 0's build outcome (1/0) to every rank."""
    import torch.distributed as dist

    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.broadcast(flag, 0)
    return bool(flag.item())


def load_native(name, sources, builder, extra_key=(), what=None, collective=True):
    """Build (or load from the cache) a native module; None when it cannot be had.

    Args:
        name: module name, also the cache folder prefix.
        sources: source paths whose contents key the cache.
        builder: ``builder(directory) -> module``; compiles into ``directory`` and imports.
        extra_key: other strings the binary depends on (flags, arch list).
        what: words for the one-line log on failure (default: ``name``).
        collective: every rank calls this at the same point (start-up): rank 0 builds
            first and shares the outcome (one broadcast). False for a lazy first use that
            only some ranks reach (a pipeline stage's first norm): each rank builds or
            loads on its own, serialised by the cache folder's file lock, with no
            collective.

    Returns:
        The module, or None after logging one line (the caller falls back).
    """
    if name in _LOADED:
        return _LOADED[name]
    import torch.distributed as dist

    distributed = collective and dist.is_available() and dist.is_initialized() and \
        dist.get_world_size() > 1
    module, error = None, None
    first = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    if not distributed or dist.get_rank() == 0:
        module, error = _try_build(name, sources, builder, extra_key, what, announce=first)
    if distributed:
        if _rank0_status(module is not None) and dist.get_rank() != 0:
            module, error = _try_build(name, sources, builder, extra_key)
        elif dist.get_rank() != 0:
            error = "the build failed on rank 0"
    if module is None:
        logger.warning("%s unavailable, using the fallback path (%s)", what or name, error)
    _LOADED[name] = module
    return module

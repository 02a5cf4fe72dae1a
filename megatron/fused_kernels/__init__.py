"""Fused kernels: switches, loading, and the startup status line.

``load(args)`` is called once by ``initialize_megatron``: it builds (or loads from the cache)
the kernels for this process's device and returns a :class:`KernelStatus` saying which path
each op takes. The model-side wrappers (megatron/model/fused_softmax.py, fused_layer_norm.py)
ask :func:`get_module` for the compiled module at call time; None means the PyTorch path.

Switches: ``--no-masked-softmax-fusion`` / ``--[no-]layernorm-fusion`` (arguments, see
:func:`add_fused_kernel_args`) and ``MEGATRON_TDS_NO_FUSED_KERNELS=1`` (environment, forces
every op onto the PyTorch path without attempting a build). Without ``--[no-]layernorm-fusion``
each norm takes the path measured faster on its device (:data:`NORM_FUSION_BY_DEFAULT`).
"""
import dataclasses
import logging
import os
from typing import Optional

import torch

logger = logging.getLogger(__name__)

ENV_DISABLE = "MEGATRON_TDS_NO_FUSED_KERNELS"

#: ``--[no-]layernorm-fusion`` for MixedFusedLayerNorm / MixedFusedRMSNorm (Megatron's
#: constructors have no switch): True / False, or None (neither flag: per device, below).
#: The masked softmax takes ``--[no-]masked-softmax-fusion`` from its model config alone.
_FLAGS = {"layernorm_fusion": None}

#: Whether a norm takes the fused kernel when neither ``--layernorm-fusion`` nor
#: ``--no-layernorm-fusion`` is given, per (norm, device type): the faster path where it was
#: measured. On an H100 (benchmarks/kernels.py, bf16, 16384 rows x 768 / 1024 / 4096, issue
#: 38) the fused LayerNorm's forward + backward took 0.32x / 0.34x / 0.61x the time of
#: ``F.layer_norm``'s, and GPT-2 345M trained 7-14% faster without it; the fused RMSNorm
#: replaces four PyTorch kernels (T5-base: 8% slower without it). On the CPU both twins are
#: the faster (docs/benchmarks.md). A pair not listed takes the kernel.
NORM_FUSION_BY_DEFAULT = {("layer_norm", "cuda"): False, ("rms_norm", "cuda"): True,
                          ("layer_norm", "cpu"): True, ("rms_norm", "cpu"): True}
NORMS = ("layer_norm", "rms_norm")
_STATUS = None
#: Why every op was put on the PyTorch path after start-up (:func:`force_fallback`), or None.
_FORCED_OFF = None


def add_fused_kernel_args(parser):
    """Add ``--[no-]masked-softmax-fusion`` (default: on) and ``--[no-]layernorm-fusion``
    (default: None, the faster path per device, :data:`NORM_FUSION_BY_DEFAULT`).

    Args:
        parser: an ``argparse.ArgumentParser``; the flags go in a "fused kernels" group.
    """
    group = parser.add_argument_group("fused kernels")
    for name, what in (("masked-softmax-fusion", "fused scale + mask + softmax kernel"),
                       ("layernorm-fusion", "fused LayerNorm / RMSNorm kernels")):
        dest = name.replace("-", "_")
        group.add_argument(f"--{name}", dest=dest, action="store_true", help=f"use the {what}")
        group.add_argument(f"--no-{name}", dest=dest, action="store_false",
                           help=f"use PyTorch instead of the {what}")
        group.set_defaults(**{dest: True if name == "masked-softmax-fusion" else None})
    return parser


def disabled_reason():
    """Why the environment (or the ranks' agreement, :func:`force_fallback`) forbids the
    kernels, or None."""
    if _FORCED_OFF is not None:
        return _FORCED_OFF
    if os.environ.get(ENV_DISABLE, "0").strip().lower() not in ("", "0", "false", "no"):
        return f"{ENV_DISABLE} is set"
    return None


def _norm_fused_by_default(norm, device_type):
    return NORM_FUSION_BY_DEFAULT.get((norm, device_type), True)


def norm_fusion_enabled(norm, device_type):
    """Whether ``norm`` (one of :data:`NORMS`) on ``device_type`` takes the fused kernel: the
    flag when given, else :data:`NORM_FUSION_BY_DEFAULT`."""
    if disabled_reason() is not None:
        return False
    flag = _FLAGS["layernorm_fusion"]
    return _norm_fused_by_default(norm, device_type) if flag is None else flag


def get_module(device_type, collective=False):
    """The compiled kernels for ``device_type`` ("cpu" / "cuda"), or None.

    The first call builds (or loads from the cache); a failed build logs one line and every
    later call returns None at once. A first call from a model's forward (a tds pipeline
    used directly, without :func:`load`) involves no collective, so a stage that reaches
    it alone does not wait for the others.

    Args:
        device_type: ``tensor.device.type``.
        collective: every rank calls it at once (:func:`load`): rank 0 builds first.
    """
    if disabled_reason() is not None or device_type not in ("cpu", "cuda"):
        return None
    if device_type == "cuda":
        if not torch.cuda.is_available():
            return None
    from .build import load_kernels

    return load_kernels(device_type, collective=collective)


def kernels_available(device_type: str) -> bool:
    """Whether :func:`get_module` gives kernels for ``device_type`` (building them if needed).

    Under ``torch.compile`` this runs once, while the graph is traced, and its answer is a
    constant of the graph: the first call may build the kernels, which cannot be traced,
    and the answer never changes within a process (a build is tried once).
    :func:`megatron.model.compile.prepare_for_compile` marks it so
    (``torch.compiler.assume_constant_result``), not this module: marking imports dynamo.

    Args:
        device_type: ``tensor.device.type``.
    """
    return get_module(device_type) is not None


@dataclasses.dataclass(frozen=True)
class KernelStatus:
    """Which implementation each fused op uses in this process (for the startup log)."""

    device: str
    masked_softmax: str
    layer_norm: str
    target: str = ""
    build_failure: str = ""
    """Why the kernels this run asked for could not be built or loaded here ("": they were,
    or none were asked for)."""

    def __str__(self):
        return (f"masked softmax: {self.masked_softmax}; layer norm: {self.layer_norm}"
                f" [{self.target or self.device}]")


def _path(enabled, cli_flag, module, failure, kind):
    if not enabled:
        return f"PyTorch fallback ({cli_flag})"
    if failure:
        return f"PyTorch fallback ({failure})"
    if module is None:
        return "PyTorch fallback (kernels unavailable)"
    return f"fused {kind.upper()} kernel"


def _norm_path(flag, module, failure, kind):
    """The norms' status: the flag's path, or without one each norm's default on ``kind``."""
    if flag is not None:
        return _path(flag, "--no-layernorm-fusion", module, failure, kind)
    paths = {norm: _path(True, "", module, failure, kind)
             if _norm_fused_by_default(norm, kind) else
             f"PyTorch (faster on {kind.upper()}; --layernorm-fusion forces the kernel)"
             for norm in NORMS}
    if paths["layer_norm"] == paths["rms_norm"]:
        return paths["layer_norm"]
    return f"{paths['layer_norm']}; RMSNorm: {paths['rms_norm']}"


def load(kernels=None):
    """Build or load the kernels for this process's device; return the status for the log.

    Args:
        kernels: the run's kernel settings (``cfg.kernels``: ``masked_softmax_fusion``,
            ``layernorm_fusion``) or None to keep the defaults (the softmax on, each norm
            per device).

    Returns:
        A :class:`KernelStatus`; ``str(status)`` is one line for the startup log.
    """
    global _STATUS
    softmax = True if kernels is None else bool(kernels.masked_softmax_fusion)
    if kernels is not None:
        flag = kernels.layernorm_fusion
        _FLAGS.update(layernorm_fusion=None if flag is None else bool(flag))
    from ..common.device import get_device

    kind = get_device().type
    failure = disabled_reason()
    module, build_failure = None, ""
    if failure is None and (softmax or any(norm_fusion_enabled(n, kind) for n in NORMS)):
        module = get_module(kind, collective=True)
        if module is None:
            from .build import last_error

            error = last_error(kind)
            failure = f"build failed: {error}" if error else "kernels unavailable, see the log"
            build_failure = failure
    _STATUS = KernelStatus(
        device=kind,
        masked_softmax=_path(softmax, "--no-masked-softmax-fusion", module, failure, kind),
        layer_norm=_norm_path(_FLAGS["layernorm_fusion"], module, failure, kind),
        target=module.target() if module is not None else "", build_failure=build_failure)
    logger.debug("fused kernels: %s", _STATUS)  # the caller prints it (initialize_megatron)
    return _STATUS


def force_fallback(reason: Optional[str]) -> None:
    """Put every op on the PyTorch path for the rest of the process (None: lift that).

    The ranks agree on the kernels at start-up (:func:`megatron.initialize`): kernels built
    on some ranks only would give tensor-parallel replicas different arithmetic, so where any
    rank could not build them every rank falls back.

    Args:
        reason: said in the status line ("rank 3 could not build them: ...").
    """
    global _FORCED_OFF
    _FORCED_OFF = reason


def status():
    """The :class:`KernelStatus` of the last :func:`load`, or None before it."""
    return _STATUS

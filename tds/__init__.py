"""tds: ``import tds as deepspeed``.

DeepSpeed's public API, unchanged, with one difference: ``initialize()`` on a
``PipelineModule`` returns tds's :class:`~tds.engine.PipelineEngine`, which moves typed
tuples of tensors between stages (CPM-Pretrain's TDS) through tds's pipeline schedules and
steps megatron's optimizer (the same step as every megatron run). Every other attribute is
DeepSpeed's own (``tds.zero``, ``tds.comm``, ``tds.checkpointing``, ...). tds uses only
DeepSpeed's documented API: tests/test_tds_public_api.py lists what it imports.
"""
import os
from typing import Any, Callable, Optional, Tuple



def _name_the_cpu_accelerator():
    """``DS_ACCELERATOR=cpu`` where there is no CUDA device (tds runs on CUDA or the CPU):
    DeepSpeed's detection otherwise warns, once per process, that it "was unable to
    detect" a GPU. A value already set is kept."""
    if "DS_ACCELERATOR" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            os.environ["DS_ACCELERATOR"] = "cpu"


_name_the_cpu_accelerator()

import deepspeed as _deepspeed  # noqa: E402 (after the accelerator is named)

OLDEST_DEEPSPEED = (0, 17)
"""The oldest DeepSpeed tds is tested with (.ci/run runs the tds and pipeline tests with it);
tds uses only DeepSpeed's public API, so later releases are admitted."""


def _check_version(version):
    parts = tuple(int(p) for p in version.split("+")[0].split(".")[:2])
    if parts < OLDEST_DEEPSPEED:
        oldest = ".".join(map(str, OLDEST_DEEPSPEED))
        raise ImportError(f"tds needs DeepSpeed >= {oldest}, found {version}; install it with "
                          f"pip install 'deepspeed>={oldest}'")


_check_version(_deepspeed.__version__)


def _skip_inference_shm_build():
    """Do not compile DeepSpeed's CPU shared-memory all-reduce on first init.

    On the CPU accelerator, DeepSpeed's communication backend JIT-compiles a C++ op the first
    time it starts (one to two minutes, and it needs a compiler). The op only serves
    ``inference_all_reduce``, which training never calls. ``TDS_BUILD_SHM_COMM=1`` keeps it.
    """
    if os.environ.get("TDS_BUILD_SHM_COMM", "0") == "1":
        return
    compatible = getattr(_deepspeed.ops, "__compatible_ops__", None)
    if isinstance(compatible, dict):
        compatible["deepspeed_shm_comm"] = False


_skip_inference_shm_build()


def _quiet_deprecated_gather_name():
    """DeepSpeed's torch backend gathers with ``torch.distributed.all_gather_into_tensor``,
    which torch deprecates for ``all_gather_single`` (the same collective): the old name
    warns once per process, 8 lines in an 8-rank run. The warning is about DeepSpeed's code,
    not the user's: it is filtered (nothing of DeepSpeed's is changed)."""
    import warnings

    warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.*deprecated",
                            category=FutureWarning)
    warnings.filterwarnings("ignore", message=r".*reduce_scatter_tensor.*deprecated",
                            category=FutureWarning)


_quiet_deprecated_gather_name()

from deepspeed import (  # noqa: E402  (re-exported API)
    DeepSpeedConfig,
    DeepSpeedEngine,
    add_config_arguments,
    checkpointing,
    comm,
    init_distributed,
    zero,
)

from . import comm_ready  # noqa: E402
from .engine import DeepSpeedConfigError, PipelineEngine  # noqa: E402
from .pipe import LayerSpec, PipelineModule, TiedLayerSpec  # noqa: E402

__version__ = _deepspeed.__version__

_GONE = {"clip_grad_norm_fn": "the engine clips with megatron's clipping (each parameter "
                              "counted once across tp and pp): remove the argument",
         "pre_reduce_grads_fn": "the engine sums sequence-parallel gradients itself: remove "
                                "the argument",
         "sync_free_step": "the pipeline engine's step reads nothing on the host: remove the "
                           "argument"}


def _config_dict(config, args):
    """DeepSpeed's config as a dict: given as one, as a JSON path, or as
    ``args.deepspeed_config`` (DeepSpeed's ways)."""
    import json

    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None)  # user args: DeepSpeed's namespace
    if isinstance(config, (str, os.PathLike)):
        with open(config, encoding="utf-8") as handle:
            return json.load(handle)
    if not isinstance(config, dict):
        raise DeepSpeedConfigError("tds.initialize of a PipelineModule needs DeepSpeed's config "
                                   "(config= a dict or a JSON path, or args.deepspeed_config)")
    return config


def initialize(*args: Any, batch_fn: Optional[Callable] = None,
               batch_context: Optional[Callable[[int], Any]] = None,
               pipeline_schedule: Optional[str] = None,
               weight_grad_store: Optional[Any] = None,
               **kwargs: Any) -> Tuple[Any, Any, Any, Any]:
    """``deepspeed.initialize``; a ``PipelineModule`` gets tds's pipeline engine.

    Args:
        args, kwargs: DeepSpeed's (``model``, ``optimizer``, ``config``, ``lr_scheduler``,
            ...).
        batch_fn: pipeline only: ``raw batch -> (inputs, labels)``, applied on the first
            and last stage to what the data iterator yields (DeepSpeed's ``set_batch_fn``).
        batch_context: pipeline only: ``f(micro_batch) -> context manager``; every call of
            ``batch_fn`` for micro-batch ``micro_batch`` (0 .. gas - 1) of a step runs
            inside it, on each stage that calls it (``engine.set_batch_context``; megatron
            seeds torch's generators there, so every stage draws the same batch).
        pipeline_schedule: pipeline only: "1f1b", "interleaved", "zb-h1" or "zbv" (default:
            what the module's chunks imply: 1f1b, interleaved with virtual stages, zbv with
            the V placement); docs/pipeline_schedules.md.
        weight_grad_store: pipeline only, zero-bubble schedules: the store the model's
            layers defer their weight-gradient GEMMs to (``record(key)`` / ``flush(key)`` /
            ``check_flushed()``, e.g. megatron's ``mpu.set_weight_grad_deferral(model)``);
            without one the input pass computes every gradient.

    Returns:
        ``(engine, optimizer, training_dataloader, lr_scheduler)`` as DeepSpeed does.
    """
    gone = [name for name in _GONE if name in kwargs]
    if gone:
        raise TypeError(f"tds.initialize: {gone[0]} is gone: {_GONE[gone[0]]}")
    model = kwargs.get("model", args[1] if len(args) > 1 else None)
    if comm_ready.torch_dist.is_initialized():
        comm_ready.ensure_backend()  # else DeepSpeed initialises the process group itself
    if not isinstance(model, _deepspeed.pipe.PipelineModule):  # DeepSpeed's or ours
        if batch_fn is not None or batch_context is not None or \
                pipeline_schedule is not None or weight_grad_store is not None:
            raise TypeError("batch_fn, batch_context, pipeline_schedule and weight_grad_store "
                            "apply to a PipelineModule only")
        return _deepspeed.initialize(*args, **kwargs)
    if kwargs.get("training_data") is not None:
        raise NotImplementedError("tds's pipeline engine reads batches from the iterator given "
                                  "to train_batch(data_iter); pass training_data=None")
    if not comm_ready.torch_dist.is_initialized():
        _deepspeed.init_distributed()
    config = _config_dict(kwargs.get("config", kwargs.get("config_params")),
                          kwargs.get("args", args[0] if args else None))
    optimizer = kwargs.get("optimizer")
    if optimizer is None:
        raise DeepSpeedConfigError("tds's pipeline engine steps the optimizer you give: pass "
                                   "optimizer= (e.g. torch.optim.AdamW(model.parameters()))")
    engine = PipelineEngine(model, optimizer, config, kwargs.get("lr_scheduler"), batch_fn,
                            batch_context, pipeline_schedule, weight_grad_store)
    return engine, engine.optimizer, None, engine.lr_scheduler


def __getattr__(name):
    """Everything else is DeepSpeed's."""
    return getattr(_deepspeed, name)


__all__ = ["DeepSpeedConfig", "DeepSpeedConfigError", "DeepSpeedEngine", "LayerSpec",
           "PipelineEngine", "PipelineModule", "TiedLayerSpec", "add_config_arguments",
           "checkpointing", "comm", "init_distributed", "initialize", "zero"]

"""tds: ``import tds as deepspeed``.

DeepSpeed's public API, unchanged, with two differences: ``initialize()`` on a
``PipelineModule`` returns tds's :class:`~tds.pipe.PipelineEngine`, which moves typed
tuples of tensors between stages (CPM-Pretrain's TDS), and ``initialize(...,
sync_free_step=True)`` steps DeepSpeed's ZeRO and bf16 optimizers with no host read
(:mod:`tds.sync_free`). Every other attribute is
DeepSpeed's own (``tds.zero``, ``tds.comm``, ``tds.checkpointing``, ...).
"""
import contextlib
import functools
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

SUPPORTED_DEEPSPEED = ((0, 19), (0, 20))
"""tds subclasses DeepSpeed's pipeline engine internals: [0.19, 0.20) is what it is built on."""


def _check_version(version):
    parts = tuple(int(p) for p in version.split("+")[0].split(".")[:2])
    low, high = SUPPORTED_DEEPSPEED
    if not low <= parts < high:
        raise ImportError(f"tds needs DeepSpeed >= {'.'.join(map(str, low))} and < "
                          f"{'.'.join(map(str, high))}, found {version}; install it with "
                          f"pip install 'deepspeed>=0.19,<0.20'")


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


def _gather_under_the_current_name():
    """DeepSpeed's torch backend gathers with ``torch.distributed.all_gather_into_tensor``,
    which torch deprecates for ``all_gather_single`` (the same collective, same arguments):
    the old name warns once per process, 8 lines in an 8-rank run. The new name where torch
    has it; DeepSpeed picks the function when its backend starts, after this import."""
    import torch.distributed

    single = getattr(torch.distributed, "all_gather_single", None)
    if single is None:
        return
    from deepspeed.comm.torch import TorchBackend

    TorchBackend.get_all_gather_function = classmethod(lambda cls: single)


_gather_under_the_current_name()

from deepspeed import (  # noqa: E402  (re-exported API)
    DeepSpeedConfig,
    DeepSpeedEngine,
    add_config_arguments,
    checkpointing,
    comm,
    init_distributed,
    zero,
)

from . import comm_ready, fp16_loss_scale  # noqa: E402
from .pipe import LayerSpec, PipelineEngine, PipelineModule, TiedLayerSpec  # noqa: E402

__version__ = _deepspeed.__version__

comm_ready.install()  # CPM's order: a PipelineModule built before deepspeed.init_distributed


@contextlib.contextmanager
def _tds_pipeline_engine(**engine_kwargs):
    """Let deepspeed.initialize build tds's engine for the duration of one call."""
    original = _deepspeed.PipelineEngine
    _deepspeed.PipelineEngine = functools.partial(PipelineEngine, **engine_kwargs)
    try:
        yield
    finally:
        _deepspeed.PipelineEngine = original


def initialize(*args: Any, batch_fn: Optional[Callable] = None,
               batch_context: Optional[Callable[[int], Any]] = None,
               clip_grad_norm_fn: Optional[Callable] = None,
               pre_reduce_grads_fn: Optional[Callable[[], Any]] = None,
               sync_free_step: bool = False,
               pipeline_schedule: Optional[str] = None,
               weight_grad_store: Optional[Any] = None,
               **kwargs: Any) -> Tuple[Any, Any, Any, Any]:
    """``deepspeed.initialize``; a ``PipelineModule`` gets tds's pipeline engine.

    Args:
        args, kwargs: DeepSpeed's (``model``, ``optimizer``, ``config``, ...).
        batch_fn: pipeline only: ``raw batch -> (inputs, labels)``, applied on the first
            and last stage to what the data iterator yields (DeepSpeed's ``set_batch_fn``).
        batch_context: pipeline only: ``f(micro_batch) -> context manager``; every call of
            ``batch_fn`` for micro-batch ``micro_batch`` (0 .. gas - 1) of a step runs
            inside it, on each stage that calls it (``engine.set_batch_context``; megatron
            seeds torch's generators there, so every stage draws the same batch).
        clip_grad_norm_fn: pipeline only: ``f(parameters, max_norm) -> total norm`` that
            clips in place (default: :func:`tds.pipe.clip.clip_grad_norm_over_grid`, the
            model's norm with each parameter counted once across tp and pp).
        pre_reduce_grads_fn: pipeline only: called (no arguments) once per step after the
            last micro-batch's backward, before the gradients are reduced.
        sync_free_step: fp32/bf16: DeepSpeed's ZeRO (stages 1-2) and bf16 optimizers
            measure and clip the gradient norm on the device, with no host read per step,
            and apply a step whose norm is inf/nan instead of skipping it
            (:mod:`tds.sync_free`; needs ``config`` as a dict). ``engine.sync_free_step``
            says whether the run's optimizer got it.
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
    model = kwargs.get("model", args[1] if len(args) > 1 else None)
    if comm_ready.torch_dist.is_initialized():
        comm_ready.ensure_backend()  # else DeepSpeed initialises the process group itself
    max_norm = None
    if sync_free_step:
        from . import sync_free

        kwargs["config"], max_norm = sync_free.prepare_config(kwargs.get("config"))
    if not isinstance(model, _deepspeed.pipe.PipelineModule):  # DeepSpeed's or ours
        if batch_fn is not None or batch_context is not None or \
                clip_grad_norm_fn is not None or \
                pre_reduce_grads_fn is not None or pipeline_schedule is not None or \
                weight_grad_store is not None:
            raise TypeError("batch_fn, batch_context, clip_grad_norm_fn, pre_reduce_grads_fn, "
                            "pipeline_schedule and weight_grad_store apply to a "
                            "PipelineModule only")
        engine, *rest = _deepspeed.initialize(*args, **kwargs)
    else:
        with _tds_pipeline_engine(clip_grad_norm_fn=clip_grad_norm_fn,
                                  pre_reduce_grads_fn=pre_reduce_grads_fn,
                                  pipeline_schedule=pipeline_schedule,
                                  weight_grad_store=weight_grad_store):
            engine, *rest = _deepspeed.initialize(*args, **kwargs)
        if batch_fn is not None:
            engine.set_batch_fn(batch_fn)
        if batch_context is not None:
            engine.set_batch_context(batch_context)
    engine.sync_free_step = False
    if sync_free_step:
        sync_free.install(engine, max_norm)
    fp16_loss_scale.install(engine)  # DeepSpeed 0.19 leaves it out without ZeRO
    return (engine, *rest)


def __getattr__(name):
    """Everything else is DeepSpeed's."""
    return getattr(_deepspeed, name)


__all__ = ["DeepSpeedConfig", "DeepSpeedEngine", "LayerSpec", "PipelineEngine",
           "PipelineModule", "TiedLayerSpec", "add_config_arguments", "checkpointing", "comm",
           "init_distributed", "initialize", "zero"]

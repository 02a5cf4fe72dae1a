"""build_backend(): the one place that decides how a run trains (DDP, DeepSpeed, tds pipeline).

- ``pp > 1`` (:func:`~megatron.checkpoint.format.uses_pipeline_engine`): the model provider
  builds pipeline stages and tds's pipeline engine trains them;
- ``--deepspeed``: DeepSpeed's engine (ZeRO, its fp16/bf16 optimizers);
- otherwise torch DDP with our AdamW wrapper.
"""
import inspect
from typing import TYPE_CHECKING, Any, Callable, Optional

from .. import mpu
from ..checkpoint.format import uses_pipeline_engine

if TYPE_CHECKING:
    from .backend import TrainingBackend


def _call_provider(model_provider, pipeline):
    """``model_provider(pipeline=...)`` when it takes the argument, else Megatron's ``()``."""
    if "pipeline" in inspect.signature(model_provider).parameters:
        return model_provider(pipeline=pipeline)
    return model_provider()


def _report_parameters(model):
    """One line on rank 0: the parameters each (tensor, pipeline) rank holds (collective)."""
    import torch.distributed as dist

    count = sum(p.numel() for p in model.parameters())
    state = mpu.get_parallel_state()
    counts = [None] * dist.get_world_size()
    dist.all_gather_object(counts, (state.tp_rank, state.pp_rank, count))
    if dist.get_rank() == 0:
        ranks = ", ".join(f"({tp}, {pp}): {n}" for tp, pp, n in sorted(set(counts),
                                                                        key=lambda c: c[1::-1]))
        print(f" > number of parameters on (tensor, pipeline) model parallel ranks {ranks}",
              flush=True)


def _compile(model, cfg):
    """``--compile``: the family's layer classes (or the built-in blocks), one region each;
    says so when none matched rather than training uncompiled in silence."""
    from ..model.compile import compile_layers
    from ..utils import warn_rank_0

    family = getattr(cfg, "model_family", None)
    classes = family.compile_classes if family is not None else None
    if classes is not None and not tuple(classes):
        warn_rank_0(f"--compile compiled no layer: the {family.name!r} family's "
                    f"compile_classes is empty (compile nothing); the model runs uncompiled")
        return
    count = compile_layers(model, classes)
    if count == 0:
        what = (f"the {family.name!r} family's compile_classes "
                f"{[c.__name__ for c in classes]}" if classes else
                "ParallelTransformerLayer / T5EncoderLayer / T5DecoderLayer (give a model "
                "family with compile_classes)")
        warn_rank_0(f"--compile compiled nothing: no module of the model is one of {what}; "
                    f"the model runs uncompiled")
    else:
        from ..utils import print_rank_0

        print_rank_0(f"> --compile: {count} layers compiled, one region each")


def build_backend(cfg: Any, model_provider: Callable,
                  batch_fn: Optional[Callable] = None) -> "TrainingBackend":
    """Build the model through ``model_provider`` and the backend that trains it.

    Args:
        cfg: the run configuration.
        model_provider: ``f(pipeline: bool) -> module`` (a tds ``PipelineModule`` when
            ``pipeline``), or Megatron's ``f() -> module``.
        batch_fn: ``raw batch -> (inputs, labels)`` for the pipeline engine (the family's);
            a pipeline module built by a Megatron-DeepSpeed style provider may carry it as
            ``_megatron_batch_fn`` instead.

    Returns:
        A :class:`~.backend.TrainingBackend`.
    """
    pipeline = uses_pipeline_engine(cfg.parallel.pp)
    engine = pipeline or cfg.parallel.deepspeed
    if engine:
        from .backend_engine import EngineBackend, attach_deepspeed_comm

        attach_deepspeed_comm(cfg)  # a PipelineModule needs it while it is built
    model = _call_provider(model_provider, pipeline)
    if cfg.kernels.compile:  # --compile: regional, each transformer layer in place
        _compile(model, cfg)
    _report_parameters(model)
    if engine:
        batch_fn = batch_fn or getattr(model, "_megatron_batch_fn", None)
        return EngineBackend.build(model, cfg, pipeline, batch_fn)
    from .backend_ddp import DDPBackend

    return DDPBackend.build(model, cfg)

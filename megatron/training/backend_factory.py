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
    count = sum(p.numel() for p in model.parameters())
    state = mpu.get_parallel_state()
    if state.dp_rank == 0:
        print(f" > number of parameters on (tensor, pipeline) model parallel rank "
              f"({state.tp_rank}, {state.pp_rank}): {count}", flush=True)


def _compile(model, cfg, pipeline):
    """``--compile``: each pipeline chunk as one region, its loss included (pp = 1: the whole
    model and the family's loss); a family whose ``compile_classes`` is ``()`` opts out."""
    from ..model.compile import compile_model, compile_pipeline, compiler
    from ..utils import print_rank_0, warn_rank_0

    family = getattr(cfg, "model_family", None)
    classes = family.compile_classes if family is not None else None
    if classes is not None and not tuple(classes):
        warn_rank_0(f"--compile compiled nothing: the {family.name!r} family's "
                    f"compile_classes is empty (compile nothing); the model runs uncompiled")
        return
    zero_bubble = getattr(cfg.parallel, "pipeline_schedule", "1f1b") in ("zb-h1", "zbv")
    mode = {"mode": "reduce-overhead"} if cfg.kernels.cuda_graphs else {}
    compile_fn = compiler(defers_weight_grads=pipeline and zero_bubble, **mode)
    if pipeline:
        regions = compile_pipeline(model, compile_fn)
        what = f"{len(regions.train)} pipeline chunk(s), one region each"
        if regions.loss_chunk is not None:
            what += ", the loss in the last chunk's"
    else:
        loss_fn = family.loss_fn if family is not None else None
        compile_model(model, loss_fn, compile_fn, cuda_graphs=bool(mode))
        what = "the model as one region" + (", its loss included" if loss_fn else "")
    print_rank_0(f"> --compile: {what} (compiled on the first step)")


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
    if cfg.kernels.compile:  # --compile: each pipeline chunk (or the model) one region
        _compile(model, cfg, pipeline)
    _report_parameters(model)
    if engine:
        batch_fn = batch_fn or getattr(model, "_megatron_batch_fn", None)
        return EngineBackend.build(model, cfg, pipeline, batch_fn)
    from .backend_ddp import DDPBackend

    return DDPBackend.build(model, cfg)

"""build_backend(): the one place that decides how a run trains.

- ``--deepspeed`` at pp 1: DeepSpeed's engine (its ZeRO stages, its fp16/bf16 optimizers),
  :mod:`.backend_engine`;
- every other run: the project's own step (:mod:`.backend_step`), the same at every layout;
  at ``pp > 1`` (:func:`~megatron.checkpoint.format.uses_pipeline_engine`) the model
  provider builds pipeline stages and tds's pipeline schedule runs their passes.
"""
import inspect
from typing import TYPE_CHECKING, Any, Callable, Optional

from .. import mpu
from ..checkpoint.format import uses_pipeline_engine
from ..config.run_config import RunConfig
from ..config.run_config import ZERO_BUBBLE_SCHEDULES

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


def check_pipeline_module(model: Any, cfg: RunConfig) -> None:
    """Raise unless ``model``, built for a pipeline run, is a tds ``PipelineModule`` with the
    run's chunks per rank and placement: the pipeline features a family provides are what
    its ``build_model(cfg, pipeline=True)`` builds (every rank builds the same class, so
    every rank raises alike, before any step).

    Raises:
        ConfigError: naming the flag and what the model built instead.
    """
    from deepspeed.pipe import PipelineModule

    from ..common.errors import ConfigError
    from ..families import pipeline_placement

    family = cfg.model_family
    who = f"the {family.name!r} model family's build_model(cfg, pipeline=True)" \
        if family is not None else "the model provider (pipeline=True)"
    p = cfg.parallel
    if not isinstance(model, PipelineModule):
        raise ConfigError(f"--pipeline-model-parallel-size {p.pp}: {who} returned a "
                          f"{type(model).__name__}, not a tds PipelineModule; build the "
                          f"layers as pipeline stages (docs/new_model.md, section 2) or drop "
                          f"the flag")
    chunks = getattr(model, "num_virtual_stages", 1)
    if chunks != p.vpp:
        raise ConfigError(f"--virtual-pipeline-model-parallel-size {p.vpp}: {who} built "
                          f"{chunks} chunk(s) per pipeline rank; pass num_virtual_stages="
                          f"cfg.parallel.vpp to the PipelineModule, or drop the flag")
    placement = getattr(model, "placement_kind", "loop")
    if placement != pipeline_placement(cfg):
        raise ConfigError(f"--pipeline-schedule {p.pipeline_schedule}: {who} placed its "
                          f"chunks as {placement!r}; pass placement=megatron.families."
                          f"pipeline_placement(cfg) ({pipeline_placement(cfg)!r}) to the "
                          f"PipelineModule")


def _compile(model, cfg: RunConfig, pipeline):
    """``--compile``: each pipeline chunk as one region, its loss included (pp = 1: the whole
    model and the family's loss); a family whose ``compile_classes`` is ``()`` opts out."""
    from ..model.compile import compile_model, compile_pipeline, compiler
    from ..common.utils import print_rank_0, warn_rank_0

    family = cfg.model_family
    classes = family.compile_classes if family is not None else None
    if classes is not None and not tuple(classes):
        warn_rank_0(f"--compile compiled nothing: the {family.name!r} family's "
                    f"compile_classes is empty (compile nothing); the model runs uncompiled")
        return
    zero_bubble = cfg.parallel.pipeline_schedule in ZERO_BUBBLE_SCHEDULES
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


def build_backend(cfg: RunConfig, model_provider: Callable,
                  batch_fn: Optional[Callable] = None) -> "TrainingBackend":
    """Build the model through ``model_provider`` and the backend that trains it.

    Args:
        cfg: the run configuration.
        model_provider: ``f(pipeline: bool) -> module`` (a tds ``PipelineModule`` when
            ``pipeline``), or Megatron's ``f() -> module``.
        batch_fn: ``raw batch -> (inputs, labels)``, the family's (seeded:
            :mod:`.batch_draws`), for the serial forward step and the pipeline engine; a
            pipeline module built by a Megatron-DeepSpeed style provider may carry it as
            ``_megatron_batch_fn`` instead (seeded here).

    Returns:
        A :class:`~.backend.TrainingBackend`.
    """
    pipeline = uses_pipeline_engine(cfg.parallel.pp)
    engine = cfg.parallel.deepspeed and not pipeline
    if engine or pipeline:
        from .backend_engine import attach_deepspeed_comm

        attach_deepspeed_comm(cfg)  # DeepSpeed's PipelineModule needs it while it is built
    model = _call_provider(model_provider, pipeline)
    if pipeline:
        check_pipeline_module(model, cfg)
    if cfg.kernels.compile:  # --compile: each pipeline chunk (or the model) one region
        _compile(model, cfg, pipeline)
    _report_parameters(model)
    from .batch_draws import seeded

    if pipeline:
        batch_fn = batch_fn or getattr(model, "_megatron_batch_fn", None)
    batch_fn = seeded(batch_fn, cfg)
    if engine:
        from .backend_engine import EngineBackend

        return EngineBackend.build(model, cfg, batch_fn)
    from .backend_step import StepBackend

    backend = StepBackend.build(model, cfg, batch_fn, pipeline)
    backend.batch_draws = batch_fn
    return backend

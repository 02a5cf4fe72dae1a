"""The start-up check: print the predicted peak per stage; on a GPU, refuse (or warn about)
a run predicted not to fit, before the model is allocated."""
from dataclasses import fields
from typing import List, Optional

from ..resilience.agreement import agree
from ..common.errors import ConfigError, WillNotFitError
from .planner import Hardware, plan
from .report import GIB, format_stage, predict
from .spec import MemorySpec

#: Knobs a suggested change may turn (each counts one change).
KNOBS = ("tp", "pp", "micro_batch", "recompute", "zero_stage", "sequence_parallel")


def _changes(old: MemorySpec, new: MemorySpec) -> List[str]:
    names = {f.name for f in fields(MemorySpec)}
    return [f"{k} {getattr(old, k)} -> {getattr(new, k)}" for k in KNOBS
            if k in names and getattr(old, k) != getattr(new, k)]


def cheapest_changes(spec: MemorySpec, free_bytes: int, step_flops: float = 1.0,
                     count: int = 2) -> List[str]:
    """Up to ``count`` layouts on the same GPUs that fit in ``free_bytes``: fewest changed
    knobs first, then the fastest (the planner's step time).

    Args:
        spec: the run that does not fit.
        free_bytes: memory per GPU to fit in.
        step_flops: the step's model FLOPs (ranks layouts of equal change count).
        count: how many to return.
    """
    hw = Hardware(gpus=spec.world, gpu_memory=free_bytes)
    batch = spec.micro_batch * spec.num_micro_batches * spec.dp
    fits = plan(spec, hw, batch, step_flops)
    ranked = sorted(fits, key=lambda p: (len(_changes(spec, p.spec)), p.step_time))
    return [f"{', '.join(_changes(spec, p.spec))} (peak {p.peak / GIB:.2f} GiB)"
            for p in ranked if _changes(spec, p.spec)][:count]


def check_memory(spec: MemorySpec, free_bytes: Optional[int], enforce: bool = True,
                 step_flops: float = 1.0) -> List[str]:
    """Lines to print at start-up; raise when the heaviest stage exceeds ``free_bytes``.

    Args:
        spec: the run.
        free_bytes: this device's free memory (``torch.cuda.mem_get_info()[0]``), or None
            on a CPU (nothing is refused).
        enforce: raise (True) or return a warning line (False, ``--no-memory-check``).
        step_flops: the step's model FLOPs, to rank the suggested changes.

    Raises:
        WillNotFitError: a stage's predicted peak exceeds ``free_bytes`` and ``enforce``.
    """
    stages = predict(spec)
    lines = [format_stage(s, spec.pp) for s in stages]
    if free_bytes is None:
        return lines
    worst = max(stages, key=lambda s: s.peak)
    if worst.peak <= free_bytes:
        return lines
    fixes = cheapest_changes(spec, free_bytes, step_flops)
    message = (f"pipeline stage {worst.stage} is predicted to need {worst.peak / GIB:.2f} GiB "
               f"per GPU but the device has {free_bytes / GIB:.2f} GiB free; changes that "
               f"would fit: {'; '.join(fixes) or 'none found on this many GPUs'} "
               f"(--no-memory-check runs it anyway; docs/memory.md)")
    if enforce:
        raise WillNotFitError(message)
    return lines + ["WARNING: " + message]


def free_device_memory(device) -> Optional[int]:
    """Bytes free on ``device`` (a ``torch.device``) now, or None on a CPU (not checked)."""
    import torch

    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None


def startup_memory_check(cfg, step_flops: Optional[float] = None) -> None:
    """pretrain()'s hook: print the predicted peak per stage on rank 0; on a GPU, raise
    :class:`WillNotFitError` on every rank for a run predicted not to fit on any rank's
    device (a warning under ``--no-memory-check``; collective: the ranks agree, one
    rank's device with less free memory stops them all). A model without a memory
    description (its family's ``memory_model`` is None, or a provider's model) gets one line
    saying so.

    Args:
        cfg: the run configuration.
        step_flops: the step's model FLOPs (ranks the suggested changes).
    """
    from .. import mpu
    from ..common.utils import print_rank_0
    from .spec import spec_from_run_config

    line = recompute_line(cfg, mpu.get_device().type)
    if line:
        print_rank_0(line)
    kind, why = _kind(cfg)
    if why:  # a description the model cannot serve: the run still trains
        print_rank_0(f"> memory model: no prediction ({why})")
        return
    if kind is None:
        who = (f"the {cfg.family!r} model family" if cfg.family else
               "a model built by a model_provider")
        print_rank_0(f"> memory model: none for {who}, so no per-stage prediction and no "
                     f"fit check (a family describes its model with memory_model='gpt2' for "
                     f"a decoder-only transformer; docs/memory.md)")
        return
    device = mpu.get_device()
    try:
        spec = spec_from_run_config(cfg, device=device.type)
    except ConfigError as exc:  # a run the model does not describe still trains
        print_rank_0(f"> memory model: no prediction ({exc})")
        return
    lines, error = [], None
    try:  # each rank decides on its own device's free memory; the ranks agree on it below
        lines = check_memory(spec, free_device_memory(device),
                             enforce=cfg.get("memory_check", True), step_flops=step_flops or 1.0)
    except WillNotFitError as exc:
        error = exc
    agree(error, "the start-up memory check", error_type=WillNotFitError)
    print_rank_0("> memory model (docs/memory.md):\n  " + "\n  ".join(
        line for line in lines if not line.startswith("WARNING")))
    for line in lines:
        if line.startswith("WARNING"):
            print(line, flush=True)  # every rank, as the refusal would be


def _kind(cfg):
    """``(the memory model's kind of the run's model or None, why it has none or "")``: a
    family's description that describes nothing here is said, not raised."""
    from .spec import memory_model_of

    try:
        return memory_model_of(cfg), ""
    except ConfigError as exc:
        return None, str(exc)


def recompute_line(cfg, device_type: str) -> Optional[str]:
    """The start-up line saying what the run recomputes (None without recompute): under
    selective recompute, whether its attention keeps ``s x s`` tensors to recompute.

    Args:
        cfg: the run configuration.
        device_type: ``cuda`` or ``cpu``.
    """
    from ..config.recompute import describe
    from ..model.attention import resolve_attention_backend
    from ..model.recompute import core_keeps_scores

    m = cfg.model
    backend = resolve_attention_backend(cfg.kernels.attention_backend)
    keeps = core_keeps_scores(backend, device_type, m.attention_dropout,
                              mask_needs_grad=_kind(cfg)[0] == "t5")
    return describe(m.recompute_granularity, m.recompute_method, m.recompute_num_layers,
                    keeps, backend)

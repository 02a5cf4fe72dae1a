"""Know before you launch: memory per pipeline stage from the run configuration alone.

    spec = spec_from_run_config(cfg)          # sizes, layout, precision (no process group)
    for stage in predict(spec):               # states + activations + buffers + transients
        print(format_stage(stage, spec.pp))

One concept per module: :mod:`.spec` (what the model reads), :mod:`.describe` (how a
family describes its layers), :mod:`.stages` (which layers a pipeline stage holds),
:mod:`.model_states` (parameters, gradients, optimizer), :mod:`.activations` /
:mod:`.t5_activations` (bytes saved for the backward), :mod:`.backward` (the gradients a
backward holds beyond them), :mod:`.deferred` (what a zero-bubble weight pass needs),
:mod:`.chunks` (each chunk's byte counts), :mod:`.walk` / :mod:`.walk_zbv` (a schedule's
moments as integer rows), :mod:`.schedule` (in-flight micro-batches), :mod:`.grad_timing`
(whose gradients live through a step), :mod:`.report` (the per-stage peak, the optimizer
step's included), :mod:`.plans` / :mod:`.planner` / :mod:`.ranking` (every layout that
fits, ranked in seconds), :mod:`.step_time` (its step-time model and the H100 / A100
presets), :mod:`.published` / :mod:`.korthikanti` (that model against Narayanan et al.
2021's Table 1 and Korthikanti et al. 2022's Tables 2-5) and :mod:`.check` (the start-up
check).
docs/memory.md gives the formulas and their measured error.
"""
from .describe import LayerDescription
from .report import GIB, StageMemory, format_stage, predict
from .spec import MemorySpec, spec_from_run_config

__all__ = ["GIB", "LayerDescription", "MemorySpec", "StageMemory", "format_stage", "predict",
           "spec_from_run_config"]

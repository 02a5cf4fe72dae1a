"""The per-stage prediction: the larger of the micro-batches' peak (model states +
in-flight activations + buffers + the largest transient, less the gradients not yet
allocated then) and the optimizer step's (model states + the step's temporaries)."""
from dataclasses import asdict, dataclass, replace
from typing import List, Optional

from .activations import layer_weight_copy
from .chunks import chunk_bytes, rank_grad_bytes, rank_states, stage_layout
from .model_states import ModelStates
from .spec import MemorySpec
from .stages import StageLayers
from .t5_activations import t5_layer_weight_copy
from .walk import RankPeaks, peaks, rank_walks

GIB = 2 ** 30


@dataclass(frozen=True)
class StageMemory:
    """Predicted bytes on each rank of one pipeline stage."""

    stage: int
    states: ModelStates
    activations_per_micro_batch: int
    """Saved for the backward by one micro-batch (one chunk's share when interleaved)."""
    in_flight: int
    """Micro-batches (chunks) whose activations are alive at once."""
    buffers: int
    """The pipeline's stage outputs and received masks held for the backward."""
    transient: int
    """What short-lived working sets add at their worst moment beyond the most activation
    and gradient bytes alive at once: a backward's gradients in flight
    (megatron/memory/backward.py: the logits' gradient, a layer's GEMM gradients, under SP
    its re-gathered input, a recomputed group's activations) on what was alive before it,
    or the 16-bit logits next to their fp32 copy while the loss runs (megatron/memory/
    walk.py weighs each moment of the schedule)."""
    activation_peak: Optional[int] = None
    """The most activation bytes alive at once, each chunk charged its own bytes (the head
    and the embedding in the chunks that hold them); None: per micro-batch x count."""
    late_grads: int = 0
    """Gradient bytes not yet allocated when the activations peak (the engine frees them
    after each step; the rank peaks before its first backward: megatron/memory/
    grad_timing.py)."""
    step: int = 0
    """Bytes beyond the model states while the gradients are reduced and the optimizer
    steps (:func:`~megatron.memory.model_states.step_bytes`)."""
    weight_copies: int = 0
    """Autocast's compute-dtype copies of the rank's linear weights: made once per step,
    shared by every micro-batch in flight, freed before the optimizer steps
    (:func:`autocast_weight_copies`)."""

    @property
    def activations(self) -> int:
        if self.activation_peak is not None:
            return self.activation_peak
        return self.activations_per_micro_batch * self.in_flight

    @property
    def schedule_peak(self) -> int:
        """The peak while the micro-batches run forward and backward."""
        return self.states.total - self.late_grads + self.activations + self.buffers + \
            self.transient + self.weight_copies

    @property
    def step_peak(self) -> int:
        """The peak while the optimizer steps."""
        return self.states.total + self.step

    @property
    def peak(self) -> int:
        return max(self.schedule_peak, self.step_peak)

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(activations=self.activations, peak=self.peak,
                   schedule_peak=self.schedule_peak, step_peak=self.step_peak)
        return out


def predict(spec: MemorySpec, reference: bool = False) -> List[StageMemory]:
    """Predicted memory of every pipeline stage (one entry per stage).

    Args:
        spec: the run (:func:`~megatron.memory.spec.spec_from_run_config`).
        reference: walk tds's lowered action lists rather than this module's orders (the
            slow path the planner's ranking is checked against).

    Raises:
        ConfigError: a spec the model does not describe.
    """
    spec.check()
    layout = stage_layout(spec)
    saved, cb = chunk_bytes(spec, layout.parts)
    walks = rank_walks(spec.pipeline_schedule if spec.pp > 1 else "", spec.pp, spec.vpp,
                       spec.num_micro_batches, reference)
    saved_only = replace(cb, saved=saved)
    states = rank_states(spec)
    return [stage_memory(spec, r, saved, peaks(walk, cb), peaks(walk, saved_only).activations,
                         states) for r, walk in enumerate(walks)]


def stage_memory(spec: MemorySpec, r: int, saved, rank: RankPeaks, saved_peak: int,
                 states_steps=None) -> StageMemory:
    """Pipeline rank ``r``'s :class:`StageMemory` from its walk's peaks.

    Args:
        spec: the run.
        r: the pipeline rank.
        saved: per global chunk, the bytes one micro-batch saves (without what the engine
            keeps beside them).
        rank: the rank's peaks with the engine's outputs and masks
            (:func:`~megatron.memory.walk.peaks`).
        saved_peak: the rank's most saved bytes at once, without them.
        states_steps: :func:`~megatron.memory.chunks.rank_states` of ``spec`` (given by a
            caller that asks for every rank).
    """
    layout = stage_layout(spec)
    layers, mine = layout.stages[r], layout.chunks_of[r]
    states, step = (states_steps or rank_states(spec))[r]
    buffers = rank.activations - saved_peak  # stage outputs and received masks
    rank_grads = rank_grad_bytes(spec, mine)
    late = min(states.grad_bytes, rank.activations + rank_grads - rank.with_grads)
    return StageMemory(layers.stage, states, sum(saved[c] for c in mine) // spec.vpp,
                       rank.in_flight, buffers, rank.with_transient - rank.with_grads,
                       saved_peak, late, step, autocast_weight_copies(spec, layers))


def autocast_weight_copies(spec: MemorySpec, layers: StageLayers) -> int:
    """Autocast's compute-dtype copies of the weights a rank's linear layers read: made at
    their first use in the step, shared by every micro-batch, freed when the step's
    autocast region closes (before the optimizer step); 0 without autocast.

    Args:
        spec: the run.
        layers: the rank's layers (every chunk's).
    """
    if not spec.autocast:
        return 0
    if spec.family == "t5":
        total = layers.encoder_layers * t5_layer_weight_copy(spec, False) + \
            layers.decoder_layers * t5_layer_weight_copy(spec, True)
    else:
        total = layers.encoder_layers * layer_weight_copy(spec)
        if layers.moe_layers:  # no dense MLP; the shared experts' (the experts' casts
            h, t = spec.hidden, spec.tp  # are per micro-batch: megatron/memory/moe.py)
            mlp = (3 if spec.gated else 2) * h * (spec.ffn - spec.moe_shared_ffn) // t
            total -= layers.moe_layers * mlp * spec.e
    if layers.head:
        total += spec.vocab // spec.tp * spec.hidden * spec.e
    return total


def byte_unit(size: int):
    """``(divisor, name)`` to print ``size`` bytes and its parts with: GiB from 1 GiB up, else
    MiB (a small model's figures, not a column of 0.00 GiB)."""
    return (GIB, "GiB") if size >= GIB else (2 ** 20, "MiB")


def format_stage(stage: StageMemory, pp: int) -> str:
    """One start-up line: ``stage 1/4: predicted peak 12.3 GiB per rank = weights ...``
    (in MiB for a stage under 1 GiB).

    Args:
        stage: a stage's prediction.
        pp: pipeline stages (for the ``stage/pp`` label).
    """
    s = stage.states
    div, unit = byte_unit(stage.peak)
    head = f"stage {stage.stage}/{pp}: predicted peak {stage.peak / div:.2f} {unit} per rank"
    states = (f"weights {s.weight_bytes / div:.2f} + grads {s.grad_bytes / div:.2f} + "
              f"optimizer {s.optimizer_bytes / div:.2f}")
    late = f" - grads not yet allocated {stage.late_grads / div:.2f}" if stage.late_grads \
        else ""
    during = (f"activations {stage.activations / div:.2f} ({stage.in_flight} micro-batches x "
              f"{stage.activations_per_micro_batch / 2**20:.1f} MiB) + buffers "
              f"{stage.buffers / div:.2f} + transient {stage.transient / div:.2f}")
    if stage.weight_copies:
        during += f" + autocast weight copies {stage.weight_copies / div:.2f}"
    if stage.step_peak > stage.schedule_peak:
        return (f"{head} at the optimizer step = {states} + step buffers "
                f"{stage.step / div:.2f}; forward/backward {stage.schedule_peak / div:.2f} = "
                f"states{late} + {during}")
    return f"{head} = {states}{late} + {during}"

"""The per-stage prediction: the larger of the micro-batches' peak (model states +
in-flight activations + buffers + the largest transient, less the gradients not yet
allocated then) and the optimizer step's (model states + the step's temporaries)."""
from dataclasses import asdict, dataclass
from typing import List, Optional

from .activations import gpt2_stage
from .backward import gpt2_backward, t5_backward
from .grad_timing import grads_freed_each_step, late_grads, with_grads_peaks
from .model_states import ModelStates, model_states, step_bytes
from .deferred import deferred_bytes, gemm_weight_params
from .schedule import activation_peaks, in_flight, rank_chunks
from .spec import MemorySpec
from .stages import chunk_layers, rank_layers, stage_layers
from .t5_activations import t5_stage

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
    """DDP gradient buckets; the pipeline's stage outputs and received masks held for the
    backward."""
    transient: int
    """The largest short-lived working set: 16-bit logits next to their fp32 copy while the
    loss runs, or a backward's gradients in flight (megatron/memory/backward.py: the
    logits' gradient, a layer's GEMM gradients, under SP its re-gathered input, a
    recomputed group's activations)."""
    activation_peak: Optional[int] = None
    """Interleaved: the most bytes alive at once, each chunk charged its own bytes (the
    head and the embedding in the chunks that hold them); None: per micro-batch x count."""
    late_grads: int = 0
    """Gradient bytes not yet allocated when the activations peak (the engine frees them
    after each step; the rank peaks before its first backward: megatron/memory/
    grad_timing.py)."""
    step: int = 0
    """Bytes beyond the model states while the gradients are reduced and the optimizer
    steps (:func:`~megatron.memory.model_states.step_bytes`)."""

    @property
    def activations(self) -> int:
        if self.activation_peak is not None:
            return self.activation_peak
        return self.activations_per_micro_batch * self.in_flight

    @property
    def schedule_peak(self) -> int:
        """The peak while the micro-batches run forward and backward."""
        return self.states.total - self.late_grads + self.activations + self.buffers + \
            self.transient

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


def _hidden_out(spec: MemorySpec) -> int:
    """Bytes of one micro-batch's stage output (what a pipeline stage sends and keeps)."""
    tokens = spec.micro_batch * (spec.seq + (spec.dec_seq if spec.family == "t5" else 0))
    return tokens * spec.hidden * spec.residual_bytes // (spec.tp if spec.sequence_parallel
                                                          else 1)


def _received_masks(spec: MemorySpec) -> int:
    """Bytes of the bool masks one micro-batch brings to a stage with its hidden states
    (GPT-2: ``[1, 1, s, s]``; T5: encoder, decoder and cross masks per sample), kept with
    the received inputs until the backward."""
    if spec.family == "gpt2":
        return spec.seq * spec.seq
    se, sd = spec.seq, spec.dec_seq
    return spec.micro_batch * (se * se + sd * sd + sd * se)


def _pipeline_buffers(spec: MemorySpec, layers, count: int) -> int:
    """What the engine keeps per in-flight micro-batch beyond the saved activations: the
    output of each chunk but the last (until its backward) and the masks each chunk but
    the first received. ``count`` is in chunks when interleaved (each rank holds ``vpp``)."""
    if spec.pp == 1:
        return 0
    v = spec.vpp
    outputs = count * (v - 1) // v if layers.head else count
    masks = count * (v - 1) // v if layers.stage == 0 else count
    return outputs * _hidden_out(spec) + masks * _received_masks(spec)


def _loss_forward(spec: MemorySpec) -> int:
    """16-bit logits next to their fp32 copy (which becomes the kept softmax) while the loss
    runs; fp32 logits become the softmax themselves (the loss works in place)."""
    tokens = spec.micro_batch * (spec.dec_seq if spec.family == "t5" else spec.seq)
    return tokens * spec.vocab // spec.tp * (spec.e if spec.e < 4 else 0)


def predict(spec: MemorySpec) -> List[StageMemory]:
    """Predicted memory of every pipeline stage (one entry per stage).

    Args:
        spec: the run (:func:`~megatron.memory.spec.spec_from_run_config`).

    Raises:
        ConfigError: a spec the model does not describe.
    """
    spec.check()
    schedule = spec.pipeline_schedule
    counts = in_flight(spec.pp, spec.num_micro_batches, spec.vpp, schedule)
    stage_fn, backward_fn = (gpt2_stage, gpt2_backward) if spec.family == "gpt2" else \
        (t5_stage, t5_backward)
    parts = chunk_layers(spec) if spec.vpp > 1 else stage_layers(spec)
    chunks_of = rank_chunks(spec.pp, spec.vpp, schedule)  # each rank's global chunks
    stages = [rank_layers(parts, r, mine) for r, mine in enumerate(chunks_of)] \
        if schedule == "zbv" else stage_layers(spec)  # a loop: the stages' own partition
    acts = [stage_fn(spec, part) for part in parts]
    backwards = [backward_fn(spec, part, act) for part, act in zip(parts, acts)]
    saved = tuple(act.saved for act in acts)
    peaks = [None] * spec.pp
    if spec.vpp > 1 or schedule in ("zb-h1", "zbv"):
        deferred = tuple(deferred_bytes(spec, part) for part in parts)
        peaks = activation_peaks(spec.pp, spec.num_micro_batches, spec.vpp, saved, schedule,
                                 deferred)
    grads = tuple(model_states(spec, part).grad_bytes for part in parts)
    gemm = tuple(0 if schedule not in ("zb-h1", "zbv") else
                 min(g, gemm_weight_params(spec, part) * g // max(1, model_states(spec, part).params))
                 for g, part in zip(grads, parts))
    timing = with_grads_peaks(spec.pp, spec.num_micro_batches, spec.vpp, saved, grads,
                              schedule, gemm) if grads_freed_each_step(spec) else None
    out = []
    for layers, count, peak, mine in zip(stages, counts, peaks, chunks_of):
        states = model_states(spec, layers)
        per_micro_batch = sum(acts[c].saved for c in mine) // spec.vpp
        buffers = states.grad_bytes if spec.backend == "ddp" and spec.dp > 1 else 0
        buffers += _pipeline_buffers(spec, layers, count)
        transient = max(max(backwards[c] for c in mine),
                        _loss_forward(spec) if layers.head else 0)
        late = min(states.grad_bytes, late_grads(spec, timing, sum(grads[c] for c in mine),
                                                 layers.stage)) if timing else 0
        out.append(StageMemory(layers.stage, states, per_micro_batch, count, buffers,
                               transient, peak, late, step_bytes(spec, layers, states)))
    return out


def format_stage(stage: StageMemory, pp: int) -> str:
    """One start-up line: ``stage 1/4: predicted peak 12.3 GiB per rank = weights ...``.

    Args:
        stage: a stage's prediction.
        pp: pipeline stages (for the ``stage/pp`` label).
    """
    s = stage.states
    head = f"stage {stage.stage}/{pp}: predicted peak {stage.peak / GIB:.2f} GiB per rank"
    states = (f"weights {s.weight_bytes / GIB:.2f} + grads {s.grad_bytes / GIB:.2f} + "
              f"optimizer {s.optimizer_bytes / GIB:.2f}")
    late = f" - grads not yet allocated {stage.late_grads / GIB:.2f}" if stage.late_grads \
        else ""
    during = (f"activations {stage.activations / GIB:.2f} ({stage.in_flight} micro-batches x "
              f"{stage.activations_per_micro_batch / 2**20:.1f} MiB) + buffers "
              f"{stage.buffers / GIB:.2f} + transient {stage.transient / GIB:.2f}")
    if stage.step_peak > stage.schedule_peak:
        return (f"{head} at the optimizer step = {states} + step buffers "
                f"{stage.step / GIB:.2f}; forward/backward {stage.schedule_peak / GIB:.2f} = "
                f"states{late} + {during}")
    return f"{head} = {states}{late} + {during}"

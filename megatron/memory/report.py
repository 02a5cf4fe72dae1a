"""The per-stage prediction: the larger of the micro-batches' peak (model states +
in-flight activations + buffers + the largest transient, less the gradients not yet
allocated then) and the optimizer step's (model states + the step's temporaries)."""
from dataclasses import asdict, dataclass, replace
from typing import List, Optional

from .activations import gpt2_stage
from .backward import gpt2_backward, t5_backward
from .deferred import deferred_bytes, gemm_weight_params, largest_weight_grad
from .grad_timing import grads_freed_each_step
from .model_states import ModelStates, model_states, step_bytes
from .spec import MemorySpec
from .stages import chunk_layers, rank_layers, stage_layers
from .t5_activations import t5_stage
from .walk import ChunkBytes, peaks, rank_chunks, rank_walks

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


def _chunk_buffers(spec: MemorySpec, chunk: int) -> int:
    """What the engine keeps per micro-batch of global ``chunk`` beyond its saved
    activations, from its forward to its backward: its output unless it is the last chunk,
    and the masks it received unless it is the first."""
    if spec.pp == 1:
        return 0
    last = spec.pp * spec.vpp - 1
    # a GPT-2 chunk's recomputed layers save the received mask (counted as activations)
    saved_mask = spec.family == "gpt2" and spec.recompute == "full"
    return _hidden_out(spec) * (chunk != last) + \
        _received_masks(spec) * (chunk != 0 and not saved_mask)


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
    parts = chunk_layers(spec) if spec.vpp > 1 else stage_layers(spec)
    chunks_of = rank_chunks(spec.pp, spec.vpp, schedule)  # each rank's global chunks
    stages = [rank_layers(parts, r, mine) for r, mine in enumerate(chunks_of)] \
        if schedule == "zbv" else stage_layers(spec)  # a loop: the stages' own partition
    acts, cb = chunk_bytes(spec, parts)
    walks = rank_walks(schedule if spec.pp > 1 else "", spec.pp, spec.vpp,
                       spec.num_micro_batches)
    out = []
    saved_only = replace(cb, saved=tuple(a.saved for a in acts))
    for layers, walk, mine in zip(stages, walks, chunks_of):
        states = model_states(spec, layers)
        rank = peaks(walk, cb)  # activations with what the engine keeps beside them
        saved = peaks(walk, saved_only).activations
        buffers = states.grad_bytes if spec.backend == "ddp" and spec.dp > 1 else 0
        buffers += rank.activations - saved  # stage outputs and received masks
        rank_grads = sum(cb.grads[c] for c in mine)  # 0: they live through the step
        late = min(states.grad_bytes, rank.activations + rank_grads - rank.with_grads)
        out.append(StageMemory(layers.stage, states,
                               sum(acts[c].saved for c in mine) // spec.vpp, rank.in_flight,
                               buffers, rank.with_transient - rank.with_grads, saved, late,
                               step_bytes(spec, layers, states)))
    return out


def chunk_bytes(spec: MemorySpec, parts) -> tuple:
    """``(activations per chunk, ChunkBytes)`` of the model chunks ``parts`` (one per stage
    without interleaving): what a micro-batch saves (with the stage output and the masks
    the engine keeps beside it), keeps for a zero-bubble weight pass, the gradients and
    when they appear, and each chunk's backward and loss-forward transients."""
    stage_fn, backward_fn = (gpt2_stage, gpt2_backward) if spec.family == "gpt2" else \
        (t5_stage, t5_backward)
    acts = [stage_fn(spec, part) for part in parts]
    saved = tuple(act.saved + _chunk_buffers(spec, part.stage) for act, part in zip(acts, parts))
    zb = schedule_is_zero_bubble(spec)
    deferred = tuple(deferred_bytes(spec, part) for part in parts) if zb else saved
    params = [model_states(spec, part) for part in parts]
    grads = tuple(x.grad_bytes if grads_freed_each_step(spec) else 0 for x in params)
    gemm = tuple(min(g, gemm_weight_params(spec, part) * g // max(1, x.params)) if zb else 0
                 for g, part, x in zip(grads, parts, params))
    transient = [backward_fn(spec, part, act) for part, act in zip(parts, acts)]
    forward = tuple(_loss_forward(spec) if part.head else 0 for part in parts)
    per_param = 4 if spec.backend == "ddp" or spec.dtype == "fp32" else spec.e
    weight_pass = tuple(largest_weight_grad(spec, part, per_param) for part in parts) \
        if zb else ()
    return acts, ChunkBytes(saved, deferred, grads, gemm, tuple(t.any for t in transient),
                            tuple(t.first for t in transient), forward, weight_pass)


def schedule_is_zero_bubble(spec: MemorySpec) -> bool:
    """A zero-bubble schedule (input and weight passes apart)."""
    return spec.pp > 1 and spec.pipeline_schedule in ("zb-h1", "zbv")


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

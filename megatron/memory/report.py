"""The per-stage prediction: model states + in-flight activations + buffers = peak."""
from dataclasses import asdict, dataclass
from typing import List, Optional

from .activations import gpt2_stage
from .model_states import ModelStates, model_states
from .schedule import activation_peaks, in_flight
from .spec import MemorySpec
from .stages import chunk_layers, stage_layers
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
    """DDP gradient buckets, pipeline output tensors held for the backward."""
    transient: int
    """The largest short-lived working set: a recomputed group's activations, 16-bit
    logits next to their fp32 copy while the loss runs, or under SP a re-gathered layer
    input and its gradient in the backward."""
    activation_peak: Optional[int] = None
    """Interleaved: the most bytes alive at once, each chunk charged its own bytes (the
    head and the embedding in the chunks that hold them); None: per micro-batch x count."""

    @property
    def activations(self) -> int:
        if self.activation_peak is not None:
            return self.activation_peak
        return self.activations_per_micro_batch * self.in_flight

    @property
    def peak(self) -> int:
        return self.states.total + self.activations + self.buffers + self.transient

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(activations=self.activations, peak=self.peak)
        return out


def _hidden_out(spec: MemorySpec) -> int:
    """Bytes of one micro-batch's stage output (what a pipeline stage sends and keeps)."""
    tokens = spec.micro_batch * (spec.seq + (spec.dec_seq if spec.family == "t5" else 0))
    return tokens * spec.hidden * spec.residual_bytes // (spec.tp if spec.sequence_parallel
                                                          else 1)


def _sp_gather(spec: MemorySpec) -> int:
    """Under SP, a column-parallel layer's backward holds its re-gathered ``[s, b, h]`` input
    and that input's ``[s, b, h]`` gradient before the reduce-scatter
    (megatron/mpu/sequence_parallel_linear.py): the largest such pair."""
    if not spec.sequence_parallel or spec.tp == 1:
        return 0
    s = max(spec.seq, spec.dec_seq)
    return 2 * s * spec.micro_batch * spec.hidden * spec.e


def predict(spec: MemorySpec) -> List[StageMemory]:
    """Predicted memory of every pipeline stage (one entry per stage).

    Args:
        spec: the run (:func:`~megatron.memory.spec.spec_from_run_config`).

    Raises:
        ConfigError: a spec the model does not describe.
    """
    spec.check()
    counts = in_flight(spec.pp, spec.num_micro_batches, spec.vpp)
    stage_fn = gpt2_stage if spec.family == "gpt2" else t5_stage
    peaks, chunks = [None] * spec.pp, None
    if spec.vpp > 1:
        chunks = [stage_fn(spec, c) for c in chunk_layers(spec)]
        peaks = activation_peaks(spec.pp, spec.num_micro_batches, spec.vpp,
                                 tuple(c.saved for c in chunks))
    out = []
    for layers, count, peak in zip(stage_layers(spec), counts, peaks):
        states = model_states(spec, layers)
        act = stage_fn(spec, layers)
        if chunks is not None:  # this rank's chunks: layers.stage, + pp, + 2 pp, ...
            mine = chunks[layers.stage::spec.pp]
            act = type(act)(sum(c.saved for c in mine), max(c.recompute_peak for c in mine))
        buffers = states.grad_bytes if spec.backend == "ddp" and spec.dp > 1 else 0
        if spec.pp > 1 and not layers.head:
            buffers += count * _hidden_out(spec)
        loss = 0
        if layers.head:
            tokens = spec.micro_batch * (spec.dec_seq if spec.family == "t5" else spec.seq)
            # 16-bit logits next to their fp32 copy (which becomes the kept softmax); fp32
            # logits become the softmax themselves (the loss works in place)
            loss = tokens * spec.vocab // spec.tp * (spec.e if spec.e < 4 else 0)
        out.append(StageMemory(layers.stage, states, act.saved // spec.vpp, count, buffers,
                               max(act.recompute_peak, loss, _sp_gather(spec)), peak))
    return out


def format_stage(stage: StageMemory, pp: int) -> str:
    """One start-up line: ``stage 1/4: predicted peak 12.3 GiB per rank = weights ...``.

    Args:
        stage: a stage's prediction.
        pp: pipeline stages (for the ``stage/pp`` label).
    """
    s = stage.states
    return (f"stage {stage.stage}/{pp}: predicted peak {stage.peak / GIB:.2f} GiB per rank = "
            f"weights {s.weight_bytes / GIB:.2f} + grads {s.grad_bytes / GIB:.2f} + "
            f"optimizer {s.optimizer_bytes / GIB:.2f} + activations "
            f"{stage.activations / GIB:.2f} ({stage.in_flight} micro-batches x "
            f"{stage.activations_per_micro_batch / 2**20:.1f} MiB) + buffers "
            f"{stage.buffers / GIB:.2f} + transient {stage.transient / GIB:.2f}")

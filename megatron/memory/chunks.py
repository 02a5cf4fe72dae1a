"""What each model chunk holds for the schedule walk, computed once per distinct chunk.

A pipeline rank's memory over a step is its schedule's walk (:mod:`.walk`) weighted by
per-chunk byte counts: what one micro-batch saves (and the stage output and received masks
the engine keeps beside it), what a zero-bubble weight pass needs, the gradients and when
they appear, the backward's and the loss forward's transients. Chunks with the same
layers weigh the same, so each distinct one is computed once per layout
(:func:`part_bytes` is cached), and the partition once per (layers, pp, v)
(:func:`stage_layout`).
"""
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Tuple

from ..config.run_config import V_SCHEDULE, ZERO_BUBBLE_SCHEDULES
from .activations import gpt2_mask_bytes, gpt2_stage
from .backward import gpt2_backward, t5_backward
from .deferred import deferred_bytes, gemm_weight_params, largest_weight_grad
from .grad_timing import grads_freed_each_step
from .model_states import ModelStates, model_states, step_bytes
from .spec import MemorySpec
from .stages import StageLayers, chunk_layers, rank_layers, stage_layers
from .t5_activations import t5_stage
from .walk import ChunkBytes, rank_chunks


@dataclass(frozen=True)
class Layout:
    """Which layers each chunk and each rank holds."""

    parts: Tuple[StageLayers, ...]
    """Every global chunk (one per stage without interleaving)."""
    stages: Tuple[StageLayers, ...]
    """Every pipeline rank's layers (ZB-V: the union of its two chunks)."""
    chunks_of: Tuple[Tuple[int, ...], ...]
    """Every rank's global chunks."""
    bare: Tuple[StageLayers, ...]
    """``parts`` with ``stage`` 0 (the key of :func:`part_bytes`: equal chunks, one entry)."""


def stage_layout(spec: MemorySpec) -> Layout:
    """The chunks and ranks of a layout (cached per family, layers, pp, v, schedule)."""
    return _layout(spec.family, spec.num_layers, spec.pp, spec.vpp, spec.pipeline_schedule,
                   spec.num_experts, spec.moe_layers)


@lru_cache(maxsize=1024)
def _layout(family: str, layers: int, pp: int, vpp: int, schedule: str, num_experts: int = 0,
            moe_layers: Tuple[bool, ...] = ()) -> Layout:
    sizes = _Sizes(family, layers, pp, vpp, num_experts, moe_layers)
    parts = chunk_layers(sizes) if vpp > 1 else stage_layers(sizes)
    chunks_of = rank_chunks(pp, vpp, schedule)
    stages = [rank_layers(parts, r, mine) for r, mine in enumerate(chunks_of)] \
        if schedule == V_SCHEDULE else stage_layers(sizes)  # a loop: the stages' own partition
    return Layout(tuple(parts), tuple(stages), tuple(chunks_of),
                  tuple(replace(part, stage=0) for part in parts))


@dataclass(frozen=True)
class _Sizes:
    """What the partition reads of a spec."""

    family: str
    num_layers: int
    pp: int
    vpp: int
    num_experts: int = 0
    moe_layers: Tuple[bool, ...] = ()


@dataclass(frozen=True)
class PartBytes:
    """One chunk's byte counts for one micro-batch (without the engine's buffers)."""

    saved: int
    deferred: int
    grads: int
    gemm_grads: int
    transient: int
    transient_first: int
    forward: int
    weight_pass: int


@lru_cache(maxsize=65536)
def part_bytes(spec: MemorySpec, part: StageLayers) -> PartBytes:
    """:class:`PartBytes` of a chunk's layers (``part.stage`` is not read: pass it 0)."""
    stage_fn, backward_fn = (gpt2_stage, gpt2_backward) if spec.family == "gpt2" else \
        (t5_stage, t5_backward)
    act = stage_fn(spec, part)
    zb = schedule_is_zero_bubble(spec)
    states = model_states(spec, part)
    grads = states.grad_bytes if grads_freed_each_step(spec) else 0
    gemm = min(grads, gemm_weight_params(spec, part) * grads // max(1, states.params)) \
        if zb else 0
    transient = backward_fn(spec, part, act)
    per_param = 4 if spec.backend == "ddp" or spec.dtype == "fp32" else spec.e
    return PartBytes(act.saved, deferred_bytes(spec, part) if zb else act.saved, grads, gemm,
                     transient.any, transient.first,
                     _forward_transient(spec, part, act.saved),
                     largest_weight_grad(spec, part, per_param) if zb else 0)


def chunk_bytes(spec: MemorySpec, parts) -> Tuple[Tuple[int, ...], ChunkBytes]:
    """``(saved bytes per chunk, ChunkBytes)`` of the model chunks ``parts`` (the layout's:
    :func:`stage_layout`): the walk's weights, ``saved`` with the stage output and the
    masks the engine keeps beside it."""
    layout = stage_layout(spec)
    bare = layout.bare if parts == layout.parts else [replace(p, stage=0) for p in parts]
    each = [part_bytes(spec, part) for part in bare]
    saved = tuple(x.saved for x in each)
    held = tuple(x.saved + _chunk_buffers(spec, part.stage) for x, part in zip(each, parts))
    zb = schedule_is_zero_bubble(spec)
    return saved, ChunkBytes(held, tuple(x.deferred for x in each) if zb else held,
                             tuple(x.grads for x in each), tuple(x.gemm_grads for x in each),
                             tuple(x.transient for x in each),
                             tuple(x.transient_first for x in each),
                             tuple(x.forward for x in each),
                             tuple(x.weight_pass for x in each) if zb else ())


def rank_grad_bytes(spec: MemorySpec, mine) -> int:
    """The gradient bytes of a rank's chunks that the walk counts (0 where they live
    through the step, counted with the states)."""
    layout = stage_layout(spec)
    return sum(part_bytes(spec, layout.bare[c]).grads for c in mine)


def rank_states(spec: MemorySpec) -> Tuple[Tuple[ModelStates, int], ...]:
    """Per pipeline rank ``(model states, the optimizer step's temporaries)``: neither
    depends on the micro-batch, the recompute, sequence parallelism, the schedule's order
    or how the gradients' group splits into data and context ranks (computed once per the
    rest)."""
    schedule = V_SCHEDULE if spec.pp > 1 and spec.pipeline_schedule == V_SCHEDULE else ""
    # context parallelism changes the states only as a larger data-parallel group
    return _rank_states(replace(spec, micro_batch=1, num_micro_batches=1, recompute="none",
                                recompute_method="uniform", recompute_num_layers=1,
                                sequence_parallel=False, schedule=schedule,
                                dp=spec.grad_ranks, cp=1, cp_comm="p2p"))


@lru_cache(maxsize=4096)
def _rank_states(spec: MemorySpec) -> Tuple[Tuple[ModelStates, int], ...]:
    out = []
    for layers in stage_layout(spec).stages:
        states = model_states(spec, layers)
        out.append((states, step_bytes(spec, layers, states)))
    return tuple(out)


def schedule_is_zero_bubble(spec: MemorySpec) -> bool:
    """A zero-bubble schedule (input and weight passes apart)."""
    return spec.pp > 1 and spec.pipeline_schedule in ZERO_BUBBLE_SCHEDULES


def _hidden_out(spec: MemorySpec) -> int:
    """Bytes of one micro-batch's stage output (what a pipeline stage sends and keeps)."""
    tokens = spec.micro_batch * (spec.seq_local + (spec.dec_seq if spec.family == "t5" else 0))
    return tokens * spec.hidden * spec.residual_bytes // (spec.tp if spec.sequence_parallel
                                                          else 1)


def _received_masks(spec: MemorySpec) -> int:
    """Bytes of the bool masks one micro-batch brings to a stage with its hidden states
    (GPT-2: ``[1, 1, s, s]``, under context parallelism the token layout; T5: encoder,
    decoder and cross masks per sample), kept with the received inputs until the
    backward."""
    if spec.family == "gpt2":
        return gpt2_mask_bytes(spec)
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


def _forward_transient(spec: MemorySpec, part: StageLayers, saved: int) -> int:
    """What a chunk's forward holds at its worst moment beyond its saved bytes once it is
    done: the loss's 16-bit logits (:func:`_loss_forward`), or under context parallelism
    the ring's buffers in its last layer's attention (megatron/memory/ring.py), less what
    that layer's MLP, the final norm and the head save after it (full recompute: the
    layer's attention half is alive while it runs, then only its input is kept)."""
    loss = _loss_forward(spec) if part.head else 0
    if not spec.ring or not part.encoder_layers:
        return loss
    from .activations import attention_half, gpt2_layer
    from .ring import forward_extra

    b = spec.micro_batch
    layer, half = gpt2_layer(spec, b), attention_half(spec, b)
    last = saved - gpt2_stage(spec, replace(part, head=False, final_norm=False)).saved
    after = layer - half if spec.recompute != "full" else -half
    return max(loss, forward_extra(spec, spec.seq_local * b) - after - last)


def _loss_forward(spec: MemorySpec) -> int:
    """16-bit logits next to their fp32 copy (which becomes the kept softmax) while the loss
    runs; fp32 logits become the softmax themselves (the loss works in place)."""
    tokens = spec.micro_batch * (spec.dec_seq if spec.family == "t5" else spec.seq_local)
    return tokens * spec.vocab // spec.tp * (spec.e if spec.e < 4 else 0)



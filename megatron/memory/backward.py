"""Bytes a micro-batch's backward holds beyond what its forward saved: the gradients in
flight, one of the transient terms of the per-stage peak.

Measured with tests/peak_tracker.py over real steps of the pipeline engine (every storage
alive at once, docs/memory.md): while a layer's backward runs, the gradient of the residual
stream waits for the residual add's other branch, and each GEMM's backward holds its output
gradient, its input gradient and its weight gradient (added into ``.grad`` afterwards, so
both exist for a moment); a column-parallel GEMM under sequence parallelism also holds its
re-gathered input and the full input gradient before the reduce-scatter. At the output
layer the logits' gradient is the softmax the loss kept (in place), copied once more by
autograd when the padded vocabulary's logits were filled in place (CopySlices) or cast back
to a 16-bit dtype; at the first stage the embeddings' dense weight gradients.

Each figure is counted against all of the micro-batch's saved bytes: what the backward
has already freed when it gets there (the head's softmax before the layers, the layers
before the embedding) is subtracted.
"""
from typing import NamedTuple

from ..config.run_config import ZERO_BUBBLE_SCHEDULES
from . import ring
from .activations import (Activations, Shape, attention_core, cpu_math_path, dropout_bytes,
                          gpt2_embedding, gpt2_layer, norm_bytes, output_and_loss, qkv_kept,
                          recompute_input, selective, sp_divisor)
from .deferred import deferred_bytes
from .spec import MemorySpec
from .stages import StageLayers


def weight_grad_bytes(spec: MemorySpec) -> int:
    """Bytes per element of a weight gradient as a GEMM's backward makes it: the weights'
    dtype; under autocast the compute dtype's gradient and its fp32 cast, both for a moment.

    Args:
        spec: the run.
    """
    param = 4 if spec.backend == "ddp" or spec.dtype == "fp32" else spec.e
    return param + (spec.e if spec.autocast else 0)


def attention_backward(spec: MemorySpec, shape: Shape) -> int:
    """Scores-to-``q, k, v`` gradients of one attention: the context's gradient and the
    query, key and value gradients (SDPA's kernels); the unfused and the CPU math paths
    also hold one ``s x s`` gradient at a time (each frees a saved ``s x s`` tensor as it
    makes the next).

    Args:
        spec: the run.
        shape: query and key lengths and micro-batch.
    """
    proj = spec.heads * spec.kv_channels // spec.tp
    q, k = shape.sq * shape.b, shape.sk * shape.b
    if spec.attention == "sdpa" and not cpu_math_path(spec):
        return (2 * q + 2 * k) * proj * spec.e
    e = 4 if cpu_math_path(spec) and spec.e < 4 else spec.e  # the math path runs in fp32
    scores = spec.heads // spec.tp * shape.b * shape.sq * shape.sk
    return scores * e + (q + 2 * k) * proj * e + q * proj * spec.e


def layer_backward(spec: MemorySpec, shape: Shape, fc1_outputs: int = 1,
                   moe: bool = False) -> int:
    """One transformer layer's backward on one rank: the residual stream's gradient plus
    the largest working set among its parts, in the order the backward runs them (fc2,
    the activation, fc1, dense, the attention core, the q, k, v gradients and their
    concatenation, QKV), less what the parts before it freed of the layer's saved tensors.

    Args:
        spec: the run.
        shape: the self-attention's sizes.
        fc1_outputs: 2 for a gated feed-forward (two ``d_ff`` outputs).
        moe: the layer's MLP is an MoE block (megatron/memory/moe.py).
    """
    h, e, r, c = spec.hidden, spec.e, spec.residual_bytes, sp_divisor(spec)
    tokens = shape.sq * shape.b
    proj, f = spec.heads * spec.kv_channels // spec.tp, spec.ffn // spec.tp
    qkv = spec.qkv_width // spec.tp
    sp = spec.sequence_parallel and spec.tp > 1
    # a zero-bubble input pass makes no weight gradient and keeps each GEMM's input and
    # output gradient for the weight pass (megatron/memory/deferred.py)
    zb = zero_bubble(spec)
    wg = 0 if zb else weight_grad_bytes(spec)
    # row-parallel GEMMs read the dropout's product (under SP: the all-gathered gradient)
    row_dy = tokens * h * r if sp or spec.hidden_dropout > 0 else 0
    # column-parallel GEMMs: the input gradient (under SP: and the re-gathered input)
    col_dx = tokens * h * e * (2 if sp else 1)
    drop = dropout_bytes(spec, tokens * h // c, r if spec.bias else e, spec.hidden_dropout)
    inner = fc1_outputs * tokens * f * e
    gemm_in = 0 if zb else 1  # a GEMM input is freed by its backward, or kept (zb)
    core_part, grads_part = _core_parts(spec, shape, gemm_in)
    held = tokens * e if zb else 0  # per unit of width: a GEMM's output gradient, kept
    parts = (  # (working set, saved bytes it frees, bytes it leaves held)
        (row_dy + tokens * f * e + f * h * wg, drop + gemm_in * tokens * f * e,
         held * h),  # fc2, its input
        (2 * inner, inner, 0),  # the activation's backward, its input
        (inner + col_dx + fc1_outputs * f * h * wg,
         gemm_in * tokens * h * e // c + norm_bytes(spec, tokens, spec.norm_stats) + drop,
         held * fc1_outputs * f),  # fc1, LN2, dropout
        (row_dy + tokens * proj * e + proj * h * wg, 0, held * h),  # dense
        core_part,  # the attention core
        grads_part,  # q, k, v gradients and the split's concatenation
        (tokens * qkv * e + col_dx + qkv * h * wg, 0, held * qkv))  # QKV
    if moe:  # the MoE block's backward in the dense MLP's place
        from .moe import moe_backward_parts

        block = list(moe_backward_parts(spec, tokens, wg))
        block[0] = (row_dy + block[0][0], block[0][1] + drop, 0)
        ln2 = norm_bytes(spec, tokens, spec.norm_stats) + drop
        block[-1] = (block[-1][0], block[-1][1] + ln2, 0)
        parts = tuple(block) + parts[3:]
    most = freed = 0
    for working, frees, holds in parts:
        most = max(most, working - freed)
        freed += frees - holds
    return tokens * h * r // c + most


def _core_parts(spec: MemorySpec, shape: Shape, gemm_in: int):
    """The attention core's and the q, k, v gradients' ``(working set, frees, holds)``
    rows of :func:`layer_backward` (``gemm_in``: 0 when the dense layer's input, the
    core's output, stays for a zero-bubble weight pass)."""
    e, tokens = spec.e, shape.sq * shape.b
    proj = spec.heads * spec.kv_channels // spec.tp
    recomputed = selective(spec)
    qkv_saved = 0 if cpu_math_path(spec) and e < 4 and not recomputed else \
        qkv_kept(spec, tokens)
    core = attention_core(spec, shape)
    if spec.ring:  # the output's gradient and the ring's buffers (megatron/memory/ring.py)
        work = tokens * proj * e + ring.backward_extra(spec, tokens)
        qkv = tokens * spec.qkv_width // spec.tp  # q, k, v and their gradients' widths
        # dq and the travelling dK, dV come back in fp32 and are cast to the inputs' dtype
        grads = qkv * (4 + e) if e < 4 else 2 * qkv * e
        return (work, core - (1 - gemm_in) * tokens * proj * e + qkv_saved, 0), \
            (max(grads, 2 * qkv * e), 0, 0)
    # selective recompute: the core's tensors come back for its backward, only the
    # context was kept
    work = attention_backward(spec, shape) + (core if recomputed else 0)
    kept = tokens * proj * e if recomputed else core
    return (work, kept - (1 - gemm_in) * tokens * proj * e + qkv_saved, 0), \
        (6 * tokens * proj * e, 0, 0)


def zero_bubble(spec: MemorySpec) -> bool:
    """A zero-bubble schedule splits the backward (input pass, weight pass later).

    Args:
        spec: the run.
    """
    return spec.pp > 1 and spec.pipeline_schedule in ZERO_BUBBLE_SCHEDULES


def head_backward(spec: MemorySpec, b: int, s: int) -> int:
    """The loss's and the output layer's backward, counted against the saved fp32 softmax:
    the logits' gradient copied once more (padded vocabulary rows filled in place, or a
    16-bit cast), then the output GEMM's input and weight gradients (under SP also the
    re-gathered input) once the softmax is freed.

    Args:
        spec: the run.
        b: samples per micro-batch.
        s: the length the loss runs over (T5: the decoder's).
    """
    tokens, v, h, e = s * b, spec.vocab // spec.tp, spec.hidden, spec.e
    sp = spec.sequence_parallel and spec.tp > 1
    copy = tokens * v * e if spec.vocab_padded or e < 4 else 0
    gemm = tokens * v * (e - 4) + tokens * h * e * (2 if sp else 1) + v * h * \
        weight_grad_bytes(spec)
    return max(copy, gemm)


def gpt2_embedding_backward(spec: MemorySpec, b: int) -> int:
    """The embedding dropout's gradient and the embeddings' dense weight gradients (word
    rows on this rank, positions), the incoming gradient freed by then.

    Args:
        spec: the run.
        b: samples per micro-batch.
    """
    s = spec.seq_local
    grad = s * b * spec.hidden * spec.residual_bytes // sp_divisor(spec)
    if spec.sequence_parallel and spec.tp > 1:
        grad += s * b * spec.hidden * spec.residual_bytes  # all-gathered
    param = 4 if spec.backend == "ddp" or spec.dtype == "fp32" else spec.e
    positions = spec.max_positions if spec.positions == "learned" else 0
    table = max(spec.vocab // spec.tp, positions) * spec.hidden * param
    return max(2 * s * b * spec.hidden * spec.residual_bytes // sp_divisor(spec),
               grad + table)


class Transient(NamedTuple):
    """A chunk's backward transient (bytes beyond what was alive before it)."""

    any: int
    """On any backward of the step."""
    first: int
    """On the chunk's first backward of the step, counting the gradients its earlier parts
    made by the worst moment (later backwards find them made already)."""


def _grad_bytes(spec: MemorySpec, **parts) -> int:
    """Gradient bytes a backward makes for the parts named (``StageLayers`` fields); 0 where
    the gradients live through the step (counted with the states) or a zero-bubble weight
    pass makes them."""
    from .grad_timing import grads_freed_each_step
    from .model_states import model_states

    if not grads_freed_each_step(spec) or zero_bubble(spec):
        return 0
    layers = dict(stage=0, embedding=False, encoder_layers=0, decoder_layers=0,
                  encoder_norm=False, final_norm=False, head=False)
    layers.update(parts)
    return model_states(spec, StageLayers(**layers)).grad_bytes


def _deferred_layer(spec: MemorySpec, b: int) -> int:
    """What a zero-bubble input pass of one GPT-2 layer leaves for its weight pass (0 for
    the other schedules)."""
    if not zero_bubble(spec):
        return 0
    return deferred_bytes(spec, StageLayers(0, False, 1, 0, False, False, False))


def _layer_points(spec: MemorySpec, n: int, lb: int, act: Activations, b: int, made: int,
                  layers: StageLayers = None):
    """``(working set, gradients made before)`` at the first and the last of ``n`` layers'
    backwards (each is linear in the layers done: the worst is at one end): the layers run
    last to first, each freeing what it saved (a recomputed group: its input) and making
    its weight gradients; under block recompute the stage's last layers keep everything
    and run first, the first ones come back after them."""
    # a layer's backward frees what it saved, less (zero bubble) what the weight pass needs;
    # with MoE layers the stage's mean layer
    layer = gpt2_layer(spec, b) - _deferred_layer(spec, b)
    grads = _grad_bytes(spec, encoder_layers=1)
    if layers is not None and layers.moe_layers:
        from .activations import stage_layer_bytes

        layer = stage_layer_bytes(spec, layers, b)[0] // n - _deferred_layer(spec, b)
        grads = _grad_bytes(spec, encoder_layers=n, moe_layers=layers.moe_layers) // n
    kept_input = recompute_input(spec, spec.seq_local * b)
    if spec.recompute != "full":
        return [(lb, made), (lb - (n - 1) * layer, made + (n - 1) * grads)]
    k = spec.recompute_num_layers
    if spec.recompute_method == "uniform":
        groups = -(-n // k)
        return [(act.recompute_peak + lb, made),
                (act.recompute_peak + lb - (groups - 1) * kept_input,
                 made + (n - min(k, n)) * grads)]
    again = min(k, n)
    kept = n - again
    points = [(lb, made), (lb - max(kept - 1, 0) * layer, made + max(kept - 1, 0) * grads)]
    done = kept * layer  # freed by the time the recomputed layers come back
    return points + [(layer + lb - done, made + kept * grads),
                     (layer + lb - done - (again - 1) * kept_input, made + (n - 1) * grads)]


def gpt2_backward(spec: MemorySpec, layers: StageLayers, act: Activations) -> Transient:
    """The most bytes one micro-batch's backward on ``layers`` holds beyond all of its
    saved activations (a recomputed group's activations included), on any backward and on
    the chunk's first of the step (:class:`Transient`).

    Args:
        spec: the run.
        layers: the stage or chunk.
        act: its activations (:func:`~megatron.memory.activations.gpt2_stage`).
    """
    b, s = spec.micro_batch, spec.seq_local
    tokens = s * b
    points, head, made = [(0, 0)], 0, 0  # (working set, gradients made before it)
    if layers.head:
        points.append((head_backward(spec, b, s), 0))
        head = output_and_loss(spec, b, s) - (deferred_bytes(spec, StageLayers(
            0, False, 0, 0, False, False, True)) if zero_bubble(spec) else 0)
        made = _grad_bytes(spec, head=True)
    if layers.final_norm:
        head += norm_bytes(spec, tokens, spec.norm_stats)
        made += _grad_bytes(spec, final_norm=True)
    n = layers.encoder_layers
    if n:
        gated = 2 if spec.gated else 1
        # the largest of the dense and the MoE layers' backward (each only where it runs)
        lb = layer_backward(spec, Shape(s, s, b), gated) - head \
            if layers.moe_layers < n else 0
        if layers.moe_layers:
            lb = max(lb, layer_backward(spec, Shape(s, s, b), gated, True) - head)
        points += _layer_points(spec, n, lb, act, b, made, layers)
        made += _grad_bytes(spec, encoder_layers=n, moe_layers=layers.moe_layers)
    if layers.embedding:
        freed = act.saved - gpt2_embedding(spec, b) - n * _deferred_layer(spec, b)
        points.append((gpt2_embedding_backward(spec, b) - freed, made))
    return Transient(max(w for w, _ in points), max(w + g for w, g in points))


def t5_backward(spec: MemorySpec, layers: StageLayers, act: Activations) -> Transient:
    """:func:`gpt2_backward` for a T5 stage: the head over the decoder's tokens, the larger
    of an encoder and a decoder layer (not measured on the engine: docs/memory.md).

    Args:
        spec: the run.
        layers: the stage or chunk.
        act: its activations (:func:`~megatron.memory.t5_activations.t5_stage`).
    """
    b = spec.micro_batch
    out, head = 0, 0
    if layers.head:
        out = head_backward(spec, b, spec.dec_seq)
        head = output_and_loss(spec, b, spec.dec_seq)
    gated = 2 if spec.gated else 1
    for count, s in ((layers.encoder_layers, spec.seq), (layers.decoder_layers, spec.dec_seq)):
        if count:
            layer = layer_backward(spec, Shape(s, max(s, spec.seq), b), gated)
            out = max(out, act.recompute_peak + layer - head)
    return Transient(out, out)

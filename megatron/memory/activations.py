"""Activation bytes one micro-batch leaves saved for the backward, per stage and rank.

Korthikanti et al. 2022 (arXiv:2205.05198) count ``s b h (34 + 5 a s / h)`` bytes per GPT
layer in 16-bit with 1-byte dropout masks, ``/ t`` for the tensor-parallel parts, the
norm and dropout parts also ``/ t`` under sequence parallelism, and ``2 s b h`` (the
layer input) under full recompute. This module counts the same way, tensor by tensor, for
what this project's layers save (megatron/model/transformer.py, attention.py,
t5_layers.py):

- the residual stream is fp32 under the DDP backend's autocast (the fp32 biases promote
  it), the weights' dtype under the engine; norms save their input and fp32 statistics;
- each linear layer saves its input in the compute dtype; under sequence parallelism a
  column-parallel layer keeps its ``[s/t, b, h]`` shard and all-gathers it again in the
  backward (megatron/mpu/sequence_parallel_linear.py), so its input, the norms and the
  dropouts all shrink by ``t``: ``34 s b h / t`` in Korthikanti's terms;
- autocast's compute-dtype copy of every weight a linear layer reads is made once per step
  (the step's micro-batches run in one autocast region, whose weight cache they share) and
  held until the last backward: not a micro-batch's, counted once per rank by
  :func:`megatron.memory.report.autocast_weight_copies`;
- SDPA (the default) keeps the query/key/value projection, its output and the fp32
  log-sum-exp: no ``s x s`` term; the unfused path keeps the softmax output, its
  per-row flags, the dropout mask and the dropped probabilities;
- a dropout mask is 1 byte on CUDA, the dropped tensor's dtype on the CPU;
- under context parallelism every per-token count is of the rank's ``s / cp`` tokens, and
  the attention (megatron/mpu/ring_attention.py, cp_attention.py) keeps what SDPA keeps
  of them: q, k, v, its output and the fp32 log-sum-exp (:func:`ring_core`).
"""
from dataclasses import dataclass

from .spec import MemorySpec
from .stages import StageLayers


@dataclass(frozen=True)
class Shape:
    """One attention's sizes for one micro-batch on one tensor-parallel rank."""

    sq: int
    sk: int
    b: int


def mask_bytes(spec: MemorySpec, dtype_bytes: int) -> int:
    """Bytes per element of a dropout mask over a tensor of ``dtype_bytes``.

    Args:
        spec: the run (its device).
        dtype_bytes: bytes per element of the dropped tensor.
    """
    return 1 if spec.device == "cuda" else dtype_bytes


def sp_divisor(spec: MemorySpec) -> int:
    """Divisor of the norm / dropout / residual terms: t under sequence parallelism.

    Args:
        spec: the run.
    """
    return spec.tp if spec.sequence_parallel else 1


def norm_bytes(spec: MemorySpec, tokens: int, stats: int = 2) -> int:
    """A norm over ``tokens`` rows: its input (residual dtype) and ``stats`` fp32 rows.

    Args:
        spec: the run.
        tokens: rows (sequence x micro-batch, before any SP split).
        stats: fp32 statistics per row (LayerNorm 2, RMSNorm 1).
    """
    return tokens * (spec.hidden * spec.residual_bytes + 4 * stats) // sp_divisor(spec)


def dropout_bytes(spec: MemorySpec, elements: int, dtype_bytes: int, p: float) -> int:
    """The mask of a dropout over ``elements`` (none when ``p`` is 0).

    Args:
        spec: the run (its device).
        elements: elements dropped on this rank.
        dtype_bytes: bytes per element of the dropped tensor.
        p: the dropout probability.
    """
    return elements * mask_bytes(spec, dtype_bytes) if p > 0 else 0


def cpu_math_path(spec: MemorySpec) -> bool:
    """SDPA with attention dropout on the CPU: PyTorch runs its math path (no fused
    kernel there takes dropout).

    Args:
        spec: the run.
    """
    return spec.attention == "sdpa" and spec.device == "cpu" and spec.attention_dropout > 0


def selective(spec: MemorySpec, mask_needs_grad: bool = False) -> bool:
    """Selective recompute applies: asked for, and the attention core keeps ``s x s``
    tensors (the unfused path; SDPA only through PyTorch's math path on the CPU), the rule
    the model itself follows (megatron/model/recompute.py ``core_keeps_scores``).

    Args:
        spec: the run.
        mask_needs_grad: the additive mask carries a gradient (T5's self-attention bias).
    """
    if spec.recompute != "selective" or spec.ring:  # cp: the core is never recomputed
        return False
    from ..model.recompute import core_keeps_scores

    return core_keeps_scores(spec.attention, spec.device, spec.attention_dropout,
                             mask_needs_grad)


def attention_core(spec: MemorySpec, shape: Shape) -> int:
    """Scores-to-context bytes of one attention (the dense layer's input included).

    Args:
        spec: the run (attention backend, dropout, dtype).
        shape: query and key lengths and micro-batch.
    """
    e, t, a = spec.e, spec.tp, spec.heads
    proj = a * spec.kv_channels
    scores = a * shape.b * shape.sq * shape.sk // t
    if spec.ring:
        return ring_core(spec, shape.sq * shape.b)
    if cpu_math_path(spec):
        # PyTorch's CPU kernel has no dropout: its math path keeps scaled queries,
        # transposed keys, softmax, mask and dropped probabilities; for 16-bit inputs
        # (autocast or 16-bit weights) it runs in fp32 and keeps an fp32 copy of the values
        half = spec.e < 4
        e = 4 if half else e
        tokens = shape.b * (shape.sq + shape.sk * (2 if half else 1))
        return tokens * proj * e // t + 3 * scores * e + shape.sq * shape.b * proj * spec.e // t
    context = shape.sq * shape.b * proj * e // t
    if spec.attention == "sdpa":
        return context + a * shape.b * shape.sq * 4 // t  # output + fp32 log-sum-exp
    total = scores * e + a * shape.b * shape.sq // t  # softmax output, per-row flags
    if spec.attention_dropout > 0:
        total += scores * mask_bytes(spec, e) + scores * e  # mask, dropped probabilities
    return total + context  # the context is re-laid out for the dense layer (a copy)


def ring_core(spec: MemorySpec, tokens: int) -> int:
    """What the context-parallel attention keeps beyond q, k and v for ``tokens`` local
    tokens: ``p2p`` / ``all_gather``: its output (the dense layer's input, one tensor: the
    ring's accumulator is laid out sequence first) and the fp32 log-sum-exp; ``a2a``: SDPA's
    output and log-sum-exp over the whole sequence of ``heads / cp`` heads (the same bytes)
    and the output all-to-all'd back (the dense layer's input).

    Args:
        spec: the run (cp > 1).
        tokens: the rank's tokens (``s / cp x b``).
    """
    proj = spec.heads * spec.kv_channels // spec.tp
    kept = tokens * proj * spec.e + tokens * spec.heads // spec.tp * 4
    if spec.cp_comm == "a2a":  # and the two int64 [s] orders its index_selects keep
        kept += tokens * proj * spec.e + 16 * spec.seq
    return kept


def qkv_kept(spec: MemorySpec, tokens: int) -> int:
    """Bytes of the q, k and v an attention keeps for ``tokens`` tokens on this rank: the
    query width three times (SDPA's keys and values repeated to every query head), or
    under the ring (p2p, all_gather) the projections' own widths.

    Args:
        spec: the run.
        tokens: the rank's tokens.
    """
    width = spec.qkv_width if spec.ring and spec.cp_comm != "a2a" else \
        3 * spec.heads * spec.kv_channels
    return tokens * width * spec.e // spec.tp


def gpt2_layer(spec: MemorySpec, b: int) -> int:
    """Bytes one GPT-2 layer saves for one micro-batch of ``b`` samples (no recompute).

    Args:
        spec: the run.
        b: samples per micro-batch.
    """
    s, h, f, t, e = spec.seq_local, spec.hidden, spec.ffn, spec.tp, spec.e
    proj = spec.heads * spec.kv_channels
    tokens = s * b
    total = 2 * norm_bytes(spec, tokens, spec.norm_stats)
    # QKV and fc1 inputs (shards under SP): one tensor each; separate q, k, v (gate, up)
    # linears under autocast each cast a copy of their own
    copies = 2 + (2 + spec.gated if spec.autocast and spec.separate_projections else 0)
    total += copies * tokens * h * e // sp_divisor(spec)
    recomputed = selective(spec)
    if recomputed or not (cpu_math_path(spec) and spec.e < 4):  # there: its fp32 copies
        # q, k, v (the checkpoint's inputs, selective); SDPA's k and v repeated to every
        # query head, the ring's not (grouped-query attention travels with its kv heads)
        total += qkv_kept(spec, tokens)
    if recomputed:  # the core's output (the dense layer's input); the rest comes back
        total += tokens * proj * e // t
    else:
        total += attention_core(spec, Shape(s, s, b))
    if spec.positions == "rotary":  # the fp32 cos and sin the rotation multiplies by
        # (under cp at each token's own position: [s / cp, b, 1, d])
        total += 2 * s * spec.kv_channels * 4 * (b if spec.ring else 1)
    if spec.mask_tensor and spec.attention == "sdpa" and not spec.ring:
        total += s * s * e  # the additive [1, 1, s, s] mask (cp: the token layout instead)
    # GeLU input and output (fc2's input); SwiGLU: gate and up outputs, SiLU, the product
    total += (4 if spec.gated else 2) * tokens * f * e // t
    drop_dtype = spec.residual_bytes if spec.bias else e  # the bias add promotes it
    residual = tokens * h // sp_divisor(spec)
    total += 2 * dropout_bytes(spec, residual, drop_dtype, spec.hidden_dropout)
    return total


def moe_layer(spec: MemorySpec, b: int) -> int:
    """Bytes one MoE layer saves for one micro-batch: :func:`gpt2_layer` with the dense
    MLP's tensors replaced by the MoE block's (megatron/memory/moe.py).

    Args:
        spec: the run.
        b: samples per micro-batch.
    """
    from .moe import dense_mlp_saved, moe_mlp_saved

    tokens = spec.seq_local * b
    return gpt2_layer(spec, b) - dense_mlp_saved(spec, tokens) + moe_mlp_saved(spec, tokens)


def stage_layer_bytes(spec: MemorySpec, layers: StageLayers, b: int):
    """``(saved bytes of the stage's layers, the largest layer's)``: dense and MoE layers
    (no recompute)."""
    dense = gpt2_layer(spec, b)
    if not layers.moe_layers:
        return layers.encoder_layers * dense, dense
    moe = moe_layer(spec, b)
    m = layers.moe_layers
    return (layers.encoder_layers - m) * dense + m * moe, max(moe, dense if
                                                              layers.encoder_layers > m else 0)


def layer_weight_copy(spec: MemorySpec) -> int:
    """Bytes of autocast's compute-dtype copies of one decoder layer's linear weights (one
    tensor-parallel rank)."""
    h, f, t, e = spec.hidden, spec.ffn, spec.tp, spec.e
    proj = spec.heads * spec.kv_channels
    return (h * spec.qkv_width + proj * h + (3 if spec.gated else 2) * h * f) // t * e


def attention_half(spec: MemorySpec, b: int) -> int:
    """What a layer has saved by the end of its attention core (the first norm, the q, k, v
    projections' input and output, the core's kept tensors, rotary's tables): with
    :func:`gpt2_layer` less it, what the layer saves after its attention.

    Args:
        spec: the run.
        b: samples per micro-batch.
    """
    s = spec.seq_local
    tokens = s * b
    copies = 1 + (2 if spec.autocast and spec.separate_projections else 0)
    total = norm_bytes(spec, tokens, spec.norm_stats) + \
        copies * tokens * spec.hidden * spec.e // sp_divisor(spec)
    total += qkv_kept(spec, tokens) + attention_core(spec, Shape(s, s, b))
    if spec.positions == "rotary":
        total += 2 * s * spec.kv_channels * 4 * (b if spec.ring else 1)
    return total


def recompute_input(spec: MemorySpec, tokens: int) -> int:
    """What a recomputed group of layers keeps: its input hidden state.

    Args:
        spec: the run.
        tokens: sequence x micro-batch.
    """
    return tokens * spec.hidden * spec.residual_bytes // sp_divisor(spec)


def full_recompute(spec: MemorySpec, n: int, layer: int, kept: int, mask: int):
    """``(saved bytes, recompute peak)`` of ``n`` layers of ``layer`` bytes each: under full
    recompute, uniform: each group of ``recompute_num_layers`` keeps its input (``kept``),
    one group's activations come back at a time; block: the first ``recompute_num_layers``
    layers (of this stage or chunk) keep their input, one comes back at a time, the rest
    keep everything. A recomputed group also keeps the mask it was given (``mask`` bytes,
    one tensor for all).

    Args:
        spec: the run.
        n: layers of the stage or chunk.
        layer: bytes one layer saves without recompute.
        kept: bytes a recomputed group keeps (its input).
        mask: bytes of the mask a checkpoint keeps.
    """
    if spec.recompute != "full" or not n:
        return n * layer, 0
    k = spec.recompute_num_layers
    if spec.recompute_method == "block":
        recomputed = min(k, n)
        return recomputed * kept + mask + (n - recomputed) * layer, layer
    return -(-n // k) * kept + mask, min(k, n) * layer


def gpt2_embedding(spec: MemorySpec, b: int) -> int:
    """Word and position lookups (their int64 ids) and the embedding dropout's mask.

    Args:
        spec: the run.
        b: samples per micro-batch.
    """
    tokens = spec.seq_local * b
    # token ids (local ids under tp) and, for a position table, position ids
    ids = (2 if spec.positions == "learned" else 1) * tokens * 8
    if spec.tp > 1:
        ids += tokens  # VocabParallelEmbedding's out-of-range mask
    drop = dropout_bytes(spec, tokens * spec.hidden // sp_divisor(spec), spec.residual_bytes,
                         spec.hidden_dropout)
    return ids + drop


def output_and_loss(spec: MemorySpec, b: int, s: int) -> int:
    """The output layer's input, the vocab-parallel cross entropy (fp32
    softmax, target ids and range mask) and the loss-mask product.

    Args:
        spec: the run.
        b: samples per micro-batch.
        s: the length the loss runs over (T5: the decoder's).
    """
    tokens, v = s * b, spec.vocab // spec.tp
    total = tokens * spec.hidden * spec.e // sp_divisor(spec)  # a shard under SP
    total += tokens * v * 4 + tokens * (8 + 1)  # softmax, local targets, outside mask
    return total + 2 * tokens * 4  # per-token losses and the loss mask


@dataclass(frozen=True)
class Activations:
    """Bytes one micro-batch keeps on a stage until its backward."""

    saved: int
    """Saved for the backward (what ``saved_tensors_hooks`` sees)."""
    recompute_peak: int
    """Extra bytes while one recomputed group runs its forward again in the backward."""


def gpt2_stage(spec: MemorySpec, layers: StageLayers) -> Activations:
    """Activation bytes of one micro-batch on one rank of ``layers``' GPT-2 stage.

    Args:
        spec: the run.
        layers: the stage (:func:`~megatron.memory.stages.stage_layers`).
    """
    b, tokens = spec.micro_batch, spec.seq_local * spec.micro_batch
    n = layers.encoder_layers
    # a recomputed group keeps the [1, 1, s, s] mask it was given (on a pipeline stage the
    # one the engine received: report.py then does not count it again); cp: the layout
    layer = gpt2_layer(spec, b)
    if layers.moe_layers:  # the stage's mean layer; a recompute brings back the largest
        total_layers, largest = stage_layer_bytes(spec, layers, b)
        layer = total_layers // n
    body, peak = full_recompute(spec, n, layer, recompute_input(spec, tokens),
                                gpt2_mask_bytes(spec))
    if layers.moe_layers and peak:
        peak = peak // layer * largest
    total = body
    if layers.embedding:
        total += gpt2_embedding(spec, b)
    if layers.final_norm:
        total += norm_bytes(spec, tokens, spec.norm_stats)
    if layers.head:
        total += output_and_loss(spec, b, spec.seq_local)
    return Activations(total, peak)


def gpt2_mask_bytes(spec: MemorySpec) -> int:
    """The mask a decoder's layers are given: the bool ``[1, 1, s, s]`` causal mask, or
    under context parallelism the int64 token layout ``[1, b, s / cp]`` (position ids;
    megatron/mpu/context_parallel.py).

    Args:
        spec: the run.
    """
    if spec.ring:
        return 8 * spec.micro_batch * spec.seq_local
    return spec.seq * spec.seq

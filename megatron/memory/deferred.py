"""What a zero-bubble schedule keeps of a chunk between its input pass and its weight pass.

The input pass (``BackwardInput``) frees the chunk's autograd graph, but every mpu linear
layer that deferred its weight-gradient GEMM (megatron/mpu/weight_grad.py) keeps that GEMM's
input and output gradient in the store until the weight pass: per GPT layer the QKV and
fc1 inputs (their ``[s/t, b, h]`` shards under sequence parallelism, gathered again at the
weight pass), the attention output and the GeLU output (fc2's input), and the gradients of
the QKV, attention-projection, fc1 and fc2 outputs; on the last chunk the output layer's
input and the logits' gradient. Everything in the compute dtype.
"""
from ..config.run_config import ZERO_BUBBLE_SCHEDULES
from .activations import sp_divisor
from .spec import MemorySpec
from .stages import StageLayers


def _linear(spec: MemorySpec, tokens: int, inp: int, out: int, sharded_input: bool) -> int:
    """One deferred GEMM's input ``[tokens, inp]`` and output gradient ``[tokens, out]``
    (local widths; a column-parallel layer's input is a sequence shard under SP)."""
    rows = tokens // sp_divisor(spec) if sharded_input else tokens
    return (rows * inp + tokens * out) * spec.e


def _attention_and_mlp(spec: MemorySpec, tokens: int, kv_tokens: int = 0) -> int:
    """Self-attention (QKV, projection), an optional cross-attention over ``kv_tokens``
    encoder positions (Q, KV, projection) and the MLP of one layer."""
    h, t = spec.hidden, spec.tp
    proj, f = spec.heads * spec.kv_channels // t, spec.ffn // t
    total = _linear(spec, tokens, h, spec.qkv_width // t, True) + \
        _linear(spec, tokens, proj, h, False)
    if kv_tokens:
        total += _linear(spec, tokens, h, proj, True) + _linear(spec, tokens, proj, h, False)
        total += _linear(spec, kv_tokens, h, 2 * proj, True)
    gates = 2 if spec.gated else 1
    total += _linear(spec, tokens, h, gates * f, True)  # gated: two GEMMs, one input
    return total + _linear(spec, tokens, f, h, False)


def gemm_weight_params(spec: MemorySpec, layers: StageLayers) -> int:
    """Weight elements (one tensor-parallel rank) whose gradient a zero-bubble weight pass
    makes: the linear layers' weights and, on the head's chunk, the output layer's (the
    tied word embedding). Their gradients appear at the chunk's first weight pass; the
    rest (norms, biases, embedding lookups) at its first input pass."""
    h, t, f, proj = spec.hidden, spec.tp, spec.ffn, spec.heads * spec.kv_channels
    gates = 2 if spec.gated else 1
    enc = (h * spec.qkv_width + proj * h + (gates + 1) * h * f) // t
    dec = enc + 4 * h * proj // t  # cross-attention: q, kv, projection
    total = layers.encoder_layers * enc + layers.decoder_layers * dec
    return total + (spec.vocab // t * h if layers.head else 0)


def deferred_bytes(spec: MemorySpec, layers: StageLayers) -> int:
    """Bytes one micro-batch keeps on ``layers`` (a chunk) from its input pass to its
    weight pass under a zero-bubble schedule (0 for the others).

    Args:
        spec: the run.
        layers: the chunk (:func:`~megatron.memory.stages.chunk_layers` or a stage).
    """
    if spec.pipeline_schedule not in ZERO_BUBBLE_SCHEDULES:
        return 0
    b = spec.micro_batch
    enc, dec = spec.seq_local * b, (spec.dec_seq if spec.family == "t5" else 0) * b
    total = layers.encoder_layers * _attention_and_mlp(spec, enc)
    total += layers.decoder_layers * _attention_and_mlp(spec, dec, kv_tokens=enc)
    if layers.head:
        tokens = dec if spec.family == "t5" else enc
        total += _linear(spec, tokens, spec.hidden, spec.vocab // spec.tp, True)
    return total


def largest_weight_grad(spec: MemorySpec, layers: StageLayers, grad_bytes: int) -> int:
    """Bytes of the largest weight gradient a zero-bubble weight pass of ``layers`` makes
    at once (its GEMM's result before it is added into ``.grad``).

    Args:
        spec: the run.
        layers: the chunk.
        grad_bytes: bytes per element of a gradient.
    """
    h, t, f = spec.hidden, spec.tp, spec.ffn
    gates = 2 if spec.gated else 1
    largest = max(gates * f * h, spec.qkv_width * h) // t if layers.encoder_layers or \
        layers.decoder_layers else 0
    if layers.head:
        largest = max(largest, spec.vocab // t * h)
    return largest * grad_bytes

"""Parameters, gradients and optimizer state per rank (the "model states").

Parameter counts follow the layers of megatron/model (per tensor-parallel rank: split
weights divided by tp, norms and row-parallel biases replicated). Bytes per parameter:

========================  ========  ======  =====================================
backend, precision        weights   grads   optimizer (AdamW: exp_avg, exp_avg_sq)
========================  ========  ======  =====================================
DDP, any (autocast)       4         4       8
engine fp32               4         4       8
engine fp16 / bf16        2         2       4 (fp32 master) + 8
engine bf16, pp > 1       2         2       2 (flat bf16 grad buffer) + 12 / dp
ZeRO-1 (engine)           w         w       (4 master + 8) / dp
ZeRO-2 (engine)           w         w / dp  (4 master + 8) / dp
========================  ========  ======  =====================================

(w: 4 in fp32, 2 in fp16 / bf16.) ZeRO's fp32 gradient partition (4 / dp) lives only
during the optimizer step, when the activations are gone: it is not counted. The last
pipeline stage's tied embedding copy carries GPT-2's position table, which gets no
gradient there.
"""
from dataclasses import dataclass

from .spec import MemorySpec
from .stages import StageLayers


@dataclass(frozen=True)
class ModelStates:
    """Bytes one rank holds for its parameters, their gradients and the optimizer."""

    params: int
    """Parameter elements on this rank."""
    weight_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    """AdamW moments, fp32 masters and the fp32 gradient partition where the engine keeps
    them."""

    @property
    def total(self) -> int:
        return self.weight_bytes + self.grad_bytes + self.optimizer_bytes


def _gpt2_layer_params(spec: MemorySpec) -> int:
    h, f, t, proj = spec.hidden, spec.ffn, spec.tp, spec.heads * spec.kv_channels
    weights = (3 * h * proj + proj * h + 2 * h * f) // t
    biases = (3 * proj + f) // t + 2 * h if spec.bias else 0
    return weights + biases + 4 * h  # two LayerNorms (weight and bias)


def _t5_layer_params(spec: MemorySpec, decoder: bool) -> int:
    h, f, t, proj = spec.hidden, spec.ffn, spec.tp, spec.heads * spec.kv_channels
    mlp = ((2 if spec.ff_type == "gated-gelu" else 1) * h * f + f * h) // t
    attention = 4 * h * proj // t  # fused qkv + dense (cross: q, kv, dense: the same)
    return mlp + attention * (2 if decoder else 1) + h * (3 if decoder else 2)  # RMSNorms


def stage_params(spec: MemorySpec, layers: StageLayers) -> int:
    """Parameter elements one tensor-parallel rank of ``layers``' stage holds.

    Args:
        spec: the run.
        layers: the stage.
    """
    h, t = spec.hidden, spec.tp
    word = spec.vocab // t * h
    if spec.family == "gpt2":
        embedding = word + spec.max_positions * h  # learned positions, replicated
        count = layers.encoder_layers * _gpt2_layer_params(spec)
        count += embedding * (layers.embedding + (layers.head and spec.pp > 1))
        return count + 2 * h * layers.final_norm
    count = layers.encoder_layers * _t5_layer_params(spec, False)
    count += layers.decoder_layers * _t5_layer_params(spec, True)
    bias_table = spec.num_buckets * spec.heads // t
    count += bias_table * ((layers.encoder_layers > 0) + (layers.decoder_layers > 0))
    count += h * (layers.encoder_norm + layers.final_norm)
    # the output layer is a tied copy of the embedding (pp > 1) or T5's own lm head
    head = layers.head and (spec.pp > 1 or not spec.tie_embeddings)
    return count + word * (layers.embedding + head)


def _no_grad_params(spec: MemorySpec, layers: StageLayers) -> int:
    """Parameters that never receive a gradient: the position table of GPT-2's tied
    embedding copy on the last pipeline stage (only the word embedding is used there)."""
    if spec.family == "gpt2" and layers.head and spec.pp > 1 and not layers.embedding:
        return spec.max_positions * spec.hidden
    return 0


def model_states(spec: MemorySpec, layers: StageLayers) -> ModelStates:
    """Model-state bytes on each rank of ``layers``' stage (see the module table).

    Args:
        spec: the run.
        layers: the stage (from :func:`~megatron.memory.stages.stage_layers`).
    """
    n = stage_params(spec, layers)
    g = n - _no_grad_params(spec, layers)
    if spec.backend == "ddp" or spec.dtype == "fp32" and not spec.zero_stage:
        return ModelStates(n, 4 * n, 4 * g, 8 * n)
    w = 4 if spec.dtype == "fp32" else 2
    partition = -(-n // spec.dp)  # ceil: DeepSpeed pads the flat buffer to dp parts
    if spec.zero_stage == 0 and spec.dtype == "bf16" and spec.pp > 1:
        # DeepSpeed's BF16_Optimizer (bf16 pipelines): a whole flat gradient buffer in the
        # accumulation dtype (bf16 by default) and the fp32 master + moments over dp
        return ModelStates(n, w * n, w * g, 2 * n + 12 * partition)
    if spec.zero_stage == 0:
        return ModelStates(n, w * n, w * g, 12 * n)
    grads = w * g if spec.zero_stage == 1 else w * -(-g // spec.dp)
    return ModelStates(n, w * n, grads, 12 * partition)

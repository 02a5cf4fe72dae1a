"""Parameters, gradients and optimizer state per rank (the "model states").

Parameter counts follow the layers of megatron/model (per tensor-parallel rank: split
weights divided by tp, norms and row-parallel biases replicated). Bytes per parameter:

===========================  ========  ======  ==================================
backend, precision           weights   grads   optimizer (AdamW: exp_avg, exp_avg_sq)
===========================  ========  ======  ==================================
own step, any (autocast)     4         4       8 (distributed optimizer: 8 / dp)
engine fp32                  4         4       8
engine fp16 / bf16           2         2       4 (fp32 master) + 8
BF16_Optimizer (below)       2         2       a (flat gradient buffer) + 12 / dp
ZeRO-1 (engine)              w         w       (4 master + 8) / dp
ZeRO-2 (engine)              w         w / dp  (4 master + 8) / dp
===========================  ========  ======  ==================================

(w: 4 in fp32, 2 in fp16 / bf16.) The project's own step (every layout but ``--deepspeed``,
"ddp" here) keeps fp32 weights and one fp32 gradient buffer over every trained parameter
(allocated once, never freed: the position table of GPT-2's tied copy included); its
distributed optimizer holds the moments of each rank's 1 / dp slice of every bucket.
DeepSpeed's engine (``--deepspeed``, pp 1) follows the other rows. DeepSpeed 0.19 gives bf16 weights its BF16_Optimizer in
a pipeline without ZeRO and under ZeRO-1 with ``data_types.grad_accum_dtype: fp32``; its
flat buffer accumulates in that dtype (``a`` = 2 for bf16, the default, 4 for fp32) and
covers the whole stage, not a 1 / dp share. The last pipeline stage's tied embedding copy
carries GPT-2's position table, which gets no gradient there. ``dp`` is the group the
gradients are reduced over: data x context parallel (``MemorySpec.grad_ranks``), which
DeepSpeed is given as its data-parallel group under context parallelism.

What exists only while the gradients are reduced and the optimizer steps, when the
activations are gone, is :func:`step_bytes`.
"""
from dataclasses import dataclass, replace

from .moe import dense_mlp_params, dense_moe_params, expert_grad_ranks, expert_params
from .spec import MemorySpec
from .stages import StageLayers

#: Elements DeepSpeed's data-parallel all-reduce flattens into one bucket (its
#: ``MEMORY_OPT_ALLREDUCE_SIZE``, which the pipeline engine passes).
ALLREDUCE_BUCKET = 500_000_000


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
    mlp_in = (2 if spec.gated else 1) * f  # fc1, or SwiGLU's gate and up
    weights = (h * spec.qkv_width + proj * h + mlp_in * h + f * h) // t
    biases = (spec.qkv_width + mlp_in) // t + 2 * h if spec.bias else 0
    return weights + biases + 2 * _norm_params(spec)  # two norms


def _norm_params(spec: MemorySpec) -> int:
    """A norm's parameters: LayerNorm's weight and bias, RMSNorm's weight."""
    return spec.hidden * (1 if spec.norm == "rmsnorm" else 2)


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
        positions = spec.max_positions * h if spec.positions == "learned" else 0
        embedding = word + positions  # learned positions, replicated
        count = layers.encoder_layers * _gpt2_layer_params(spec)
        if layers.moe_layers:  # the MLP replaced by the router, the experts, shared experts
            count += layers.moe_layers * (dense_moe_params(spec) + expert_params(spec) -
                                          dense_mlp_params(spec))
        if not spec.tie_embeddings:  # an output layer of its own
            return count + embedding * layers.embedding + word * layers.head + \
                _norm_params(spec) * layers.final_norm
        # the head's tied copy is another module only on another rank (ZB-V's rank 0 and a
        # serial model hold both uses of one embedding)
        count += embedding * (layers.embedding or (layers.head and spec.pp > 1))
        return count + _norm_params(spec) * layers.final_norm
    count = layers.encoder_layers * _t5_layer_params(spec, False)
    count += layers.decoder_layers * _t5_layer_params(spec, True)
    bias_table = spec.num_buckets * spec.heads // t
    count += bias_table * ((layers.encoder_layers > 0) + (layers.decoder_layers > 0))
    count += h * (layers.encoder_norm + layers.final_norm)
    # the output layer is a tied copy of the embedding on another rank, or T5's own lm head
    head = layers.head and (not spec.tie_embeddings or (spec.pp > 1 and not layers.embedding))
    return count + word * (layers.embedding + head)


def _no_grad_params(spec: MemorySpec, layers: StageLayers) -> int:
    """Parameters that never receive a gradient: the position table of GPT-2's tied
    embedding copy on the last pipeline stage (only the word embedding is used there)."""
    if spec.family == "gpt2" and layers.head and spec.pp > 1 and not layers.embedding and \
            spec.tie_embeddings and spec.positions == "learned":
        return spec.max_positions * spec.hidden
    return 0


def bf16_optimizer(spec: MemorySpec) -> bool:
    """DeepSpeed 0.19 steps this run with its BF16_Optimizer: bf16 weights in a pipeline
    without ZeRO, or ZeRO-1 with ``data_types.grad_accum_dtype: fp32`` (its
    ``_do_optimizer_sanity_check``).

    Args:
        spec: the run.
    """
    if spec.backend != "engine" or spec.dtype != "bf16":
        return False
    if spec.zero_stage == 0:
        return spec.pp > 1
    return spec.zero_stage == 1 and spec.grad_accum == "fp32"


def model_states(spec: MemorySpec, layers: StageLayers) -> ModelStates:
    """Model-state bytes on each rank of ``layers``' stage (see the module table).

    Args:
        spec: the run.
        layers: the stage (from :func:`~megatron.memory.stages.stage_layers`).
    """
    n = stage_params(spec, layers)
    g = n - _no_grad_params(spec, layers)
    partition = _partition(spec, layers, n)
    if spec.backend == "ddp":  # the gradient buffer covers every trained parameter
        return ModelStates(n, 4 * n, 4 * n, 8 * (partition if spec.zero_stage else n))
    if spec.dtype == "fp32" and not spec.zero_stage:
        return ModelStates(n, 4 * n, 4 * g, 8 * n)
    w = 4 if spec.dtype == "fp32" else 2
    if bf16_optimizer(spec):
        # a whole flat gradient buffer in the accumulation dtype (bf16 unless the JSON's
        # data_types.grad_accum_dtype says fp32) and the fp32 master + moments over dp; the
        # bf16 .grad of each weight comes and goes with the step
        return ModelStates(n, w * n, w * g, spec.accum_bytes * n + 12 * partition)
    if spec.zero_stage == 0:
        return ModelStates(n, w * n, w * g, 12 * n)
    grads = w * g if spec.zero_stage == 1 else w * -(-g // spec.grad_ranks)
    return ModelStates(n, w * n, grads, 12 * partition)


def _partition(spec: MemorySpec, layers: StageLayers, n: int) -> int:
    """Elements of one rank's slice of the stage's gradient buffers: the dense buffer
    over dp x cp, the expert buffer (its own) over the expert-data-parallel ranks
    (megatron/distributed/grad_buffer.py, megatron/optimizer/distributed.py); each padded
    to whole parts (ceil)."""
    experts = layers.moe_layers * expert_params(spec)
    dense = -(-(n - experts) // spec.grad_ranks)
    return dense + (-(-experts // expert_grad_ranks(spec)) if experts else 0)


def _largest_param(spec: MemorySpec, layers: StageLayers) -> int:
    """Elements of the stage's largest parameter tensor on one tensor-parallel rank."""
    t = spec.tp
    largest = max(spec.ffn * spec.hidden, spec.qkv_width * spec.hidden) // t \
        if layers.encoder_layers or layers.decoder_layers else spec.hidden
    if layers.embedding or layers.head:
        largest = max(largest, spec.vocab // t * spec.hidden)
    if layers.moe_layers:  # a stacked expert weight (fc1: [E / ep, F1 / tp, h])
        largest = max(largest, expert_params(spec) * (2 if spec.gated else 1) //
                      (3 if spec.gated else 2))
    return largest


def _copied_buckets(spec: MemorySpec, layers: StageLayers, n: int) -> int:
    """Elements of the buckets whose gloo copies the distributed optimizer's collectives
    hold at once: the largest, or with an expert buffer its bucket and the dense one's."""
    experts = layers.moe_layers * expert_params(spec)
    if not experts:
        return _largest_bucket(spec, layers, n)
    return experts + _largest_bucket(spec, replace(layers, moe_layers=0), n - experts)


def _largest_bucket(spec: MemorySpec, layers: StageLayers, n: int) -> int:
    """Elements of a stage's largest gradient bucket (one bucket, but a weight tied across
    pipeline stages, the word embedding, has its own: megatron/distributed)."""
    word = spec.vocab // spec.tp * spec.hidden
    experts = layers.moe_layers * expert_params(spec)
    if experts:  # the expert parameters' buffer is a bucket of its own
        return max(experts, _largest_bucket(spec, replace(layers, moe_layers=0), n - experts))
    tied = spec.pp > 1 and spec.tie_embeddings and (layers.embedding or layers.head)
    return max(word, n - word) if tied else n


def step_bytes(spec: MemorySpec, layers: StageLayers, states: ModelStates) -> int:
    """Bytes beyond the model states while the step reduces the gradients and updates the
    weights (the activations are gone by then): the larger of the two moments.

    - The reduction: DeepSpeed's all-reduce flattens the gradients into one bucket of up
      to :data:`ALLREDUCE_BUCKET` elements (the BF16_Optimizer's flat buffers, one per
      parameter group, are concatenated the same way, and cast to the weights' dtype to
      be sent when they accumulate in fp32); the torch DDP backend reduces in its own
      buckets (a buffer).
    - The update: DeepSpeed's unfused fp16 / bf16 optimizer gives every fp32 master an
      fp32 copy of its gradient (``4 n``), the BF16_Optimizer one of its bf16-accumulated
      partition (``4 n / dp``; none when it accumulates in fp32), ZeRO an fp32 gradient
      partition (``4 n / dp``); on the CPU torch's AdamW runs tensor by tensor and holds
      two temporaries of the tensor it updates (fused on CUDA: none). The project's own step
      reduces, clips and all-gathers in place in its buffers: only the update's temporaries
      (of the largest parameter, or with the distributed optimizer of the largest part of
      one in the rank's slice), and on the CPU gloo's copy of a bucket in the distributed
      optimizer's reduce-scatter and all-gather.

    Args:
        spec: the run.
        layers: the stage.
        states: its model states (:func:`model_states`).
    """
    n = states.params
    partition = _partition(spec, layers, n)
    if spec.backend == "ddp":  # tensor by tensor: a parameter, or its part in this slice
        if spec.device != "cpu":
            return 0
        largest = _largest_param(spec, layers)
        # with an expert buffer a third temporary of the largest parameter (measured on the
        # CPU: tests/test_memory_peak.py's MoE layouts)
        third = 4 * largest if layers.moe_layers else 0
        if not spec.zero_stage:
            return 2 * 4 * largest + third
        # gloo's reduce-scatter and all-gather copy a bucket (NCCL's run in place); with
        # an expert buffer the copies of both buffers' buckets are alive at once (measured)
        return 2 * 4 * min(largest, partition) + 4 * _copied_buckets(spec, layers, n) + third
    flat = bf16_optimizer(spec) or spec.zero_stage > 0  # the optimizer steps flat partitions
    adam = 2 * 4 * (partition if flat else _largest_param(spec, layers)) \
        if spec.device == "cpu" else 0
    if bf16_optimizer(spec):
        bucket = min(n, ALLREDUCE_BUCKET)  # fp32 accumulation: also its bf16 copy to send
        reduce = bucket * spec.accum_bytes + (bucket * spec.e if spec.accum_bytes != spec.e
                                              else 0)
        return max(reduce, (4 * partition if spec.accum_bytes != 4 else 0) + adam)
    if spec.zero_stage:
        return 4 * partition + adam
    w = 4 if spec.dtype == "fp32" else 2
    reduce = min(states.grad_bytes // w, ALLREDUCE_BUCKET) * w
    return max(reduce, (4 * n if w == 2 else 0) + adam)

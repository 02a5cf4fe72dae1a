"""T5's activation bytes per micro-batch: encoder and decoder layers (self-attention with
the relative position bias, the decoder's cross-attention over the encoder output), the
shared embedding on the first stage, the output layer and loss on the last.

Beyond GPT-2's terms (megatron/memory/activations.py): RMSNorm keeps one fp32 statistic
per row; every layer looks its relative bias up again (int64 bucket ids ``s x s``) and,
under SDPA, hands it with the mask to the kernel as one additive ``[b, a/t, s, s]`` mask
in the compute dtype; the feed-forward applies dropout to its ``d_ff`` activation.
"""
from .activations import (Activations, Shape, attention_core, cpu_math_path, dropout_bytes,
                          norm_bytes, output_and_loss, recompute_input, sp_divisor)
from .spec import MemorySpec
from .stages import StageLayers


def _attention(spec: MemorySpec, shape: Shape, bias: bool) -> int:
    """One T5 attention's core plus its bias lookup and additive mask."""
    e, t = spec.e, spec.tp
    proj = spec.heads * spec.kv_channels
    # bucket ids: each pipeline layer looks its bias up again; T5Model once per stack
    total = shape.sq * shape.sk * 8 if bias and spec.pp > 1 else 0
    if spec.attention == "sdpa" and bias and spec.device == "cpu":
        # A mask that needs a gradient (the bias) sends SDPA to PyTorch's math path on
        # the CPU: scaled queries, transposed keys, the softmax and a context copy.
        tokens = shape.sq * shape.b
        scores = spec.heads * shape.b * shape.sq * shape.sk * e // t
        kept = 3 if spec.attention_dropout > 0 else 1  # softmax (+ mask, dropped)
        return total + (2 * tokens + shape.sk * shape.b) * proj * e // t + kept * scores
    total += attention_core(spec, shape)
    if spec.attention == "sdpa" and not cpu_math_path(spec):  # the math path adds it
        heads = spec.heads // t if bias else 1  # without a bias the mask is per sample
        total += shape.b * heads * shape.sq * shape.sk * e
    return total


def _mlp(spec: MemorySpec, tokens: int) -> int:
    f, t, e = spec.ffn, spec.tp, spec.e
    inner = tokens * f // t
    total = tokens * spec.hidden * e // sp_divisor(spec)  # fc1 input (a shard under SP)
    if spec.ff_type == "gated-gelu":
        total += 2 * inner * e + 2 * inner * e  # fused gate/linear output, GeLU, product
    else:
        total += inner * e  # ReLU output
    total += dropout_bytes(spec, inner, e, spec.hidden_dropout)
    if spec.hidden_dropout > 0:
        total += inner * e  # the dropped activation (fc2's input)
    return total


def _residual_dropouts(spec: MemorySpec, tokens: int, count: int) -> int:
    return count * dropout_bytes(spec, tokens * spec.hidden // sp_divisor(spec), spec.e,
                                 spec.hidden_dropout)


def t5_layer_weight_copy(spec: MemorySpec, decoder: bool) -> int:
    """Autocast's compute-dtype weight copies of one encoder (decoder) layer (held once per
    step: megatron/memory/report.py's ``autocast_weight_copies``)."""
    h, f, proj = spec.hidden, spec.ffn, spec.heads * spec.kv_channels
    mlp = ((2 if spec.ff_type == "gated-gelu" else 1) + 1) * h * f
    return (mlp + 4 * h * proj * (2 if decoder else 1)) // spec.tp * spec.e


def t5_layer(spec: MemorySpec, decoder: bool) -> int:
    """Bytes one encoder (or decoder) layer saves for one micro-batch.

    Args:
        spec: the run.
        decoder: a decoder layer (self- and cross-attention) rather than an encoder layer.
    """
    b, t, e = spec.micro_batch, spec.tp, spec.e
    proj = spec.heads * spec.kv_channels
    s = spec.dec_seq if decoder else spec.seq
    tokens = s * b
    norms = 3 if decoder else 2
    total = norms * norm_bytes(spec, tokens, stats=1)
    c = sp_divisor(spec)  # under SP a linear layer keeps its input shard
    total += tokens * spec.hidden * e // c + 3 * tokens * proj * e // t  # QKV in and out
    total += _attention(spec, Shape(s, s, b), bias=True)
    if decoder:
        enc_tokens = spec.seq * b
        total += tokens * spec.hidden * e // c  # query input
        if not cpu_math_path(spec):  # the math path keeps a scaled copy instead
            total += tokens * proj * e // t
        total += enc_tokens * spec.hidden * e // c + 2 * enc_tokens * proj * e // t  # k, v
        total += _attention(spec, Shape(s, spec.seq, b), bias=False)
    total += _mlp(spec, tokens)
    total += _residual_dropouts(spec, tokens, norms)
    return total


def _recomputed_masks(spec: MemorySpec, enc: bool, dec: bool) -> int:
    """The masks the recomputed groups are given and keep. T5Model (pp = 1) folds each
    stack's bias and padding mask once (megatron/model/attention.py ``fold_mask``): the
    additive ``[b, a/t, s, s]`` self-attention masks and the ``[b, 1, s_dec, s]`` cross mask
    in the compute dtype, plus the bool conditions the fold's ``where`` keeps for the bias's
    gradient. A pipeline stage passes the fp32 bias ``[a/t, s, s]`` and the bool masks on
    and each layer folds its own."""
    b, e, heads = spec.micro_batch, spec.e, spec.heads // spec.tp
    se, sd = spec.seq, spec.dec_seq
    if spec.pp > 1:
        return heads * 4 * (se ** 2 * enc + sd ** 2 * dec) + \
            b * (se ** 2 * enc + sd * (sd + se) * dec)
    folded = b * heads * (se ** 2 * enc + sd ** 2 * dec) * e + b * sd * se * e * dec
    return folded + b * (se ** 2 * enc + sd ** 2 * dec)  # + the where's bool conditions


def t5_stage(spec: MemorySpec, layers: StageLayers) -> Activations:
    """Activation bytes of one micro-batch on one rank of ``layers``' T5 stage.

    Args:
        spec: the run.
        layers: the stage (:func:`~megatron.memory.stages.stage_layers`).
    """
    b = spec.micro_batch
    enc_tokens, dec_tokens = spec.seq * b, spec.dec_seq * b
    n_enc, n_dec = layers.encoder_layers, layers.decoder_layers
    peak = 0
    if spec.recompute == "full" and (n_enc or n_dec):
        k = spec.recompute_num_layers
        total = -(-n_enc // k) * recompute_input(spec, enc_tokens)
        total += -(-n_dec // k) * recompute_input(spec, dec_tokens)
        if n_dec:  # the encoder output every decoder group reads (one storage)
            total += recompute_input(spec, enc_tokens)
        total += _recomputed_masks(spec, n_enc > 0, n_dec > 0)
        peak = k * max(t5_layer(spec, False) if n_enc else 0,
                       t5_layer(spec, True) if n_dec else 0)
    else:
        total = n_enc * t5_layer(spec, False) + n_dec * t5_layer(spec, True)
        if spec.attention == "sdpa" and spec.device == "cpu":  # the math path keeps the mask
            total += b * (spec.seq ** 2 * (n_enc > 0) + spec.dec_seq ** 2 * (n_dec > 0))
    if spec.pp == 1:  # T5Model's one bias lookup per stack
        total += 8 * (spec.seq ** 2 * (n_enc > 0) + spec.dec_seq ** 2 * (n_dec > 0))
    if layers.embedding:
        total += 2 * (enc_tokens + dec_tokens) * 8 // (1 if spec.tp > 1 else 2)  # ids
        total += (enc_tokens + dec_tokens) * (1 if spec.tp > 1 else 0)
        total += _residual_dropouts(spec, enc_tokens + dec_tokens, 1)
    for present, tokens in ((layers.encoder_norm, enc_tokens), (layers.final_norm, dec_tokens)):
        if present:
            total += norm_bytes(spec, tokens, stats=1) + _residual_dropouts(spec, tokens, 1)
    if layers.head:
        total += output_and_loss(spec, b, spec.dec_seq)
    return Activations(total, peak)

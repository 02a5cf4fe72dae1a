"""T5 building blocks on tensor-parallel layers. Activations are ``[s, b, h]`` throughout.

Per encoder layer (pre-RMSNorm, T5):
    x = x + dropout(self_attention(rms_1(x), bias))       relative position bias, no 1/sqrt(d)
    x = x + dropout(mlp(rms_2(x)))                        ReLU (v1.0) or gated-GeLU (v1.1)
A decoder layer adds ``x = x + dropout(cross_attention(rms(x), encoder_output))`` between
the two. No linear layer has a bias; the norms have no bias and do not subtract the mean.
With ``--num-experts`` the layers ``--moe-layer-freq`` picks (in each stack) have an MoE block
in the MLP's place: the Switch Transformer (Fedus, Zoph, Shazeer 2021; top-1, capacity and
z-loss from the MoE flags).

Tensor parallelism: heads are split across tp ranks (fused QKV laid out per head, like
GPT-2, so a contiguous split gives whole heads), the feed-forward width is split, and the
relative-attention table ``[num_buckets, heads]`` is split along its heads: each rank only
needs the bias of its own heads. Initialisation follows T5 (Mesh TensorFlow / Hugging Face
``_init_weights`` with factor 1), drawn per module from its own seed (see ``init_rng``).
"""
import functools
import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .. import mpu
from .attention import (
    bmm_attention,
    resolve_attention_backend,
    sdpa_attention,
)
from .fused_layer_norm import MixedFusedRMSNorm
from .fused_softmax import AttnMaskType, FusedScaleMaskSoftmax
from .language_model import parallel_lm_logits
from .recompute import core_attention, recompute_core
from .transformer import ModelRunOptions, attention_mask_func
from .utils import init_method_normal, init_rng

FF_TYPES = ("relu", "gated-gelu")


@dataclass
class T5TransformerConfig(ModelRunOptions):
    """Sizes and options of a T5 model (from flags: megatron.families.t5)."""

    num_layers: int
    """Layers per stack (encoder and decoder each)."""
    hidden_size: int
    """d_model."""
    num_attention_heads: int
    kv_channels: int
    """Per-head size (HF's d_kv, CPM's --kv-hidden-size)."""
    ffn_hidden_size: int
    """d_ff."""
    vocab_size: int
    """Padded vocabulary size."""
    num_buckets: int = 32
    max_distance: int = 128
    ff_type: str = "relu"
    tie_embeddings: bool = True
    """Output layer tied to the word embedding (T5 v1.0; hidden scaled by d_model^-0.5)."""
    layernorm_epsilon: float = 1e-6
    moe: Optional[mpu.moe.MoEConfig] = None
    """The Switch Transformer's MoE block (``--num-experts``), or None: dense T5."""
    moe_layers: Optional[Tuple[bool, ...]] = None
    """Per layer of each stack: an MoE block instead of the dense MLP."""

    def feed_forward(self, layer_number: int, number_in_model: int):
        """The MLP of 1-based layer ``layer_number`` of a stack: T5's, or an MoE block
        named ``number_in_model`` in the model's routing statistics (encoder 1..L, decoder
        L+1..2L)."""
        if self.moe is not None and self.moe_layers[layer_number - 1]:
            return mpu.moe.MoELayer(self.moe, number_in_model, self.sequence_parallel)
        return T5MLP(self)

    @property
    def inner_size(self):
        """heads x d_kv: the width of the attention projections."""
        return self.num_attention_heads * self.kv_channels


def rms_norm(config):
    """T5's layer norm (RMS, no bias, no mean) of width d_model, on the compute device."""
    return MixedFusedRMSNorm(config.hidden_size, eps=config.layernorm_epsilon,
                             device=mpu.get_device(), sequence_parallel=config.sequence_parallel)


def sp_factor(config):
    """Full sequence length / local length: tp under sequence parallelism, else 1."""
    return mpu.get_tensor_model_parallel_world_size() if config.sequence_parallel else 1


# ---------------------------------------------------------------- relative position bias
def relative_position_bucket(relative_position, bidirectional, num_buckets, max_distance):
    """T5's bucket of each ``key_pos - query_pos`` (int64 tensor in, int64 tensor out).

    Half the buckets (per direction when bidirectional) hold exact small distances; the rest
    cover ``[max_exact, max_distance)`` on a log scale, and anything further shares the last
    bucket. The arithmetic order matches T5's so the float-to-int truncation agrees.
    """
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = (relative_position > 0).long() * num_buckets  # keys after the query
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp(min=0)  # the future is never attended
    max_exact = num_buckets // 2
    # clamp(min=1) only keeps log() finite where the exact branch is taken anyway
    log_ratio = torch.log(distance.float().clamp(min=1) / max_exact) / \
        math.log(max_distance / max_exact)
    far = (max_exact + (log_ratio * (num_buckets - max_exact)).long()).clamp(max=num_buckets - 1)
    return buckets + torch.where(distance < max_exact, distance, far)


@functools.lru_cache(maxsize=32)
def _bucket_table(sq, sk, offset, bidirectional, num_buckets, max_distance, device):
    """``[sq, sk]`` buckets for queries at ``offset + i`` and keys at ``j`` (cached: every
    layer and step of one shape reuses it)."""
    query = torch.arange(offset, offset + sq, device=device)[:, None]
    key = torch.arange(sk, device=device)[None, :]
    return relative_position_bucket(key - query, bidirectional, num_buckets, max_distance)


class RelativePositionBias(nn.Module):
    """The learned ``[num_buckets, heads / tp]`` table and the ``[1, np, sq, sk]`` bias.

    Args:
        config: :class:`T5TransformerConfig`.
        bidirectional: True in the encoder, False (causal buckets) in the decoder.
    """

    def __init__(self, config, bidirectional):
        super().__init__()
        self.bidirectional = bidirectional
        self.num_buckets, self.max_distance = config.num_buckets, config.max_distance
        tp, tp_rank = mpu.get_tensor_model_parallel_world_size(), \
            mpu.get_tensor_model_parallel_rank()
        heads = config.num_attention_heads
        per_rank = mpu.divide(heads, tp, "attention heads", "tensor-model-parallel size")
        master = torch.empty(self.num_buckets, heads)  # the full table, same for any tp
        init_method_normal(config.hidden_size ** -0.5)(master)
        mine = master[:, tp_rank * per_rank:(tp_rank + 1) * per_rank]
        self.weight = nn.Parameter(mine.contiguous().to(mpu.get_device()))
        mpu.set_tensor_model_parallel_attributes(self.weight, True, 1, 1)

    def forward(self, sq, sk, offset=0):
        """Bias ``[1, np, sq, sk]`` for ``sq`` queries at positions ``offset..`` over ``sk`` keys."""
        # compiled code computes the table in the graph (dynamo traces through a cache)
        table = _bucket_table.__wrapped__ if torch.compiler.is_compiling() else _bucket_table
        buckets = table(sq, sk, offset, self.bidirectional, self.num_buckets,
                        self.max_distance, self.weight.device)
        bias = F.embedding(buckets, self.weight)  # [sq, sk, np]
        # contiguous [1, np, sq, sk]: an attention mask whose last dim has stride 1, as
        # SDPA's memory-efficient kernel requires (a permuted view has stride np: math path)
        return bias.permute(2, 0, 1).contiguous().unsqueeze(0)


# ---------------------------------------------------------------- attention
class PerHeadInit:
    """Initialiser of a fused weight whose rows are ``[heads, parts, d_kv]``: one std per part.

    Args:
        stds: the std of each fused projection, e.g. ``(std_q, std_k, std_v)``.
        head_dim: d_kv.
    """

    def __init__(self, stds, head_dim):
        self.stds, self.head_dim = tuple(stds), head_dim

    def __call__(self, weight):  # [heads * parts * d_kv, h]
        rows = weight.view(-1, len(self.stds), self.head_dim, weight.shape[1])
        for part, std in enumerate(self.stds):
            torch.nn.init.normal_(rows[:, part], mean=0.0, std=std)
        return weight


class T5Attention(nn.Module):
    """T5 multi-head attention (self or cross), heads split across tensor-parallel ranks.

    Unlike GPT-2 the scores are not scaled by 1/sqrt(d_kv) (T5 folds that into the query's
    initialisation), and the relative position bias is added to the scores before the
    masked softmax. The softmax fills masked entries with -10000 *after* the bias is added,
    so the bias never leaks into masked positions and the fused kernel applies unchanged.
    With the default ``sdpa`` backend the bias and the mask become one additive float mask
    (masked entries at the dtype's lowest value), whose gradient reaches the bias table.

    Args:
        config: :class:`T5TransformerConfig`.
        cross: cross-attention (queries from the decoder, keys/values from the encoder
            output) instead of self-attention.
    """

    def __init__(self, config, cross):
        super().__init__()
        tp = self.tp_size = mpu.get_tensor_model_parallel_world_size()
        self.heads_per_partition = mpu.divide(config.num_attention_heads, tp, "attention heads",
                                              "tensor-model-parallel size")
        self.head_dim, self.cross = config.kv_channels, cross
        h, inner, hn = config.hidden_size, config.inner_size, config.kv_channels
        std_q, std_kv = (h * hn) ** -0.5, h ** -0.5

        def column(out, init):
            # Under SP this all-gathers the sequence shard: the decoder's hidden for the
            # queries, and for cross-attention the encoder output for the keys/values.
            return mpu.ColumnParallelLinear(h, out, bias=False, gather_output=False,
                                            init_method=init,
                                            sequence_parallel=config.sequence_parallel,
                                            fp8=config.fp8)

        if cross:  # per-head rows [heads, (k, v), d_kv]: a contiguous split keeps heads whole
            self.query = column(inner, init_method_normal(std_q))
            self.key_value = column(2 * inner, PerHeadInit((std_kv, std_kv), hn))
        else:  # per-head rows [heads, (q, k, v), d_kv], as GPT-2's fused QKV
            self.query_key_value = column(3 * inner, PerHeadInit((std_q, std_kv, std_kv), hn))
        self.dense = mpu.RowParallelLinear(inner, h, bias=False, input_is_parallel=True,
                                           init_method=init_method_normal(inner ** -0.5),
                                           sequence_parallel=config.sequence_parallel,
                                           fp8=config.fp8)
        self.scale_mask_softmax = FusedScaleMaskSoftmax.for_dtype(
            config.compute_dtype, AttnMaskType.padding, config.masked_softmax_fusion,
            attention_mask_func, scale=None)
        # selective recompute; self-attention's relative bias needs a gradient
        self.recompute_core = recompute_core(config, mask_needs_grad=not cross)
        self.attention_dropout = nn.Dropout(config.attention_dropout)
        self.attention_backend = resolve_attention_backend(config.attention_backend)

    def _split_heads(self, mixed, parts):  # [s, b, np * parts * hn] -> parts x [s, b, np, hn]
        s, b = mixed.shape[:2]
        return mixed.view(s, b, self.heads_per_partition, parts * self.head_dim).split(
            self.head_dim, dim=-1)

    def project_key_value(self, encoder_output):
        """Cross-attention keys and values ``[sk, b, np, hn]`` (cached while decoding)."""
        return self._split_heads(self.key_value(encoder_output)[0], 2)

    def forward(self, hidden, mask, position_bias=None, encoder_output=None, kv_cache=None,
                layer=0):
        """``[sq, b, h]`` -> ``[sq, b, h]``.

        Args:
            hidden: normalised input (the queries; also keys/values for self-attention).
            mask: bool ``[b or 1, 1, sq, sk]``, True = masked, or None.
            position_bias: ``[1, np, sq, sk]`` added to the scores, or None (cross-attention).
            encoder_output: ``[sk, b, h]`` for cross-attention.
            kv_cache: a :class:`T5DecoderCache` while decoding.
            layer: this layer's index in the cache.
        """
        if self.cross:
            q = self._split_heads(self.query(hidden)[0], 1)[0]  # [sq, b, np, hn]
            if kv_cache is not None:
                k, v = kv_cache.cross(layer, lambda: self.project_key_value(encoder_output))
            else:
                k, v = self.project_key_value(encoder_output)
        else:
            q, k, v = self._split_heads(self.query_key_value(hidden)[0], 3)
            if kv_cache is not None:
                k, v = kv_cache.update(layer, k, v)  # [sk, b, np, hn] so far
        context = core_attention(self._attend, self.recompute_core and kv_cache is None,
                                 self.training, q, k, v, mask, position_bias)
        return self.dense(context)[0]

    def _attend(self, q, k, v, mask, position_bias):  # [s, b, np, hn] -> [sq, b, np * hn]
        if self.attention_backend == "sdpa":  # bias + mask: one additive float mask
            dropout_p = self.attention_dropout.p if self.training else 0.0
            return sdpa_attention(q, k, v, scale=1.0, dropout_p=dropout_p, mask=mask,
                                  bias=position_bias, per_rank_dropout=self.tp_size > 1)
        return bmm_attention(q, k, v, self.scale_mask_softmax, self.attention_dropout,
                             mask=mask, bias=position_bias, per_rank_dropout=self.tp_size > 1)


class T5MLP(nn.Module):
    """h -> d_ff (split across tp) -> ReLU, or gated GeLU -> h.

    Gated-GeLU fuses T5 v1.1's ``wi_0`` (gate) and ``wi_1`` into one weight whose rows are
    interleaved ``[d_ff, (gate, linear)]``, so one GEMM computes both and a contiguous
    tensor-parallel split keeps every gate next to its linear unit.

    Args:
        config: :class:`T5TransformerConfig` (``ff_type``, sizes, dropout).
    """

    def __init__(self, config):
        super().__init__()
        self.gated = config.ff_type == "gated-gelu"
        h, ff = config.hidden_size, config.ffn_hidden_size
        self.dense_h_to_ff = mpu.ColumnParallelLinear(
            h, (2 if self.gated else 1) * ff, bias=False, gather_output=False,
            init_method=init_method_normal(h ** -0.5), sequence_parallel=config.sequence_parallel,
            fp8=config.fp8)
        self.dense_ff_to_h = mpu.RowParallelLinear(
            ff, h, bias=False, input_is_parallel=True, init_method=init_method_normal(ff ** -0.5),
            sequence_parallel=config.sequence_parallel, fp8=config.fp8)
        self.dropout = nn.Dropout(config.hidden_dropout)
        self.tp_size = mpu.get_tensor_model_parallel_world_size()

    def forward(self, hidden):  # [s, b, h]
        intermediate, _ = self.dense_h_to_ff(hidden)  # [s, b, (2 x) ff/tp]
        if self.gated:
            pairs = intermediate.unflatten(-1, (-1, 2))  # [s, b, ff/tp, (gate, linear)]
            intermediate = F.gelu(pairs[..., 0], approximate="tanh") * pairs[..., 1]
        else:
            intermediate = F.relu(intermediate)
        # split activations: a per-rank stream at tp > 1
        intermediate = mpu.model_parallel_dropout(self.dropout, intermediate, self.tp_size > 1)
        return self.dense_ff_to_h(intermediate)[0]  # [s, b, h]


class T5EncoderLayer(nn.Module):
    """Self-attention and feed-forward, each pre-RMSNorm with a residual.

    Weights come from the seed ``(seed, "t5_encoder_layer", layer_number)``, so layer i is
    the same in T5Model and on any pipeline stage of T5ModelPipe.

    Args:
        config: :class:`T5TransformerConfig`.
        layer_number: 1-based position in the encoder.
    """

    def __init__(self, config, layer_number):
        super().__init__()
        self.layer_number = layer_number
        with init_rng(config.seed, "t5_encoder_layer", layer_number):
            self.input_layernorm = rms_norm(config)
            self.self_attention = T5Attention(config, cross=False)
            self.post_attention_layernorm = rms_norm(config)
            self.mlp = config.feed_forward(layer_number, layer_number)
        self.hidden_dropout = nn.Dropout(config.hidden_dropout)
        self.sequence_parallel = config.sequence_parallel

    def _dropout(self, x):
        return mpu.sequence_parallel_dropout(self.hidden_dropout, x, self.sequence_parallel)

    def forward(self, hidden, mask, position_bias):  # [s, b, h] (SP: [s/tp, b, h])
        attn = self.self_attention(self.input_layernorm(hidden), mask, position_bias)
        hidden = hidden + self._dropout(attn)
        return hidden + self._dropout(self.mlp(self.post_attention_layernorm(hidden)))


class T5DecoderLayer(nn.Module):
    """Causal self-attention, cross-attention to the encoder output, feed-forward.

    Args:
        config: :class:`T5TransformerConfig`.
        layer_number: 1-based position in the decoder (seed key and KV-cache slot).
    """

    def __init__(self, config, layer_number):
        super().__init__()
        self.layer_number = layer_number
        with init_rng(config.seed, "t5_decoder_layer", layer_number):
            self.input_layernorm = rms_norm(config)
            self.self_attention = T5Attention(config, cross=False)
            self.post_attention_layernorm = rms_norm(config)
            self.inter_attention = T5Attention(config, cross=True)
            self.post_inter_attention_layernorm = rms_norm(config)
            self.mlp = config.feed_forward(layer_number, config.num_layers + layer_number)
        self.hidden_dropout = nn.Dropout(config.hidden_dropout)
        self.sequence_parallel = config.sequence_parallel

    def _dropout(self, x):
        return mpu.sequence_parallel_dropout(self.hidden_dropout, x, self.sequence_parallel)

    def forward(self, hidden, mask, position_bias, encoder_output, cross_mask, kv_cache=None):
        """``[sd, b, h]`` -> ``[sd, b, h]`` given the encoder output ``[se, b, h]``."""
        # The cache slot is read only while decoding: a compiled layer guards on what it
        # reads, so reading layer_number would compile one graph per decoder layer (and
        # past dynamo's recompile limit of 8, run the rest eagerly).
        layer = 0 if kv_cache is None else self.layer_number - 1
        attn = self.self_attention(self.input_layernorm(hidden), mask, position_bias,
                                   kv_cache=kv_cache, layer=layer)
        hidden = hidden + self._dropout(attn)
        cross = self.inter_attention(self.post_attention_layernorm(hidden), cross_mask,
                                     encoder_output=encoder_output, kv_cache=kv_cache,
                                     layer=layer)
        hidden = hidden + self._dropout(cross)
        return hidden + self._dropout(self.mlp(self.post_inter_attention_layernorm(hidden)))


class T5Embedding(nn.Module):
    """The shared word embedding (vocab split across tp; no positions in T5), then dropout.

    Args:
        config: :class:`T5TransformerConfig`.
    """

    def __init__(self, config):
        super().__init__()
        with init_rng(config.seed, "t5_embedding"):
            self.word_embeddings = mpu.VocabParallelEmbedding(
                config.vocab_size, config.hidden_size, init_method=init_method_normal(1.0))
        self.dropout = nn.Dropout(config.hidden_dropout)
        self.true_vocab_size = config.true_vocab_size  # read by the tied pipeline head
        self.sequence_parallel = config.sequence_parallel

    def forward(self, input_ids):  # [b, s] -> [s, b, h] (SP: [s/tp, b, h])
        hidden = self.word_embeddings(input_ids.t())
        if self.sequence_parallel:
            hidden = mpu.scatter_to_sequence_parallel_region(hidden)
        return mpu.sequence_parallel_dropout(self.dropout, hidden, self.sequence_parallel)


def build_lm_head(config):
    """The untied output layer (T5 v1.1): ``[v/tp, h]`` split on the vocabulary."""
    with init_rng(config.seed, "t5_lm_head"):
        head = mpu.ColumnParallelLinear(config.hidden_size, config.vocab_size, bias=False,
                                        gather_output=False,
                                        init_method=init_method_normal(config.hidden_size ** -0.5))
    mpu.mark_padded_vocab_rows(head.weight)  # the checkpoint's sharding record says so
    return head


def t5_logits(hidden, weight, tied, parallel_output, true_vocab_size=None,
              sequence_parallel=False):
    """``[s, b, h]`` -> ``[s, b, v/tp]`` (or ``v``) logits.

    Args:
        hidden: decoder output (after the final norm and dropout).
        weight: ``[v/tp, h]``: the word embedding (tied) or the lm head.
        tied: scale the hidden state by d_model^-0.5 first (T5 v1.0 with tied embeddings).
        parallel_output: keep the vocabulary split (for the loss); False gathers it.
        true_vocab_size: padded ids (at or beyond it) get -inf logits; None keeps all.
        sequence_parallel: ``hidden`` is this rank's ``[s/tp, b, h]`` (gathered here).
    """
    if tied:
        hidden = hidden * hidden.shape[-1] ** -0.5
    return parallel_lm_logits(hidden, weight, parallel_output, true_vocab_size=true_vocab_size,
                              sequence_parallel=sequence_parallel)

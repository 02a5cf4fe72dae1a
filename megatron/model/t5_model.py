"""T5 (encoder-decoder) on tensor-parallel layers, with the architecture of Hugging Face's
``T5ForConditionalGeneration`` so its checkpoints convert one to one (docs/t5.md).

    losses = model(enc_ids, dec_ids, enc_mask, dec_mask, cross_mask, labels=labels)  # [b, sd]

Masks are bool, True = masked out (``[b, 1, sq, sk]``); the batch function builds them on
the device from which positions hold real tokens (:func:`t5_attention_masks`). The relative position bias is computed once per
stack (its table lives in the stack, as HF keeps it in the first layer) and shared by every
layer of the stack.
"""
import functools

from torch import nn

from .. import mpu
from .attention import attention_dtype, fold_mask, resolve_attention_backend
from .fused_softmax import causal_exclusion
from .kv_cache import KVCache
from .language_model import lm_loss
from .recompute import block_count, run_layers
from .t5_layers import (
    RelativePositionBias,
    T5DecoderLayer,
    T5Embedding,
    T5EncoderLayer,
    build_lm_head,
    rms_norm,
    sp_factor,
    t5_logits,
)
from .utils import init_rng


@functools.lru_cache(maxsize=8)
def _future(sd, device):
    """The decoder's causal exclusion ``[sd, sd]``, built once per length and device (read
    only: every mask is a new tensor combined from it)."""
    return causal_exclusion(sd, sd, device)


def t5_attention_masks(enc_real, dec_real):
    """The three attention masks of a T5 batch, built where its ids are (the device).

    A position attends only between real tokens, and the decoder only to earlier ones:
    Megatron's T5 masks, with True = masked out.

    Args:
        enc_real: ``[b, se]`` bool, True on real encoder tokens.
        dec_real: ``[b, sd]`` bool, True on real decoder tokens.

    Returns:
        ``enc_mask [b, 1, se, se]``, ``dec_mask [b, 1, sd, sd]`` (causal and padding),
        ``cross_mask [b, 1, sd, se]``.
    """
    enc_q, enc_k = enc_real[:, None, :, None], enc_real[:, None, None, :]
    dec_q, dec_k = dec_real[:, None, :, None], dec_real[:, None, None, :]
    future = _future(dec_real.shape[1], dec_real.device)  # [sd, sd]
    return ~(enc_q & enc_k), ~(dec_q & dec_k) | future, ~(dec_q & enc_k)


class T5DecoderCache(KVCache):
    """Decoder self-attention keys/values (growing) plus cross-attention keys/values.

    The cross-attention keys/values depend only on the encoder output, so each layer
    computes them at the first step and reuses them at every later step.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.cross_kv = {}

    def cross(self, layer, compute):
        """``(k, v)`` ``[se, b, np, hn]`` of ``layer``, computed on first use."""
        if layer not in self.cross_kv:
            self.cross_kv[layer] = compute()
        return self.cross_kv[layer]


class T5Stack(nn.Module):
    """``num_layers`` encoder (or decoder) layers, the shared relative bias, the final norm.

    Args:
        config: :class:`T5TransformerConfig`.
        decoder: causal self-attention + cross-attention layers instead of encoder layers.
    """

    def __init__(self, config, decoder):
        super().__init__()
        self.config, self.decoder = config, decoder
        name = "t5_decoder" if decoder else "t5_encoder"
        with init_rng(config.seed, name, "relative_bias"):
            self.relative_bias = RelativePositionBias(config, bidirectional=not decoder)
        layer = T5DecoderLayer if decoder else T5EncoderLayer
        self.layers = nn.ModuleList(layer(config, i + 1) for i in range(config.num_layers))
        self.final_layernorm = rms_norm(config)
        self.dropout = nn.Dropout(config.hidden_dropout)
        # SDPA takes the bias and the padding mask as one additive mask: fold them once
        # for every layer (Megatron's unfused softmax keeps them apart)
        self.fold_masks = resolve_attention_backend(config.attention_backend) == "sdpa"

    def _run(self, start, end):
        def run(hidden, mask, bias, *cross):
            for layer in self.layers[start:end]:
                hidden = layer(hidden, mask, bias, *cross)
            return hidden

        return run

    def forward(self, hidden, mask, encoder_output=None, cross_mask=None, kv_cache=None):
        """``[s, b, h]`` -> ``[s, b, h]`` (normalised; dropout applied, as in T5).

        Args:
            hidden: embedded input.
            mask: self-attention mask (bool, True = masked) or None.
            encoder_output, cross_mask: decoder only: ``[se, b, h]`` and ``[b, 1, sd, se]``.
            kv_cache: decoder only, while generating: a :class:`T5DecoderCache`.
        """
        sq = hidden.shape[0] * sp_factor(self.config)  # full length under SP
        offset = kv_cache.offset if kv_cache is not None else 0
        bias = self.relative_bias(sq, offset + sq, offset)  # [1, np, sq, sk], shared by layers
        if self.fold_masks and kv_cache is None:  # SDPA: one additive mask per stack
            dtype = attention_dtype(hidden)
            mask, bias = None, fold_mask(mask, bias, dtype)  # [b, np, sq, sk]
            cross_mask = fold_mask(cross_mask, None, dtype)  # [b, 1, sd, se] (decoder)
        cross = (encoder_output, cross_mask) if self.decoder else ()
        if self.config.checkpoint_activations and self.training and kv_cache is None:
            step = self.config.checkpoint_num_layers
            for start in range(0, len(self.layers), step):
                hidden = mpu.checkpoint(self._run(start, start + step), hidden, mask, bias,
                                        *cross)
        elif kv_cache is not None:
            for layer in self.layers:
                hidden = layer(hidden, mask, bias, *cross, kv_cache=kv_cache)
        else:  # block recompute: the stack's first layers keep only their input
            hidden = run_layers(self.layers, block_count(self.config), self.training,
                                hidden, mask, bias, *cross)
        return mpu.sequence_parallel_dropout(self.dropout, self.final_layernorm(hidden),
                                             self.config.sequence_parallel)


class T5Model(nn.Module):
    """T5: shared embedding, encoder, decoder, tied (scaled) or untied output layer.

    Args:
        config: :class:`T5TransformerConfig`.
        parallel_output: return vocab-split logits when no labels are given (False
            gathers them, for generation).
    """

    def __init__(self, config, parallel_output=True):
        super().__init__()
        self.config, self.parallel_output = config, parallel_output
        self.embedding = T5Embedding(config)
        self.encoder = T5Stack(config, decoder=False)
        self.decoder = T5Stack(config, decoder=True)
        self.lm_head = None if config.tie_embeddings else build_lm_head(config)

    def output_weight(self):
        """``[v/tp, h]``: the word embedding when tied, else the lm head."""
        if self.lm_head is None:
            return self.embedding.word_embeddings.weight
        return self.lm_head.weight

    def encode(self, enc_ids, enc_mask):
        """``[b, se]`` ids -> encoder output ``[se, b, h]``."""
        return self.encoder(self.embedding(enc_ids), enc_mask)

    def decode(self, dec_ids, dec_mask, encoder_output, cross_mask, kv_cache=None,
               parallel_output=None):
        """Decoder logits ``[sd, b, v/tp]`` (or ``v``) for ``dec_ids`` ``[b, sd]``."""
        hidden = self.decoder(self.embedding(dec_ids), dec_mask, encoder_output, cross_mask,
                              kv_cache)
        if kv_cache is not None:
            kv_cache.advance(dec_ids.shape[1])
        parallel = self.parallel_output if parallel_output is None else parallel_output
        return t5_logits(hidden, self.output_weight(), self.config.tie_embeddings, parallel,
                         self.config.true_vocab_size, self.config.sequence_parallel)

    def forward(self, enc_ids, dec_ids, enc_mask, dec_mask, cross_mask, labels=None):
        """Per-token losses ``[b, sd]`` with labels, else logits ``[b, sd, v/tp]`` (or ``v``).

        Args:
            enc_ids: ``[b, se]`` encoder input ids.
            dec_ids: ``[b, sd]`` decoder input ids (pad, then the labels shifted right).
            enc_mask: ``[b, 1, se, se]`` bool, True = masked.
            dec_mask: ``[b, 1, sd, sd]`` bool (causal and padding).
            cross_mask: ``[b, 1, sd, se]`` bool.
            labels: ``[b, sd]`` target ids, or None for logits.
        """
        # Both embeddings first, as the pipeline's first stage does (same dropout draws).
        enc_hidden, dec_hidden = self.embedding(enc_ids), self.embedding(dec_ids)
        encoder_output = self.encoder(enc_hidden, enc_mask)  # [se, b, h]
        hidden = self.decoder(dec_hidden, dec_mask, encoder_output, cross_mask)  # [sd, b, h]
        parallel = self.parallel_output or labels is not None
        logits = t5_logits(hidden, self.output_weight(), self.config.tie_embeddings, parallel,
                           self.config.true_vocab_size, self.config.sequence_parallel)
        if labels is None:
            return logits.transpose(0, 1)
        return lm_loss(logits, labels)


def t5_flops_per_step(config, enc_len, dec_len, global_batch):
    """Matmul FLOPs of one training step (forward + backward = 3 x forward, no recompute).

    Args:
        config: :class:`T5TransformerConfig`.
        enc_len, dec_len: encoder / decoder tokens per sample.
        global_batch: samples per step.
    """
    h, inner, v = config.hidden_size, config.inner_size, config.vocab_size
    per = 3 if config.ff_type == "gated-gelu" else 2  # in + out matrices
    ff = config.ffn_hidden_size * per
    moe = config.moe
    if moe is not None:  # the active parameters: router, top-k experts, shared experts
        active = moe.num_experts / per + moe.topk * moe.ffn_hidden_size + \
            (moe.shared_expert_intermediate_size or 0)
        share = sum(config.moe_layers) / config.num_layers
        ff = (1 - share) * ff + share * active * per

    def attention(sq, sk, fused_qkv):  # projections, scores and context, output
        projections = sq * h * inner * (3 if fused_qkv else 1) + (0 if fused_qkv else
                                                                  2 * sk * h * inner)
        return projections + 2 * sq * sk * inner + sq * inner * h

    encoder = attention(enc_len, enc_len, True) + enc_len * h * ff
    decoder = attention(dec_len, dec_len, True) + attention(dec_len, enc_len, False) + \
        dec_len * h * ff
    macs = config.num_layers * (encoder + decoder) + dec_len * h * v
    return 3 * 2 * macs * global_batch

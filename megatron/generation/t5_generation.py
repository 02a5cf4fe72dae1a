"""Greedy decoding from T5Model: the encoder runs once, the decoder reuses a KV cache.

Each step feeds only the newest decoder token: the decoder's self-attention keys/values
grow in a :class:`~megatron.model.t5_model.T5DecoderCache`, and each layer's cross-attention
keys/values are computed from the encoder output at the first step and reused. The relative
position bias of a step is computed for its query position (``offset``) against every
cached key. ``use_cache=False`` recomputes the whole prefix each step (for checking).

Decoding starts from pad (T5's decoder start), takes the most likely token among the real
vocabulary (padded rows are never produced), and a sequence that produced eos is padded
from then on, as Hugging Face's ``generate`` does. Tensor parallelism: the model gathers
its logits, so every tp rank picks the same tokens.
"""
import torch

from .. import mpu
from ..common.errors import ConfigError
from ..model.fused_softmax import causal_exclusion
from ..model.t5_model import T5DecoderCache


def _new_cache(model, batch, max_len, device, dtype):
    config = model.config
    heads = config.num_attention_heads // mpu.get_tensor_model_parallel_world_size()
    return T5DecoderCache(config.num_layers, max_len, batch, heads, config.kv_channels, dtype,
                          device)


def _step_logits(model, tokens, encoder_output, enc_real, cache):
    """Next-token logits ``[b, v]`` for the last position of ``tokens`` ``[b, t]``."""
    b, se = enc_real.shape
    inputs = tokens[:, -1:] if cache is not None else tokens
    sq = inputs.shape[1]
    dec_mask = None if cache is not None else \
        causal_exclusion(sq, sq, tokens.device)[None, None]  # [1, 1, t, t] True = future
    cross_mask = (~enc_real)[:, None, None, :].expand(b, 1, sq, se)  # padded encoder keys
    logits = model.decode(inputs, dec_mask, encoder_output, cross_mask, kv_cache=cache,
                          parallel_output=False)  # [sq, b, v]
    return logits[-1]


@torch.no_grad()
def greedy_generate(model, enc_ids, enc_real, max_new_tokens, eos_id, pad_id, vocab_size,
                    use_cache=True):
    """Greedy decoder ids ``[b, 1 + n]`` (pad first, n <= max_new_tokens).

    Args:
        model: a T5Model in eval mode.
        enc_ids: ``[b, se]`` encoder ids (padded).
        enc_real: ``[b, se]`` bool, True on real encoder tokens.
        max_new_tokens: tokens to generate at most (stops early when every row hit eos).
        eos_id, pad_id: the tokenizer's eos and pad (= decoder start) ids.
        vocab_size: real vocabulary rows; padded ids are never chosen.
        use_cache: decode incrementally (True) or recompute the prefix each step.
    """
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    b, se = enc_ids.shape
    enc_mask = ~(enc_real[:, None, :, None] & enc_real[:, None, None, :])  # [b, 1, se, se]
    encoder_output = model.encode(enc_ids, enc_mask)  # [se, b, h]
    cache = _new_cache(model, b, max_new_tokens, enc_ids.device, encoder_output.dtype) \
        if use_cache else None
    tokens = torch.full((b, 1), pad_id, dtype=torch.long, device=enc_ids.device)
    done = torch.zeros(b, dtype=torch.bool, device=enc_ids.device)
    for _ in range(max_new_tokens):
        logits = _step_logits(model, tokens, encoder_output, enc_real, cache)
        chosen = logits[:, :vocab_size].argmax(dim=-1).masked_fill(done, pad_id)  # [b]
        tokens = torch.cat([tokens, chosen[:, None]], dim=1)
        done |= chosen == eos_id
        if bool(done.all()):
            break
    return tokens


def fill_spans(tokenizer, text, generated):
    """The input text with each sentinel replaced by the span the decoder gave it.

    Args:
        tokenizer: a SentencePieceTokenizer (sentinel ids, detokenize).
        text: the input with ``<extra_id_i>`` markers.
        generated: decoder ids (pad first), ``<extra_id_0> span0 <extra_id_1> span1 ... eos``.

    Returns:
        ``(filled text, {sentinel index: span text})``.
    """
    sentinel_index = {sid: i for i, sid in enumerate(tokenizer.sentinel_ids)}
    spans, current = {}, None
    for token in [int(t) for t in generated[1:]]:
        if token in (tokenizer.eod, tokenizer.pad):
            break
        if token in sentinel_index:
            current = sentinel_index[token]
            spans[current] = []
        elif current is not None:
            spans[current].append(token)
    texts = {i: tokenizer.detokenize(ids).strip() for i, ids in spans.items()}
    filled = text
    for i, span in texts.items():
        filled = filled.replace(f"<extra_id_{i}>", f"[{span}]", 1)
    return filled, texts

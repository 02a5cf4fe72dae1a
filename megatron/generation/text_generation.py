"""Autoregressive sampling from GPT2Model: greedy, top-k, top-p, temperature, with a KV cache.

Prompts of different lengths decode together (Megatron's scheme): the batch starts at the
shortest prompt's end, and at each position a sequence whose prompt is not over yet keeps
its prompt token instead of the sample. With the KV cache each step feeds only the newest
token (the first step feeds every position up to the shortest prompt's end).

Tensor parallelism: the model is built with ``parallel_output=False``, so every tp rank holds
the full logits; each rank samples with a generator seeded identically, and tp rank 0's
tokens are then broadcast so ranks agree even if their logits differ in the last bit.
Padded vocabulary rows are cut off before sampling, so a padded id is never produced.
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import mpu
from ..common.errors import ConfigError
from ..model.kv_cache import KVCache
from ..model.utils import causal_attention_mask


@dataclass
class SamplingConfig:
    """How to pick each token.

    Attributes:
        greedy: take the most likely token (the other settings are ignored).
        top_k: keep the k most likely tokens (0: all).
        top_p: keep the smallest set whose probability reaches p (0 or 1: all).
        temperature: divide the logits by it before top-k / top-p (> 0).
        seed: the sampling generator's seed (the same on every tp rank).
    """

    greedy: bool = False
    top_k: int = 0
    top_p: float = 0.0
    temperature: float = 1.0
    seed: int = 1234

    def validate(self):
        """Raise ConfigError (a ValueError) on settings that cannot be sampled with."""
        if self.temperature <= 0:
            raise ConfigError(f"temperature must be > 0, got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 <= self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in [0, 1], got {self.top_p}")


def filter_top_k(logits, k):
    """``[b, v]`` logits with all but the k largest per row set to -inf (ties kept)."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # [b, 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def filter_top_p(logits, p):
    """``[b, v]`` logits outside the nucleus (smallest set with probability >= p) -> -inf."""
    if p <= 0.0 or p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # [b, v]
    probs = torch.softmax(sorted_logits, dim=-1)
    # Drop a token when the tokens before it already reach p; the top token always stays.
    drop_sorted = (probs.cumsum(dim=-1) - probs) >= p
    drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample(logits, config, generator):
    """One token id per row of ``[b, v]`` logits (real vocabulary only) -> ``[b]``.

    Args:
        logits: next-token logits, float.
        config: :class:`SamplingConfig`.
        generator: ``torch.Generator`` on the logits' device.
    """
    if config.greedy:
        return logits.argmax(dim=-1)
    logits = logits.float() / config.temperature
    logits = filter_top_p(filter_top_k(logits, config.top_k), config.top_p)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _agree_across_tp(tokens):
    """tp rank 0's tokens on every tp rank (a no-op without tensor parallelism)."""
    if not dist.is_initialized() or mpu.get_tensor_model_parallel_world_size() == 1:
        return tokens
    dist.broadcast(tokens, mpu.get_tensor_model_parallel_src_rank(),
                   group=mpu.get_tensor_model_parallel_group())
    return tokens


def _new_cache(model, max_len, batch, dtype, device):
    config = model.config
    heads = config.num_attention_heads // mpu.get_tensor_model_parallel_world_size()
    return KVCache(config.num_layers, max_len, batch, heads, config.kv_channels, dtype, device)


def _next_logits(model, tokens, start, end, mask, cache):
    """Logits for position ``end`` (``[b, v]``), feeding ``[start, end)`` (all, no cache)."""
    if cache is None:
        start = 0
    ids = tokens[:, start:end]  # [b, s]
    positions = torch.arange(start, end, device=tokens.device).unsqueeze(0).expand_as(ids)
    logits = model(ids, positions, mask if cache is not None else mask[..., :end, :end],
                   kv_cache=cache)  # [b, s, v_pad]
    return logits[:, -1, :]


@torch.no_grad()
def generate(model, prompts, max_new_tokens, vocab_size, config=None, eod_id=None,
             use_cache=True, max_length=None):
    """Continue each prompt by up to ``max_new_tokens`` tokens.

    Args:
        model: GPT2Model with ``parallel_output=False`` (eval mode).
        prompts: list of non-empty token-id lists.
        max_new_tokens: tokens to generate per prompt at most.
        vocab_size: real vocabulary size; ids >= it (padding) are never sampled.
        config: :class:`SamplingConfig` (default: greedy).
        eod_id: stop a sequence once it generates this id (None: never stop early).
        use_cache: decode with a KV cache (False recomputes the whole prefix every step).
        max_length: longest total sequence (default: the model's position embeddings).

    Returns:
        One list of generated ids per prompt (without the prompt, without the eod).
    """
    config = config or SamplingConfig(greedy=True)
    config.validate()
    device = model.word_embeddings_weight().device
    max_length = max_length or model.embedding.position_embeddings.num_embeddings
    lengths = torch.tensor([len(p) for p in prompts], device=device)  # [b]
    if not prompts or int(lengths.min()) < 1:
        raise ConfigError("every prompt needs at least one token")
    if int(lengths.max()) >= max_length:
        raise ConfigError(f"a prompt of {int(lengths.max())} tokens leaves no room to generate: "
                         f"the model holds {max_length} positions")
    total = min(int(lengths.max()) + max_new_tokens, max_length)
    limit = torch.clamp(lengths + max_new_tokens, max=max_length)  # [b] end of each output
    tokens = torch.zeros(len(prompts), total, dtype=torch.long, device=device)  # [b, total]
    for i, prompt in enumerate(prompts):
        tokens[i, :len(prompt)] = torch.tensor(prompt, dtype=torch.long)
    in_prompt = torch.arange(total, device=device)[None] < lengths[:, None]  # [b, total]
    generator = torch.Generator(device=device).manual_seed(config.seed)
    mask = causal_attention_mask(total, device)
    dtype = model.word_embeddings_weight().dtype
    cache = _new_cache(model, total, len(prompts), dtype, device) if use_cache else None
    done = limit <= lengths  # [b]
    start = 0
    for pos in range(int(lengths.min()), total):
        logits = _next_logits(model, tokens, start, pos, mask, cache)[:, :vocab_size]
        new = _agree_across_tp(sample(logits, config, generator))  # [b]
        new = torch.where(done, torch.zeros_like(new), new)
        tokens[:, pos] = torch.where(in_prompt[:, pos], tokens[:, pos], new)
        generated = ~in_prompt[:, pos] & ~done
        if eod_id is not None:
            done |= generated & (new == eod_id)
        done |= pos + 1 >= limit
        start = pos
        if bool(done.all()):
            break
    return _outputs(tokens, lengths, limit, eod_id)


def _outputs(tokens, lengths, limit, eod_id):
    outputs = []
    for row, begin, end in zip(tokens.tolist(), lengths.tolist(), limit.tolist()):
        out = row[begin:end]
        if eod_id is not None and eod_id in out:
            out = out[:out.index(eod_id)]
        outputs.append(out)
    return outputs


def generate_text(model, tokenizer, texts, max_new_tokens, config=None, use_cache=True,
                  stop_at_eod=True):
    """Tokenize ``texts``, :func:`generate`, detokenize: one continuation string per text.

    Args:
        model: as in :func:`generate`.
        tokenizer: has ``tokenize``, ``detokenize``, ``vocab_size`` and ``eod``.
        texts: prompt strings (an empty prompt starts from the eod token).
        max_new_tokens, config, use_cache: as in :func:`generate`.
        stop_at_eod: end a continuation at the eod token.
    """
    prompts = [tokenizer.tokenize(t) or [tokenizer.eod] for t in texts]
    ids = generate(model, prompts, max_new_tokens, tokenizer.vocab_size, config,
                   tokenizer.eod if stop_at_eod else None, use_cache)
    return [tokenizer.detokenize(out) for out in ids]


"""T5 span-corruption dataset (Raffel et al. 2020, "Exploring the Limits of Transfer Learning").

Each sample takes a raw chunk of tokens from the GPT-2 sample machinery (documents packed
and shuffled the same way), picks noise spans (``noise_density`` of the tokens, mean span
length ``mean_span_length``), and follows Hugging Face T5's conventions:

* ``text_enc`` [enc]: the chunk with each noise span replaced by one sentinel
  (``<extra_id_0>``, ``<extra_id_1>``, ...), then eos, then pad.
* ``labels`` [dec]: each sentinel followed by the span it hides, then eos, then pad.
* ``text_dec`` [dec]: ``[pad] + labels[:-1]`` (pad is T5's decoder start token).
* ``loss_mask`` [dec]: 1 on real label positions (= real decoder positions).
* ``enc_real`` [enc]: 1 on real encoder positions.

All int64. The [s, s] attention masks are not built here: the batch function makes them on
the device from ``enc_real`` and ``loss_mask``
(:func:`megatron.model.t5_model.t5_attention_masks`), so the host never builds, stacks or
copies ``b x se x se`` tensors. The chunk length is the largest whose corrupted encoder input (plus eos) fits
``enc_seq_length`` (the T5 paper's ``random_spans_helper``), so nothing is truncated.
"""
import logging

import numpy as np

from megatron.data.dataset_utils import build_blended_splits
from megatron.data.gpt2_dataset import GPT2Dataset
from megatron.common.errors import ConfigError

logger = logging.getLogger(__name__)


def corrupted_lengths(raw_length, noise_density, mean_span_length):
    """(num_noise, num_spans, encoder length, decoder length) for a raw chunk; both lengths
    include eos. Rounding follows T5's ``random_spans_noise_mask``."""
    num_noise = int(np.round(raw_length * noise_density))
    num_noise = min(max(num_noise, 1), raw_length - 1)
    num_spans = max(int(np.round(num_noise / mean_span_length)), 1)
    enc = raw_length - num_noise + num_spans + 1
    dec = num_noise + num_spans + 1
    return num_noise, num_spans, enc, dec


def raw_length_for(enc_seq_length, noise_density, mean_span_length):
    """Largest raw chunk whose corrupted input plus eos fits ``enc_seq_length``."""
    if not 0 < noise_density < 1 or mean_span_length < 1:
        raise ConfigError(f"noise density {noise_density} must be in (0, 1) and mean span "
                          f"length {mean_span_length} >= 1")
    raw = 2
    if corrupted_lengths(raw, noise_density, mean_span_length)[2] > enc_seq_length:
        raise ConfigError(f"--encoder-seq-length {enc_seq_length} is too short for span "
                          f"corruption; use at least 4")
    while corrupted_lengths(raw + 1, noise_density, mean_span_length)[2] <= enc_seq_length:
        raw += 1
    return raw


def random_segmentation(num_items, num_segments, rng):
    """Lengths [num_segments] (each >= 1) of a uniformly random split of ``num_items``."""
    cuts = np.sort(rng.choice(num_items - 1, num_segments - 1, replace=False) + 1)
    return np.diff(np.concatenate(([0], cuts, [num_items])))


def noise_mask(length, num_noise, num_spans, rng):
    """bool [length]: ``num_spans`` noise spans, each after a non-noise span (T5's layout)."""
    noise = random_segmentation(num_noise, num_spans, rng)
    keep = random_segmentation(length - num_noise, num_spans, rng)
    span_lengths = np.stack([keep, noise], axis=1).reshape(-1)  # keep, noise, keep, noise...
    span_id = np.repeat(np.arange(2 * num_spans), span_lengths)
    return span_id % 2 == 1


def _span_to_sentinel(tokens, mask, sentinels):
    """Tokens with each run of ``mask`` replaced by the next sentinel."""
    starts = mask & ~np.concatenate(([False], mask[:-1]))
    out = np.where(starts, sentinels[np.cumsum(starts) - 1], tokens)
    return out[~mask | starts]


def _pad(ids, length, pad):
    out = np.full(length, pad, dtype=np.int64)
    out[:len(ids)] = ids
    return out


def make_t5_sample(tokens, plan, rng):
    """Span-corrupt one raw chunk into the T5 sample dict (see the module docstring).

    Args:
        tokens: int64 [raw_length].
        plan: dict with enc/dec lengths, num_noise, num_spans, pad, eos, sentinels.
        rng: numpy Generator for this sample.
    """
    mask = noise_mask(len(tokens), plan["num_noise"], plan["num_spans"], rng)
    sentinels = plan["sentinels"]
    enc = np.append(_span_to_sentinel(tokens, mask, sentinels), plan["eos"])
    labels = np.append(_span_to_sentinel(tokens, ~mask, sentinels), plan["eos"])
    enc_len, dec_len, pad = plan["enc"], plan["dec"], plan["pad"]
    dec_in = np.concatenate(([pad], labels[:-1]))
    enc_real = np.arange(enc_len) < len(enc)  # [enc]
    dec_real = np.arange(dec_len) < len(labels)  # [dec]
    return {
        "text_enc": _pad(enc, enc_len, pad),
        "text_dec": _pad(dec_in, dec_len, pad),
        "labels": _pad(labels, dec_len, pad),
        "loss_mask": dec_real.astype(np.int64),
        "enc_real": enc_real.astype(np.int64),
    }


def make_plan(enc_seq_length, dec_seq_length, tokenizer, noise_density, mean_span_length):
    """Lengths and special ids for span corruption; ConfigError when the settings cannot work.

    Args:
        enc_seq_length / dec_seq_length: encoder / decoder lengths.
        tokenizer: needs ``sentinel_ids``, ``pad`` and ``eod``.
        noise_density / mean_span_length: T5's corruption settings.
    """
    sentinels = list(getattr(tokenizer, "sentinel_ids", []) or [])
    if not sentinels:
        raise ConfigError(f"T5 needs sentinel tokens, but the {getattr(tokenizer, 'name', '')} "
                          f"tokenizer has none; use --tokenizer-type SentencePieceTokenizer with "
                          f"--vocab-extra-ids 100")
    raw = raw_length_for(enc_seq_length, noise_density, mean_span_length)
    num_noise, num_spans, enc, dec = corrupted_lengths(raw, noise_density, mean_span_length)
    if dec > dec_seq_length:
        raise ConfigError(f"--decoder-seq-length {dec_seq_length} is too short: encoder length "
                          f"{enc_seq_length} with noise density {noise_density} and mean span "
                          f"{mean_span_length} gives {dec} label tokens; raise it to {dec}")
    if num_spans > len(sentinels):
        raise ConfigError(f"{num_spans} noise spans per sample need {num_spans} sentinels, the "
                          f"tokenizer has {len(sentinels)}; raise --vocab-extra-ids to "
                          f"{num_spans}")
    return {"raw": raw, "num_noise": num_noise, "num_spans": num_spans, "enc": enc_seq_length,
            "dec": dec_seq_length, "pad": int(tokenizer.pad), "eos": int(tokenizer.eod),
            "sentinels": np.asarray(sentinels, dtype=np.int64)}


class T5Dataset:
    """Span-corrupted samples over packed raw chunks of one split.

    Args:
        chunks: a GPT2Dataset whose items have ``plan["raw"]`` tokens.
        plan: from :func:`make_plan`.
        seed: per-sample randomness is ``default_rng([seed, idx])``: deterministic, and
            independent of the order samples are read in.
    """

    def __init__(self, chunks, plan, seed):
        self.chunks, self.plan, self.seed = chunks, plan, seed

    def __len__(self):
        return len(self.chunks)

    def __getitem__(self, idx):
        tokens = self.chunks[idx]["text"]
        rng = np.random.default_rng([self.seed, int(idx)])
        return make_t5_sample(tokens, self.plan, rng)


def build_train_valid_test_datasets(data_prefix, splits_string, train_valid_test_num_samples,
                                    enc_seq_length, dec_seq_length, seed, tokenizer,
                                    noise_density=0.15, mean_span_length=3.0):
    """Train/valid/test T5 datasets (None for an empty split), blended when asked.

    Args:
        data_prefix: ``["prefix"]`` or weight/prefix pairs.
        splits_string: ``--split``.
        train_valid_test_num_samples: samples per split [3].
        enc_seq_length / dec_seq_length: encoder / decoder lengths.
        seed: shuffling and corruption seed.
        tokenizer: provides sentinels, pad and eos.
        noise_density / mean_span_length: T5 defaults 0.15 and 3.
    """
    plan = make_plan(enc_seq_length, dec_seq_length, tokenizer, noise_density,
                     mean_span_length)
    logger.info("T5 span corruption: %d raw tokens -> %d encoder + %d label tokens (%d spans)",
                plan["raw"], plan["raw"] - plan["num_noise"] + plan["num_spans"] + 1,
                plan["num_noise"] + plan["num_spans"] + 1, plan["num_spans"])

    def build(prefix, indexed, name, documents, num_samples):
        chunks = GPT2Dataset(name, prefix, documents, indexed, num_samples, plan["raw"] - 1, seed)
        return T5Dataset(chunks, plan, seed)

    return build_blended_splits(data_prefix, splits_string, train_valid_test_num_samples, build)

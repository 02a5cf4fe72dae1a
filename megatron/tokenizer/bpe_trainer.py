"""Train a GPT-2 format byte-level BPE (``vocab.json`` + ``merges.txt``) from raw text.

Pre-tokenize with GPT-2's regex, count word types, then repeatedly merge the most frequent
adjacent symbol pair. Pair counts are kept incrementally: a merge only revisits the words
that contain the merged pair (an inverted index), and a heap with lazy invalidation finds the
next best pair, so each merge costs time proportional to the words it touches.
Ties go to the pair with the smaller symbol ids, so training is deterministic.
"""
import collections
import heapq
import json
import os

import regex

from megatron.resilience.locks import remove_stale_tmps, tmp_name
from megatron.tokenizer.gpt2_bpe import BYTE_ENCODER, EOD_TOKEN, PRETOKENIZE_PATTERN


def count_words(texts):
    """Counter of GPT-2 pre-tokens over an iterable of strings."""
    pattern = regex.compile(PRETOKENIZE_PATTERN)
    counts = collections.Counter()
    for text in texts:
        counts.update(pattern.findall(text))
    return counts


def _merge_word(word, a, b, new):
    out, i, n = [], 0, len(word)
    while i < n:
        if i < n - 1 and word[i] == a and word[i + 1] == b:
            out.append(new)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


class _PairStats:
    """Pair counts over all words, an inverted index pair -> words, and a lazy max-heap."""

    def __init__(self, words, freqs):
        self.counts = collections.defaultdict(int)
        self.where = collections.defaultdict(set)
        for wi, (word, freq) in enumerate(zip(words, freqs)):
            for pair in zip(word, word[1:]):
                self.counts[pair] += freq
                self.where[pair].add(wi)
        self.heap = [(-c, p) for p, c in self.counts.items()]
        heapq.heapify(self.heap)

    def pop_best(self, min_frequency):
        """The most frequent pair with at least ``min_frequency`` uses, or None."""
        while self.heap:
            neg, pair = heapq.heappop(self.heap)
            current = self.counts.get(pair, 0)
            if -neg != current:  # stale entry: re-queue with the true count
                if current > 0:
                    heapq.heappush(self.heap, (-current, pair))
                continue
            return pair if current >= min_frequency else None
        return None

    def apply(self, words, freqs, pair, new):
        """Merge ``pair`` into symbol ``new`` in every word that has it; update counts."""
        a, b = pair
        delta = collections.defaultdict(int)
        for wi in self.where.pop(pair, ()):
            word = words[wi]
            if len(word) < 2:
                continue
            merged = _merge_word(word, a, b, new)
            if len(merged) == len(word):
                continue  # stale index entry: the pair was merged away earlier
            freq = freqs[wi]
            for p in zip(word, word[1:]):
                delta[p] -= freq
            for p in zip(merged, merged[1:]):
                delta[p] += freq
                self.where[p].add(wi)
            words[wi] = merged
        for p, d in delta.items():
            if d:
                self.counts[p] += d
                if d > 0:
                    heapq.heappush(self.heap, (-self.counts[p], p))
        self.counts.pop(pair, None)


def train_bpe(texts, vocab_size, min_frequency=2, on_merge=None):
    """Learn merges until the vocab (256 bytes + merges + ``<|endoftext|>``) has ``vocab_size``.

    Args:
        texts: iterable of documents (str).
        vocab_size: target size including the 256 byte tokens and ``<|endoftext|>``.
        min_frequency: stop early when the best pair occurs fewer times than this.
        on_merge: optional ``f()`` called after each merge (progress reporting).

    Returns:
        (vocab {token: id}, merges [(a, b), ...]) with tokens in GPT-2's byte characters.
    """
    if vocab_size < 257:
        raise ValueError(f"vocab_size {vocab_size} is below the 257 a byte-level BPE needs")
    counts = count_words(texts)
    symbols = [BYTE_ENCODER[b] for b in range(256)]
    symbols.sort(key=list(BYTE_ENCODER.values()).index)  # GPT-2's base order
    token_id = {s: i for i, s in enumerate(symbols)}
    byte_id = [token_id[BYTE_ENCODER[b]] for b in range(256)]
    words = [[byte_id[b] for b in w.encode("utf-8")] for w in counts]
    freqs = list(counts.values())
    stats = _PairStats(words, freqs)
    merges = []
    while len(symbols) < vocab_size - 1:
        pair = stats.pop_best(min_frequency)
        if pair is None:
            break
        text = symbols[pair[0]] + symbols[pair[1]]
        new = token_id.get(text)
        if new is None:  # two different pairs can spell the same token: reuse its id
            new = token_id[text] = len(symbols)
            symbols.append(text)
        merges.append((symbols[pair[0]], symbols[pair[1]]))
        stats.apply(words, freqs, pair, new)
        if on_merge is not None:
            on_merge()
    vocab = dict(token_id)
    vocab[EOD_TOKEN] = len(vocab)
    return vocab, merges


def save_bpe(vocab, merges, output_dir):
    """Write ``vocab.json`` and ``merges.txt`` (GPT-2's format) into ``output_dir``."""
    os.makedirs(output_dir, exist_ok=True)
    vocab_path = os.path.join(output_dir, "vocab.json")
    merges_path = os.path.join(output_dir, "merges.txt")
    for path, write in ((vocab_path, lambda f: json.dump(vocab, f, ensure_ascii=False)),
                        (merges_path, lambda f: f.write(
                            "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges)))):
        remove_stale_tmps(path)
        tmp = tmp_name(path)
        with open(tmp, "w", encoding="utf-8") as f:
            write(f)
        os.replace(tmp, path)
    return vocab_path, merges_path

"""GPT-2 byte-level BPE from ``vocab.json`` + ``merges.txt``.

Gives the same ids as Hugging Face's ``GPT2TokenizerFast`` on the same two files (tested):
GPT-2's pre-tokenization regex, bytes mapped to printable characters, merges applied by
rank, and ``<|endoftext|>`` in the text read as the end-of-document token as HF does.

Speed comes from a per-word cache: after warm-up nearly every pre-token is a dict hit, and
the hot path (regex split, cache lookups, flattening) runs inside C code.
"""
import itertools
import json
import os

import regex

from megatron.common.errors import DataError, not_text

PRETOKENIZE_PATTERN = (r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+"""
                       r"""|\s+(?!\S)|\s+""")
EOD_TOKEN = "<|endoftext|>"
_CACHE_LIMIT = 1 << 20  # word types kept; a Zipfian corpus rarely gets near it


def bytes_to_unicode():
    """GPT-2's reversible map byte -> printable unicode char (so merges never see spaces).

    Printable Latin-1 bytes map to themselves; the other 68 bytes go to 256, 257, ...
    Returns a dict {byte: char} in GPT-2's order (which is also the base-vocab order).
    """
    keep = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
            + list(range(ord("®"), ord("ÿ") + 1)))
    mapping, extra = {}, 0
    for b in keep:
        mapping[b] = chr(b)
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


BYTE_ENCODER = bytes_to_unicode()
# str.translate table: a latin-1 decoded byte string -> GPT-2's byte characters.
BYTE_TRANSLATION = {b: c for b, c in BYTE_ENCODER.items()}


def load_vocab(vocab_file):
    if not os.path.isfile(vocab_file):
        raise DataError(f"vocab file {vocab_file} not found; pass --vocab-file with a GPT-2 "
                        f"vocab.json (tools/train_tokenizer.py --type gpt2 makes one)")
    try:
        with open(vocab_file, encoding="utf-8") as f:
            vocab = json.load(f)
    except (ValueError, UnicodeDecodeError) as exc:
        raise DataError(f"{vocab_file} is not a JSON vocab ({exc}); --vocab-file must be a "
                        f"GPT-2 vocab.json") from None
    if not isinstance(vocab, dict) or not all(isinstance(v, int) for v in vocab.values()):
        raise DataError(f"{vocab_file} must map token strings to integer ids (GPT-2 vocab.json)")
    return vocab


def load_merges(merge_file, vocab, vocab_file):
    """Merge ranks {(a, b): rank}, checked against the vocab so mismatched files fail early."""
    if not os.path.isfile(merge_file):
        raise DataError(f"merges file {merge_file} not found; pass --merge-file with the "
                        f"merges.txt made together with {vocab_file}")
    try:
        with open(merge_file, encoding="utf-8") as f:
            lines = f.readlines()
    except UnicodeDecodeError as exc:
        raise not_text(merge_file, exc, "--merge-file must be a GPT-2 merges.txt") from None
    ranks = {}
    for lineno, line in enumerate(lines, 1):
        if lineno == 1 and line.startswith("#version"):
            continue
        parts = line.split()
        if not parts:
            continue
        if len(parts) != 2:
            raise DataError(f"{merge_file}:{lineno}: expected two tokens per line, got "
                            f"{line.strip()!r}; is --merge-file a GPT-2 merges.txt?")
        a, b = parts
        if a not in vocab or b not in vocab or a + b not in vocab:
            raise DataError(f"{merge_file}:{lineno}: merge {a!r} + {b!r} uses tokens not in "
                            f"{vocab_file}; the vocab and merges files come from different "
                            f"tokenizers, pass the pair made together")
        ranks.setdefault((a, b), len(ranks))
    return ranks


class _WordCache(dict):
    """word -> tuple of ids; a miss runs BPE once (``__missing__``), hits stay in C."""

    def __init__(self, encode_word):
        super().__init__()
        self._encode_word = encode_word

    def __missing__(self, word):
        ids = self._encode_word(word)
        if len(self) >= _CACHE_LIMIT:
            self.clear()
        self[word] = ids
        return ids


class GPT2BPETokenizer:
    """Byte-level BPE with GPT-2's files.

    Args:
        vocab_file: ``vocab.json`` (token string -> id), must contain ``<|endoftext|>``.
        merge_file: ``merges.txt`` (one ``a b`` merge per line, best first).
    """

    name = "GPT2BPETokenizer"

    def __init__(self, vocab_file, merge_file):
        self.encoder = load_vocab(vocab_file)
        missing = [c for c in BYTE_ENCODER.values() if c not in self.encoder]
        if missing:
            raise DataError(f"{vocab_file} lacks {len(missing)} of the 256 byte tokens of a "
                            f"byte-level BPE vocab (e.g. {missing[0]!r}); it is not a GPT-2 vocab")
        if EOD_TOKEN not in self.encoder:
            raise DataError(f"{vocab_file} has no {EOD_TOKEN} token; add it (GPT-2 uses the "
                            f"last id) or retrain with tools/train_tokenizer.py")
        self.bpe_ranks = load_merges(merge_file, self.encoder, vocab_file)
        self.decoder = {i: t for t, i in self.encoder.items()}
        byte_decoder = {c: b for b, c in BYTE_ENCODER.items()}
        # id -> raw bytes, so detokenize is one join and one utf-8 decode.
        self._id_bytes = {i: bytes(byte_decoder.get(c, 0) for c in t) for i, t in
                          self.decoder.items()}
        self._id_bytes[self.encoder[EOD_TOKEN]] = EOD_TOKEN.encode()
        self._pattern = regex.compile(PRETOKENIZE_PATTERN)
        self._cache = _WordCache(self._encode_word)
        self.eod = self.encoder[EOD_TOKEN]

    @property
    def vocab_size(self):
        return len(self.encoder)

    @property
    def vocab(self):
        return self.encoder

    @property
    def inv_vocab(self):
        return self.decoder

    @property
    def pad(self):
        """GPT-2 has no pad token; padding reuses eod (masked out of the loss anyway)."""
        return self.eod

    @property
    def sentinel_ids(self):
        return []

    def _bpe(self, chars):
        """Apply merges by rank to one pre-token (a str of byte characters)."""
        word = list(chars)
        ranks = self.bpe_ranks
        while len(word) > 1:
            pairs = set(zip(word, word[1:]))
            best = min(pairs, key=lambda p: ranks.get(p, float("inf")))
            if best not in ranks:
                break
            first, second = best
            merged, i = [], 0
            while i < len(word):
                if i < len(word) - 1 and word[i] == first and word[i + 1] == second:
                    merged.append(first + second)
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = merged
        return word

    def _encode_word(self, word):
        chars = word.encode("utf-8").decode("latin-1").translate(BYTE_TRANSLATION)
        return tuple(self.encoder[t] for t in self._bpe(chars))

    def _tokenize_plain(self, text):
        return list(itertools.chain.from_iterable(
            map(self._cache.__getitem__, self._pattern.findall(text))))

    def tokenize_as_text(self, text):
        """Text -> ids with ``<|endoftext|>`` read as plain characters (Megatron-LM's rule,
        used by tools/preprocess_data.py so its output matches Megatron's byte for byte)."""
        return self._tokenize_plain(text)

    def tokenize(self, text):
        """Text -> list of ids (``<|endoftext|>`` in the text becomes ``eod``, as in HF)."""
        if EOD_TOKEN not in text:
            return self._tokenize_plain(text)
        ids = []
        for i, part in enumerate(text.split(EOD_TOKEN)):
            if i:
                ids.append(self.eod)
            ids.extend(self._tokenize_plain(part))
        return ids

    def detokenize(self, ids):
        """Ids -> text; invalid UTF-8 becomes U+FFFD, ids outside the vocab (padding) vanish."""
        get = self._id_bytes.get
        return b"".join(get(int(i), b"") for i in ids).decode("utf-8", errors="replace")

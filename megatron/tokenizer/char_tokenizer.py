"""Character tokenizer over a BERT-style ``vocab.txt``: GPT2-Chinese's vocabulary.

One token per line; the line number is the id. Each character of the text is one token.
Conventions (GPT2-Chinese's, see docs/data.md): ``[CLS]`` ends a document (``eod``),
``[PAD]`` pads, ``[SEP]`` stands for a newline, ``[SPACE]`` (when present) for any other
whitespace character, and a character not in the vocab becomes ``[UNK]``. Multi-character
lines (``##`` word pieces, other bracketed specials) are kept in the id space but never
produced by :meth:`tokenize`.
"""
import os

from megatron.common.errors import DataError, not_text

REQUIRED = ("[PAD]", "[UNK]", "[CLS]")


class CharTokenizer:
    """Character-level tokenizer.

    Args:
        vocab_file: BERT-style ``vocab.txt`` with at least ``[PAD]``, ``[UNK]``, ``[CLS]``.
    """

    name = "CharTokenizer"

    def __init__(self, vocab_file):
        if not os.path.isfile(vocab_file):
            raise DataError(f"vocab file {vocab_file} not found; pass --vocab-file with a "
                            f"character vocab.txt (tools/train_tokenizer.py --type char)")
        try:
            with open(vocab_file, encoding="utf-8") as f:
                tokens = [line.rstrip("\r\n") for line in f]
        except UnicodeDecodeError as exc:
            raise not_text(vocab_file, exc, "--vocab-file must be a character vocab.txt (one "
                           "token per line)") from None
        self.inv_vocab = dict(enumerate(tokens))
        self.vocab = {}
        for i, token in enumerate(tokens):
            self.vocab.setdefault(token, i)  # first occurrence wins, as in BERT
        missing = [t for t in REQUIRED if t not in self.vocab]
        if missing:
            raise DataError(f"{vocab_file} lacks {', '.join(missing)}; a character vocab.txt "
                            f"needs {', '.join(REQUIRED)} (one token per line)")
        self.pad = self.vocab["[PAD]"]
        self.unk = self.vocab["[UNK]"]
        self.eod = self.vocab["[CLS]"]
        newline = self.vocab.get("[SEP]", self.unk)
        space = self.vocab.get("[SPACE]", self.unk)
        # Per-character table; whitespace maps to the [SEP]/[SPACE] stand-ins.
        self._char_id = {t: i for t, i in self.vocab.items() if len(t) == 1 and not t.isspace()}
        for ws in " \t\r\x0b\x0c\u3000\xa0":
            self._char_id[ws] = space
        self._char_id["\n"] = newline
        self._text_of = {i: t for i, t in self.inv_vocab.items() if len(t) == 1}
        self._text_of[self.vocab.get("[SEP]", -1)] = "\n"
        self._text_of[self.vocab.get("[SPACE]", -1)] = " "
        self._text_of[self.unk] = "[UNK]"

    @property
    def vocab_size(self):
        return len(self.inv_vocab)

    @property
    def sentinel_ids(self):
        return []

    def tokenize(self, text):
        """Text -> one id per character (unknown characters -> ``[UNK]``)."""
        get, unk = self._char_id.get, self.unk
        return [get(c, unk) if not c.isspace() else get(c, self._char_id[" "]) for c in text]

    def detokenize(self, ids):
        """Ids -> text; specials other than [SEP]/[SPACE]/[UNK] are dropped."""
        get = self._text_of.get
        return "".join(get(int(i), "") for i in ids)

"""SentencePiece tokenizer with T5's sentinel tokens, laid out as Hugging Face T5 does.

Ids: the ``.model``'s pieces first (0 .. n-1), then any special piece the model lacks
(``<pad>``, then ``</s>``), then the sentinels at the top: ``<extra_id_i>`` = vocab_size-1-i,
so ``<extra_id_0>`` is the highest id, as in HF T5 checkpoints. A model trained with
``tools/train_tokenizer.py --type sentencepiece`` has pad=0, eos=1, unk=2 (T5's layout), so
nothing is appended but the sentinels. If the ``.model`` already holds the
``<extra_id_*>`` pieces they are reused in place.
"""
import os
import re

from megatron.common.errors import DataError

_SENTINEL_RE = re.compile(r"(<extra_id_\d+>)")


def _load_processor(model_file):
    import sentencepiece as spm

    if not os.path.isfile(model_file):
        raise DataError(f"sentencepiece model {model_file} not found; pass --tokenizer-model "
                        f"(tools/train_tokenizer.py --type sentencepiece makes one)")
    try:
        return spm.SentencePieceProcessor(model_file=model_file)
    except (RuntimeError, OSError) as exc:
        raise DataError(f"{model_file} is not a sentencepiece model ({exc}); --tokenizer-model "
                        f"must be a .model file") from None


class SentencePieceTokenizer:
    """Tokenizer over a sentencepiece ``.model``.

    Args:
        model_file: path of the ``.model``.
        vocab_extra_ids: number of T5 sentinels ``<extra_id_0..N-1>`` (0 for none).
    """

    name = "SentencePieceTokenizer"

    def __init__(self, model_file, vocab_extra_ids=100):
        self._sp = _load_processor(model_file)
        self._n_pieces = self._sp.get_piece_size()
        self._extra = {}  # appended token -> id
        self.pad = self._special_id(self._sp.pad_id(), "<pad>")
        self.eod = self._special_id(self._sp.eos_id(), "</s>")
        self.unk = self._sp.unk_id()
        self.sentinel_ids = self._sentinels(model_file, int(vocab_extra_ids))
        self._id_to_extra = {i: t for t, i in self._extra.items()}
        self._token_to_id = dict(self._extra)

    def _special_id(self, sp_id, piece):
        if sp_id >= 0:
            return sp_id
        self._extra[piece] = self._n_pieces + len(self._extra)
        return self._extra[piece]

    def _sentinels(self, model_file, count):
        names = [f"<extra_id_{i}>" for i in range(count)]
        inside = [self._sp.piece_to_id(n) for n in names]
        present = [i for i, n in zip(inside, names) if self._sp.id_to_piece(i) == n]
        if present and len(present) != count:
            raise DataError(f"{model_file} holds {len(present)} of the {count} pieces "
                            f"<extra_id_*>; pass --vocab-extra-ids {len(present)} or retrain")
        if present:
            return inside
        top = self._n_pieces + len(self._extra) + count - 1
        for i, n in enumerate(names):
            self._extra[n] = top - i
        return [top - i for i in range(count)]

    @property
    def vocab_size(self):
        return self._n_pieces + len(self._extra)

    @property
    def eos(self):
        return self.eod

    def piece_to_id(self, piece):
        if piece in self._token_to_id:
            return self._token_to_id[piece]
        return self._sp.piece_to_id(piece)

    def tokenize(self, text):
        """Text -> ids; literal ``<extra_id_i>`` in the text become sentinel ids (as in HF)."""
        if "<extra_id_" not in text or not self.sentinel_ids:
            return self._sp.encode(text, out_type=int)
        ids = []
        for part in _SENTINEL_RE.split(text):
            special = self.piece_to_id(part) if _SENTINEL_RE.fullmatch(part) else None
            if special is not None and special in self.sentinel_ids:
                ids.append(special)
            elif part:
                ids.extend(self._sp.encode(part, out_type=int))
        return ids

    def detokenize(self, ids):
        """Ids -> text: runs of model pieces are decoded by sentencepiece, appended tokens
        are written as their names, ids past the vocab (padding) are dropped."""
        out, run = [], []
        for i in map(int, ids):
            if 0 <= i < self._n_pieces:
                run.append(i)
                continue
            if run:
                out.append(self._sp.decode(run))
                run = []
            if i in self._id_to_extra:
                out.append(self._id_to_extra[i])
        if run:
            out.append(self._sp.decode(run))
        return "".join(out)

#!/usr/bin/env python
"""Train a tokenizer from the same inputs tools/preprocess_data.py accepts.

    python tools/train_tokenizer.py --type gpt2 --input corpus.jsonl --vocab-size 8000 \\
        --output-dir vocab/        # vocab/vocab.json + vocab/merges.txt (GPT2BPETokenizer)
    ... --type sentencepiece       # vocab/spm.model (SentencePieceTokenizer; T5 layout:
                                   #   pad=0, eos=1, unk=2, sentinels appended at load time)
    ... --type char                # vocab/vocab.txt (CharTokenizer; GPT2-Chinese make_vocab)

The GPT-2 trainer is our own (megatron/tokenizer/bpe_trainer.py); sentencepiece trains with
its own library.
"""
import argparse
import collections
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.data.text_input import FORMATS, check_input, iter_documents  # noqa: E402
from megatron.common.errors import DataError, entry_point  # noqa: E402
from megatron.observability.progress import progress  # noqa: E402

CHAR_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[SPACE]"]


def get_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--type", required=True, choices=["gpt2", "sentencepiece", "char"])
    parser.add_argument("--input", required=True, nargs="+")
    parser.add_argument("--input-format", choices=FORMATS, default=None)
    parser.add_argument("--json-keys", nargs="+", default=["text"])
    parser.add_argument("--skip-bad-lines", action="store_true")
    parser.add_argument("--vocab-size", type=int, required=True)
    parser.add_argument("--min-frequency", type=int, default=2,
                        help="gpt2/char: drop merges/characters seen fewer times")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--model-name", default="spm", help="sentencepiece: <name>.model")
    parser.add_argument("--model-type", default="unigram", choices=["unigram", "bpe"],
                        help="sentencepiece algorithm (T5 uses unigram)")
    parser.add_argument("--character-coverage", type=float, default=0.9995)
    return parser.parse_args(argv)


def _texts(args):
    skipped = collections.Counter()

    def on_skip(path, lineno, msg):
        skipped[path] += 1
        print(f"skipped {path}:{lineno}: {msg}", file=sys.stderr)

    docs = iter_documents(args.input, args.json_keys, args.input_format, args.skip_bad_lines,
                          on_skip)
    for doc in progress(docs, desc="reading documents", unit="docs"):
        yield from doc.values()


def train_gpt2(args):
    from megatron.tokenizer.bpe_trainer import save_bpe, train_bpe

    bars = []

    def on_merge():  # the merges' bar starts once reading (its own bar) is over
        if not bars:
            bars.append(progress(total=max(args.vocab_size - 257, 1), desc="learning merges",
                                 unit="merges"))
        bars[0].update(1)

    vocab, merges = train_bpe(_texts(args), args.vocab_size, args.min_frequency, on_merge)
    for bar in bars:
        bar.close()
    if len(merges) == 0:
        raise DataError("no pair occurs --min-frequency times; the input is too small")
    paths = save_bpe(vocab, merges, args.output_dir)
    return paths, len(vocab)


def train_sentencepiece(args):
    import sentencepiece as spm

    def lines():
        for text in _texts(args):
            for line in text.splitlines():
                if line.strip():
                    yield line

    prefix = os.path.join(args.output_dir, args.model_name)
    os.makedirs(args.output_dir, exist_ok=True)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=lines(), model_prefix=prefix, vocab_size=args.vocab_size,
            model_type=args.model_type, character_coverage=args.character_coverage,
            pad_id=0, eos_id=1, unk_id=2, bos_id=-1,  # T5's layout
            input_sentence_size=2_000_000, shuffle_input_sentence=True, num_threads=2,
            minloglevel=2)
    except RuntimeError as exc:
        message = str(exc).strip().splitlines()[-1]
        raise DataError(f"sentencepiece training failed: {message} (adjust --vocab-size or "
                        f"--character-coverage)") from None
    return (prefix + ".model",), spm.SentencePieceProcessor(model_file=prefix + ".model") \
        .get_piece_size()


def train_char(args):
    counts = collections.Counter()
    for text in _texts(args):
        counts.update(text)
    chars = sorted((c for c, n in counts.items() if n >= args.min_frequency and not c.isspace()),
                   key=lambda c: (-counts[c], c))
    chars = chars[:max(0, args.vocab_size - len(CHAR_SPECIALS))]
    if not chars:
        raise DataError("no character occurs --min-frequency times; the input is too small")
    os.makedirs(args.output_dir, exist_ok=True)
    path = os.path.join(args.output_dir, "vocab.txt")
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("".join(t + "\n" for t in CHAR_SPECIALS + chars))
    os.replace(tmp, path)
    return (path,), len(CHAR_SPECIALS) + len(chars)


@entry_point
def main(argv=None):
    args = get_args(argv)
    for path in args.input:
        check_input(path)
    if args.vocab_size < 1:
        raise DataError("--vocab-size must be positive")
    start = time.time()
    trainer = {"gpt2": train_gpt2, "sentencepiece": train_sentencepiece, "char": train_char}
    paths, size = trainer[args.type](args)
    print(f"trained a {args.type} vocab of {size} tokens in {time.time() - start:.1f}s: "
          f"{', '.join(paths)}", file=sys.stderr)


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Tokenize raw text into Megatron's mmap indexed format (``.bin`` + ``.idx``).

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \\
        --append-eod --workers 2

writes ``data/corpus_text_document.{bin,idx}`` (one pair per ``--json-keys`` key). Input is
JSONL, a JSON array (GPT2-Chinese's ``train.json``) or plain text (documents separated by
blank lines); see megatron/data/text_input.py. A malformed line is an error naming the file
and line, unless ``--skip-bad-lines`` skips and counts it. Output files appear only when
the whole input went through.

The output is byte-identical to a Megatron-LM tools/preprocess_data.py for the same input
and vocabulary; which one ``--match`` says, as they differ on a document whose text
tokenizes to nothing:

- ``--match megatron-v2.6`` (the default): Megatron-LM v2.6's, whose writer skips such a
  document: it leaves no trace in the ``.idx``;
- ``--match megatron-core``: today's Megatron-LM (Megatron-core's ``IndexedDatasetBuilder``
  ``add_document``), which records it as a document of no sequences: its document index
  repeats the previous entry.

Both give an empty document no end-of-document token (not even with ``--append-eod``),
write the same ``.bin`` and the same sequences, and tokenize a literal ``<|endoftext|>``
inside a text as text, not as the end-of-document id (``--eod-in-text`` restores that, HF's
reading). The default is v2.6's because this project's dataset code is v2.6's: its GPT
datasets count documents as sequences, so both outputs train the same. See docs/data.md.
"""
import argparse
import itertools
import multiprocessing
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from megatron.data import indexed_dataset  # noqa: E402
from megatron.data.text_input import FORMATS, check_input, detect_format, iter_units, parse_unit  # noqa: E402,E501
from megatron.common.errors import DataError, entry_point  # noqa: E402
from megatron.observability.progress import progress as make_progress  # noqa: E402
from megatron.tokenizer import TOKENIZER_TYPES, build_tokenizer  # noqa: E402

CHUNK = 64  # documents per task sent to a worker: amortizes the inter-process traffic
#: ``--match`` values: whose output the bytes equal (they differ on empty documents only).
MATCH_V26, MATCH_CORE = "megatron-v2.6", "megatron-core"


def get_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_argument_group("input")
    group.add_argument("--input", required=True, nargs="+", help="input file(s)")
    group.add_argument("--input-format", choices=FORMATS, default=None,
                       help="jsonl, json (array) or text; detected from the content by default")
    group.add_argument("--json-keys", nargs="+", default=["text"],
                       help="keys to extract from each JSON object (default: text)")
    group.add_argument("--skip-bad-lines", action="store_true",
                       help="skip and count malformed lines/items instead of stopping")
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    group.add_argument("--vocab-file", default=None)
    group.add_argument("--merge-file", default=None)
    group.add_argument("--tokenizer-model", default=None)
    group.add_argument("--vocab-extra-ids", type=int, default=100)
    group.add_argument("--append-eod", action="store_true",
                       help="append the end-of-document token to every document")
    group.add_argument("--eod-in-text", action="store_true",
                       help="read a literal <|endoftext|> in a text as the end-of-document id "
                            "(HF's reading; Megatron-LM, and the default, tokenize it as text)")
    group = parser.add_argument_group("output")
    group.add_argument("--output-prefix", required=True)
    group.add_argument("--dataset-impl", default="mmap", choices=["mmap"])
    group.add_argument("--match", default=MATCH_V26, choices=[MATCH_V26, MATCH_CORE],
                       help="whose bytes to reproduce: Megatron-LM v2.6 skips a document that "
                            "tokenizes to nothing (default); Megatron-core records it in the "
                            "document index as a document of no sequences")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    group.add_argument("--log-interval", type=int, default=10000,
                       help="report progress every this many documents")
    args = parser.parse_args(argv)
    if args.workers < 1 or args.log_interval < 1:
        parser.error("--workers and --log-interval must be >= 1")
    args.rank = 0
    return args


_TOKENIZER = None


_TOKENIZE = None


#: The share of unknown tokens above which the report warns (the vocabulary misses text).
UNKNOWN_WARN_RATE = 0.01


def _init_worker(args):
    global _TOKENIZER, _TOKENIZE
    _TOKENIZER = build_tokenizer(args)
    # Megatron's GPT-2 tokenizer has no special tokens: "<|endoftext|>" is just text.
    as_text = getattr(_TOKENIZER, "tokenize_as_text", None)
    _TOKENIZE = _TOKENIZER.tokenize if args.eod_in_text or as_text is None else as_text


def encode_chunk(task):
    """Tokenize a list of work units; returns per unit ``(lineno, error, {key: ids}, nbytes)``.

    Bad units come back as an error string (the main process decides: stop or skip), so a
    worker never dies on user data.
    """
    keys, append_eod, dtype, units = task
    out = []
    for lineno, kind, payload in units:
        try:
            doc = parse_unit(kind, payload, keys)
        except ValueError as exc:
            out.append((lineno, str(exc), None, 0))
            continue
        arrays, nbytes = {}, 0
        for key, text in doc.items():
            ids = _TOKENIZE(text)
            if append_eod and ids:  # as Megatron: an empty document gets no EOD either
                ids.append(_TOKENIZER.eod)
            arrays[key] = np.asarray(ids, dtype=dtype)
            nbytes += len(text.encode("utf-8"))
        out.append((lineno, None, arrays, nbytes))
    return out


def _tasks(path, fmt, args, dtype):
    units = iter_units(path, fmt)
    while True:
        chunk = list(itertools.islice(units, CHUNK))
        if not chunk:
            return
        yield args.json_keys, args.append_eod, dtype, chunk


def _validate_inputs(args):
    """Check every input before any work: exists, non-empty, first document well formed."""
    formats = []
    for path in args.input:
        check_input(path)
        fmt = args.input_format or detect_format(path)
        first = next(iter_units(path, fmt), None)
        if first is None:
            raise DataError(f"{path} holds no documents; nothing to process")
        try:
            parse_unit(first[1], first[2], args.json_keys)
        except ValueError as exc:
            if not args.skip_bad_lines:
                raise DataError(f"{path}:{first[0]}: {exc}") from None
        formats.append(fmt)
    return formats


class _Progress:
    """Documents done: a bar on a terminal, a line every ``--log-interval`` docs otherwise."""

    def __init__(self, interval):
        self.bar = make_progress(desc="tokenizing", unit="docs", every=interval)
        self.start = time.time()
        self.docs = self.bytes = self.skipped = self.empty = 0
        self.tokens = self.unknown = 0  # tokens written, and those that are the unknown id

    def add(self, nbytes):
        self.docs += 1
        self.bytes += nbytes
        if self.docs % 1000 == 0:  # the byte rate; refreshing it per document costs time
            self.bar.set_postfix_str(f"{self.bytes / self._elapsed() / 1e6:.2f} MB/s")
        self.bar.update(1)

    def _elapsed(self):
        return max(time.time() - self.start, 1e-9)

    def report(self, what):
        self.bar.close()
        elapsed = self._elapsed()
        print(f"{what} {self.docs} documents ({self.docs / elapsed:.1f} docs/s, "
              f"{self.bytes / elapsed / 1e6:.2f} MB/s)", file=sys.stderr, flush=True)


def _consume(results, path, builders, progress, skip_bad, index_empty=False, unk=None):
    for lineno, error, arrays, nbytes in results:
        if error is not None:
            if not skip_bad:
                raise DataError(f"{path}:{lineno}: {error} (or pass --skip-bad-lines to skip "
                                f"such lines)")
            progress.skipped += 1
            print(f"skipped {path}:{lineno}: {error}", file=sys.stderr)
            continue
        for key, ids in arrays.items():
            if ids.size == 0:  # an empty document adds nothing to train on
                progress.empty += 1
                if index_empty:  # Megatron-core: a document of no sequences
                    builders[key].end_document()
                continue
            builders[key].add_item(ids)
            builders[key].end_document()
            progress.tokens += ids.size
            if unk is not None:
                progress.unknown += int(np.count_nonzero(ids == unk))
        progress.add(nbytes)


def run(args):
    """Preprocess ``args.input`` into ``{output_prefix}_{key}_document.{bin,idx}``."""
    formats = _validate_inputs(args)
    tokenizer = build_tokenizer(args)  # raises on missing/mismatched vocab files, before work
    dtype = indexed_dataset.best_fitting_dtype(tokenizer.vocab_size)
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    prefixes = {k: f"{args.output_prefix}_{k}_document" for k in args.json_keys}
    builders = {k: indexed_dataset.MMapIndexedDatasetBuilder(
        indexed_dataset.data_file_path(p), dtype=dtype) for k, p in prefixes.items()}
    progress = _Progress(args.log_interval)
    unk = getattr(tokenizer, "unk", None)  # byte-level BPE has none: every byte is a token
    pool = None
    try:
        if args.workers > 1:
            pool = multiprocessing.get_context("fork").Pool(args.workers, _init_worker, (args,))
            mapper = pool.imap
        else:
            _init_worker(args)
            mapper = map
        for path, fmt in zip(args.input, formats):
            for results in mapper(encode_chunk, _tasks(path, fmt, args, dtype)):
                _consume(results, path, builders, progress, args.skip_bad_lines,
                         index_empty=args.match == MATCH_CORE, unk=unk)
        if progress.docs == 0:
            raise DataError(f"no documents with text in {', '.join(args.input)}; check "
                            f"--json-keys {' '.join(args.json_keys)}")
        for key, prefix in prefixes.items():
            builders[key].finalize(indexed_dataset.index_file_path(prefix))
    except BaseException:
        for builder in builders.values():
            builder.abort()
        raise
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    progress.report("done:")
    empty = "indexed" if args.match == MATCH_CORE else "skipped"
    print(f"wrote {', '.join(p + '.{bin,idx}' for p in prefixes.values())} (bytes of "
          f"{args.match}); skipped {progress.skipped} bad documents, {empty} "
          f"{progress.empty} empty ones", file=sys.stderr)
    if unk is not None:
        print(_unknown_line(progress, args), file=sys.stderr)
    return prefixes


def _unknown_line(progress, args):
    """How many tokens are the tokenizer's unknown token (characters its vocabulary lacks)."""
    rate = progress.unknown / max(progress.tokens, 1)
    line = (f"unknown tokens: {progress.unknown} of {progress.tokens} ({rate:.2%}) are the "
            f"tokenizer's unknown token")
    if rate > UNKNOWN_WARN_RATE:
        source = args.vocab_file or args.tokenizer_model
        line += (f"; WARNING: above {UNKNOWN_WARN_RATE:.0%}, the text has characters "
                 f"{source} lacks: add them to it (or train a tokenizer on this text)")
    return line


@entry_point
def main(argv=None):
    run(get_args(argv))


if __name__ == "__main__":
    main()

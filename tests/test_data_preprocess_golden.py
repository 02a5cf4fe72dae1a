"""tools/preprocess_data.py writes what Megatron-LM's writes, byte for byte, under both
rules ``--match`` offers.

The goldens in ``tests/data/preprocess/`` were produced by the reference rules below,
implemented independently of the project: Hugging Face ``tokenizers`` byte-level BPE (no
special tokens, so ``<|endoftext|>`` inside a text is plain text, as in Megatron's GPT-2
tokenizer), no EOD for a document that tokenizes to nothing, EOD appended otherwise, and a
hand-written MMIDIDX v1 writer. They differ only on those empty documents:

- ``golden_text_document``: Megatron-LM v2.6 (``--match megatron-v2.6``, the default): an
  empty document is skipped, the document index has one entry per kept document;
- ``golden_core_text_document``: Megatron-core (``--match megatron-core``):
  ``IndexedDatasetBuilder.add_document`` appends a document-index entry for every document,
  so an empty one repeats the previous entry.

Regenerate with ``python tests/test_data_preprocess_golden.py`` (only if the rules change).
"""
import json
import os
import struct
import sys

import numpy as np
import pytest

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "preprocess")
CORPUS, VOCAB, MERGES = (os.path.join(DATA, f) for f in ("corpus.jsonl", "vocab.json",
                                                         "merges.txt"))
GOLDEN = os.path.join(DATA, "golden_text_document")
GOLDEN_CORE = os.path.join(DATA, "golden_core_text_document")
EOD = "<|endoftext|>"


def reference_documents(corpus, vocab, merges, keep_empty=False):
    """Megatron's rules: token ids per document, EOD appended; documents that tokenize to
    nothing are dropped (v2.6), or kept as ``[]`` with ``keep_empty`` (Megatron-core)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.BPE.from_file(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    with open(vocab, encoding="utf-8") as f:
        eod = json.load(f)[EOD]
    docs = []
    with open(corpus, encoding="utf-8") as f:
        for line in f:
            ids = tok.encode(json.loads(line)["text"]).ids
            if ids:  # Megatron gives documents with no tokens no EOD
                docs.append(ids + [eod])
            elif keep_empty:
                docs.append([])
    return docs


def write_reference_mmidx(docs, prefix):
    """MMIDIDX v1: magic, version, dtype code (8 = uint16), counts, sizes, pointers, doc_idx.

    A non-empty document is one sequence; an empty one (``[]``, Megatron-core's rule) is a
    document of no sequences: its doc_idx entry repeats the previous one."""
    sizes = np.array([len(d) for d in docs if d], dtype=np.int32)
    pointers = np.concatenate([[0], np.cumsum(sizes[:-1].astype(np.int64) * 2)]).astype(np.int64)
    doc_idx = np.array([0] + list(np.cumsum([1 if d else 0 for d in docs])), dtype=np.int64)
    with open(prefix + ".bin", "wb") as f:
        for d in docs:
            f.write(np.asarray(d, dtype=np.uint16).tobytes())
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 8))
        f.write(struct.pack("<Q", len(sizes)) + struct.pack("<Q", len(doc_idx)))
        f.write(sizes.tobytes() + pointers.tobytes() + doc_idx.tobytes())


def _read(path):
    with open(path, "rb") as f:
        return f.read()


def test_committed_golden_follows_the_reference_rules(tmp_path):
    docs = reference_documents(CORPUS, VOCAB, MERGES)
    with open(CORPUS) as f:
        texts = [json.loads(line)["text"] for line in f]
    assert len(docs) == len(texts) - texts.count("")  # the corpus has empty documents
    write_reference_mmidx(docs, str(tmp_path / "ref"))
    for ext in (".bin", ".idx"):
        assert _read(str(tmp_path / "ref") + ext) == _read(GOLDEN + ext), ext
    core = reference_documents(CORPUS, VOCAB, MERGES, keep_empty=True)
    assert len(core) == len(texts)
    write_reference_mmidx(core, str(tmp_path / "core"))
    for ext in (".bin", ".idx"):
        assert _read(str(tmp_path / "core") + ext) == _read(GOLDEN_CORE + ext), ext
    assert _read(GOLDEN_CORE + ".bin") == _read(GOLDEN + ".bin")  # only the index differs
    assert _read(GOLDEN_CORE + ".idx") != _read(GOLDEN + ".idx")


def _preprocess(tmp_path, *extra):
    sys.path.insert(0, os.path.join(os.path.dirname(DATA), "..", "..", "tools"))
    import preprocess_data

    prefix = str(tmp_path / "out")
    preprocess_data.run(preprocess_data.get_args(
        ["--input", CORPUS, "--output-prefix", prefix, "--tokenizer-type", "GPT2BPETokenizer",
         "--vocab-file", VOCAB, "--merge-file", MERGES, "--append-eod", *extra]))
    return prefix + "_text_document"


@pytest.mark.parametrize("workers", ["1", "2"])
def test_tool_output_is_byte_identical_to_golden(tmp_path, workers):
    out = _preprocess(tmp_path, "--workers", workers)
    for ext in (".bin", ".idx"):
        assert _read(out + ext) == _read(GOLDEN + ext), ext


@pytest.mark.parametrize("workers", ["1", "2"])
def test_match_megatron_core_is_byte_identical_to_its_golden(tmp_path, workers):
    from megatron.data.indexed_dataset import MMapIndexedDataset

    out = _preprocess(tmp_path, "--workers", workers, "--match", "megatron-core")
    for ext in (".bin", ".idx"):
        assert _read(out + ext) == _read(GOLDEN_CORE + ext), ext
    core, v26 = MMapIndexedDataset(out), MMapIndexedDataset(GOLDEN)
    with open(CORPUS) as f:
        texts = [json.loads(line)["text"] for line in f]
    assert len(core.doc_idx) == len(texts) + 1 and len(v26.doc_idx) == len(texts) - 1
    assert len(core) == len(v26)  # the same sequences: both train the same


def test_eod_in_text_flag_reads_the_marker_as_eod(tmp_path):
    from megatron.data.indexed_dataset import MMapIndexedDataset

    with open(VOCAB) as f:
        eod = json.load(f)[EOD]
    golden = MMapIndexedDataset(GOLDEN)
    old = MMapIndexedDataset(_preprocess(tmp_path, "--eod-in-text"))
    # Document 1 holds one marker mid-text: as text in the golden, as an EOD id with the flag.
    assert list(golden[1]).count(eod) == 1 and list(old[1]).count(eod) == 2
    assert len(old) == len(golden)


if __name__ == "__main__":
    write_reference_mmidx(reference_documents(CORPUS, VOCAB, MERGES), GOLDEN)
    write_reference_mmidx(reference_documents(CORPUS, VOCAB, MERGES, keep_empty=True),
                          GOLDEN_CORE)
    print(f"wrote {GOLDEN}.{{bin,idx}} and {GOLDEN_CORE}.{{bin,idx}}")

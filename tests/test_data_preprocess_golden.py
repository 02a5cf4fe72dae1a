"""tools/preprocess_data.py writes what Megatron-LM's writes, byte for byte.

The golden ``tests/data/preprocess/golden_text_document.{bin,idx}`` was produced by the
reference rules below, implemented independently of the project: Hugging Face
``tokenizers`` byte-level BPE (no special tokens, so ``<|endoftext|>`` inside a text is
plain text, as in Megatron's GPT-2 tokenizer), documents that tokenize to nothing skipped
(no EOD), EOD appended otherwise, and a hand-written MMIDIDX v1 writer. Regenerate with
``python tests/test_data_preprocess_golden.py`` (only if the rules change).
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
EOD = "<|endoftext|>"


def reference_documents(corpus, vocab, merges):
    """Megatron's rules: token ids per kept document, EOD appended."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.BPE.from_file(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    with open(vocab, encoding="utf-8") as f:
        eod = json.load(f)[EOD]
    docs = []
    with open(corpus, encoding="utf-8") as f:
        for line in f:
            ids = tok.encode(json.loads(line)["text"]).ids
            if ids:  # Megatron skips documents with no tokens (and gives them no EOD)
                docs.append(ids + [eod])
    return docs


def write_reference_mmidx(docs, prefix):
    """MMIDIDX v1: magic, version, dtype code (8 = uint16), counts, sizes, pointers, doc_idx."""
    sizes = np.array([len(d) for d in docs], dtype=np.int32)
    pointers = np.concatenate([[0], np.cumsum(sizes[:-1].astype(np.int64) * 2)]).astype(np.int64)
    doc_idx = np.arange(len(docs) + 1, dtype=np.int64)  # one item per document
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
    print(f"wrote {GOLDEN}.{{bin,idx}}")

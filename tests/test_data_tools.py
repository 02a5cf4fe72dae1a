"""End to end through the tools: preprocess -> dataset -> detokenize, and bad input."""
import argparse
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from datautil import REPO, random_text, run_tool, training_corpus, write_jsonl
from megatron.data import indexed_dataset as ids
from megatron.tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
    root = tmp_path_factory.mktemp("tools")
    corpus = training_corpus(root / "corpus.jsonl", seed=1, n_docs=300)
    run_tool("train_tokenizer", "--type", "gpt2", "--input", corpus, "--vocab-size", 800,
             "--output-dir", root)
    run_tool("train_tokenizer", "--type", "sentencepiece", "--input", corpus, "--vocab-size",
             800, "--output-dir", root)
    return root


def _gpt2_flags(vocab):
    return ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab / "vocab.json",
            "--merge-file", vocab / "merges.txt"]


def _docs(rng, n):
    return [random_text(rng, int(rng.integers(1, 80))).strip() or "x" for _ in range(n)]


@pytest.mark.parametrize("fmt", ["jsonl", "json", "text"])
def test_round_trip_gpt2(vocab, tmp_path, seed, fmt):
    rng = np.random.default_rng(seed)
    docs = _docs(rng, 120)
    path = tmp_path / f"in.{fmt}"
    if fmt == "jsonl":
        write_jsonl(path, docs)
    elif fmt == "json":
        path.write_text(json.dumps(docs, ensure_ascii=False, indent=1), encoding="utf-8")
    else:  # plain text: documents separated by blank lines, so no blank lines inside
        docs = [" ".join(d.split()) for d in docs]
        path.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    proc = run_tool("preprocess_data", "--input", path, "--output-prefix", tmp_path / "out",
                    *_gpt2_flags(vocab), "--append-eod", "--workers", 2, "--log-interval", 50)
    assert "docs/s" in proc.stderr and "MB/s" in proc.stderr
    ds = ids.make_dataset(str(tmp_path / "out_text_document"))
    tok = build_tokenizer(argparse.Namespace(
        tokenizer_type="GPT2BPETokenizer", vocab_file=str(vocab / "vocab.json"),
        merge_file=str(vocab / "merges.txt"), tokenizer_model=None))
    assert len(ds) == len(docs) and ds.dtype == np.uint16
    for i, doc in enumerate(docs):
        assert ds[i][-1] == tok.eod
        assert tok.detokenize(ds[i][:-1]) == doc


def test_round_trip_sentencepiece_to_t5_and_gpt2_datasets(vocab, tmp_path, seed):
    from megatron.data import gpt2_dataset, t5_dataset

    rng = np.random.default_rng(seed)
    docs = [" ".join(d.split()) for d in _docs(rng, 200)]
    write_jsonl(tmp_path / "in.jsonl", docs)
    run_tool("preprocess_data", "--input", tmp_path / "in.jsonl", "--output-prefix",
             tmp_path / "sp", "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
             vocab / "spm.model", "--append-eod", "--workers", 2)
    tok = build_tokenizer(argparse.Namespace(tokenizer_type="SentencePieceTokenizer",
                                             tokenizer_model=str(vocab / "spm.model")))
    prefix = str(tmp_path / "sp_text_document")
    ds = ids.make_dataset(prefix)
    # sentencepiece normalizes whitespace (and maps unknown characters to <unk>).
    assert sum(tok.detokenize(ds[i][:-1]) == d for i, d in enumerate(docs)) > 0.5 * len(docs)
    ref = [tok.tokenize(d) + [tok.eod] for d in docs]
    assert all(ds[i].tolist() == r for i, r in enumerate(ref))
    train = gpt2_dataset.build_train_valid_test_datasets([prefix], "1", [20, 0, 0], 32, 5)[0]
    stream = np.concatenate([ref[d] for d in train.doc_idx])
    j = int(train.shuffle_idx[0])
    assert np.array_equal(train[0]["text"], stream[j * 32:j * 32 + 33])
    t5_train = t5_dataset.build_train_valid_test_datasets([prefix], "1", [10, 0, 0], 64, 32, 5,
                                                          tok)[0]
    sample = t5_train[3]
    enc = sample["text_enc"]
    assert tok.sentinel_ids[0] in enc.tolist() and sample["labels"][0] == tok.sentinel_ids[0]


def _preprocess(tmp_path, vocab, *extra, inputs=None):
    cmd = [sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"), "--output-prefix",
           str(tmp_path / "out"), *map(str, _gpt2_flags(vocab)), *map(str, extra)]
    if inputs is not None:
        cmd += ["--input", *map(str, inputs)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def _assert_user_error(proc, pattern, tmp_path):
    import re

    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: ") and re.search(pattern, lines[-1]), proc.stderr
    assert "Traceback" not in proc.stderr
    assert not [f for f in os.listdir(tmp_path) if f.startswith("out")], "half-written output"


def test_bad_inputs_give_one_clear_error(vocab, tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "numbers.json").write_text("[1, 2, 3]")
    (tmp_path / "obj.json").write_text('{"text": "a"}\n{"text": "b"}\n[1]\n')
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": "fine"}\n{"text": oops}\n')
    (tmp_path / "key.jsonl").write_text('{"body": "no text key"}\n')
    cases = [
        ([tmp_path / "missing.jsonl"], "missing.jsonl not found"),
        ([tmp_path / "empty.jsonl"], "empty.jsonl is empty"),
        ([tmp_path / "numbers.json"], r"numbers.json:1: expected a string or an object"),
        ([tmp_path / "obj.json"], r"obj.json:3: expected a JSON object"),
        ([tmp_path / "bad.jsonl"], r"bad.jsonl:3: malformed JSON"),
        ([tmp_path / "key.jsonl"], r"key.jsonl:1: key 'text' is missing .*--json-keys"),
    ]
    for inputs, pattern in cases:
        _assert_user_error(_preprocess(tmp_path, vocab, "--workers", 2, inputs=inputs),
                           pattern, tmp_path)
    # vocab/merges from different tokenizers
    other = tmp_path / "other"
    other.mkdir()
    (other / "vocab.json").write_text(json.dumps(
        {k: v for k, v in json.loads((vocab / "vocab.json").read_text()).items()
         if len(k) == 1 or k == "<|endoftext|>"}))
    cmd = [sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"), "--input",
           str(tmp_path / "bad.jsonl"), "--output-prefix", str(tmp_path / "out"),
           "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(other / "vocab.json"),
           "--merge-file", str(vocab / "merges.txt")]
    _assert_user_error(subprocess.run(cmd, capture_output=True, text=True, timeout=120),
                       "different tokenizers", tmp_path)


def test_skip_bad_lines_counts_them(vocab, tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "one"}\n{"text": oops}\n[2]\n{"text": "two"}\n')
    proc = _preprocess(tmp_path, vocab, "--skip-bad-lines", inputs=[tmp_path / "bad.jsonl"])
    assert proc.returncode == 0, proc.stderr
    assert "bad.jsonl:2" in proc.stderr and "bad.jsonl:3" in proc.stderr
    assert "skipped 2 bad" in proc.stderr
    assert len(ids.make_dataset(str(tmp_path / "out_text_document"))) == 2


def test_data_prefix_without_idx_exits_with_message(tmp_path):
    code = ("from megatron.common.errors import run_main\n"
            "from megatron.data.gpt2_dataset import build_train_valid_test_datasets as b\n"
            f"run_main(b, [{str(tmp_path / 'corpus_text_document')!r}], '1', [1,0,0], 8, 1)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert proc.returncode == 2
    assert "corpus_text_document.idx not found" in proc.stderr and "Traceback" not in proc.stderr


def test_train_tokenizer_rejects_empty_input(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    for kind in ("gpt2", "sentencepiece", "char"):
        proc = run_tool("train_tokenizer", "--type", kind, "--input", tmp_path / "empty.jsonl",
                        "--vocab-size", 300, "--output-dir", tmp_path / "v", check=False)
        assert proc.returncode == 2 and "empty.jsonl is empty" in proc.stderr


def test_sample_corpus_is_deterministic_prose(tmp_path):
    for name in ("a", "b"):
        run_tool("make_sample_corpus", "--output", tmp_path / f"{name}.jsonl", "--max-mb", 0.3)
    a, b = (tmp_path / "a.jsonl").read_bytes(), (tmp_path / "b.jsonl").read_bytes()
    assert a == b and 0.3e6 <= len(a) < 0.4e6
    records = [json.loads(line) for line in a.decode().splitlines()]
    assert len({r["text"] for r in records}) == len(records)  # no repeats
    assert all(len(r["text"].split()) >= 20 for r in records)
    assert not [f for f in os.listdir(tmp_path) if ".tmp-" in f]


def test_char_tokenizer_reports_its_unknown_token_rate(tmp_path, seed):
    """The report counts the characters the vocabulary lacks (whitespace has stand-ins), and
    warns above 1%; a vocabulary that has them all reports 0."""
    import re

    rng = np.random.default_rng(seed)
    known = "abcdefghijklmnopqrstuvwxyz"
    docs = ["".join(rng.choice(list(known + " \n" + "XYZ0123"), int(rng.integers(5, 60))))
            for _ in range(50)]
    write_jsonl(tmp_path / "in.jsonl", docs)
    want = sum(1 for d in docs for c in d if not c.isspace() and c not in known)
    total = sum(len(d) for d in docs) + len(docs)  # one [CLS] per document
    for name, letters in (("part", known), ("all", known + "XYZ0123")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "vocab.txt").write_text(
            "\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[SPACE]", *letters]) + "\n")
        proc = run_tool("preprocess_data", "--input", tmp_path / "in.jsonl", "--output-prefix",
                        tmp_path / name / "out", "--tokenizer-type", "CharTokenizer",
                        "--vocab-file", tmp_path / name / "vocab.txt", "--append-eod")
        found = re.search(r"unknown tokens: (\d+) of (\d+) \(([0-9.]+)%\)", proc.stderr)
        assert found, proc.stderr
        unknown, tokens = int(found.group(1)), int(found.group(2))
        assert tokens == total
        assert unknown == (want if name == "part" else 0)
        assert ("WARNING" in proc.stderr) == (name == "part" and want > 0.01 * total)

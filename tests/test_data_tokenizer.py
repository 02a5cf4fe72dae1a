"""Tokenizers against Hugging Face references, on vocabularies our trainer made."""
import argparse
import json
import os
import unicodedata

import numpy as np
import pytest

from datautil import random_text, random_unicode, run_tool, training_corpus
from megatron.common.errors import ConfigError, DataError
from megatron.config.validation import derive_vocab
from megatron.tokenizer import build_tokenizer, vocab_size_with_padding
from megatron.tokenizer.bpe_trainer import count_words, train_bpe


@pytest.fixture(scope="module")
def vocabs(tmp_path_factory):
    """One corpus, three trained vocabularies (through the tool, as a user would)."""
    root = tmp_path_factory.mktemp("vocabs")
    corpus = training_corpus(root / "corpus.jsonl")
    run_tool("train_tokenizer", "--type", "gpt2", "--input", corpus, "--vocab-size", 1500,
             "--output-dir", root / "gpt2")
    run_tool("train_tokenizer", "--type", "sentencepiece", "--input", corpus, "--vocab-size",
             600, "--output-dir", root / "spm")
    run_tool("train_tokenizer", "--type", "char", "--input", corpus, "--vocab-size", 5000,
             "--output-dir", root / "char")
    return root


def _args(**kw):
    base = dict(tokenizer_type=None, vocab_file=None, merge_file=None, tokenizer_model=None)
    base.update(kw)
    return argparse.Namespace(**base)


def _gpt2(vocabs):
    return build_tokenizer(_args(tokenizer_type="GPT2BPETokenizer",
                                 vocab_file=str(vocabs / "gpt2" / "vocab.json"),
                                 merge_file=str(vocabs / "gpt2" / "merges.txt")))


def test_gpt2_bpe_matches_hf_fast(vocabs, seed):
    from transformers import GPT2TokenizerFast

    ours = _gpt2(vocabs)
    hf = GPT2TokenizerFast(vocab=str(vocabs / "gpt2" / "vocab.json"),
                           merges=str(vocabs / "gpt2" / "merges.txt"))
    assert ours.vocab_size == len(hf)
    rng = np.random.default_rng(seed)
    texts = [random_text(rng, int(rng.integers(1, 300))) for _ in range(150)]
    texts += [random_unicode(rng, int(rng.integers(1, 200))) for _ in range(100)]
    texts += ["", " ", "\n\n\n", "a<|endoftext|>b", "  leading and trailing  \t"]
    expected = hf(texts, add_special_tokens=False)["input_ids"]
    for text, want in zip(texts, expected):
        got = ours.tokenize(text)
        assert got == want, f"ids differ for {text!r}"
        assert ours.detokenize(got) == text  # byte-level BPE is lossless
    assert ours.eod == hf.convert_tokens_to_ids("<|endoftext|>") == ours.vocab_size - 1


def test_bpe_trainer_first_merges_are_the_most_frequent_pairs(seed):
    rng = np.random.default_rng(seed)
    texts = [random_text(rng, 50) for _ in range(60)]
    vocab, merges = train_bpe(texts, 260, min_frequency=1)
    # Brute force: count adjacent byte-character pairs over all pre-tokens, by frequency.
    from megatron.tokenizer.gpt2_bpe import BYTE_ENCODER

    counts = {}
    for word, n in count_words(texts).items():
        chars = [BYTE_ENCODER[b] for b in word.encode("utf-8")]
        for pair in zip(chars, chars[1:]):
            counts[pair] = counts.get(pair, 0) + n
    best = max(counts.values())
    assert counts[merges[0]] == best
    assert len(vocab) == 260 and vocab["<|endoftext|>"] == 259


def test_sentencepiece_matches_hf_t5(vocabs, seed, tmp_path):
    import sentencepiece as spm
    from transformers import T5TokenizerFast

    model = vocabs / "spm" / "spm.model"
    ours = build_tokenizer(_args(tokenizer_type="SentencePieceTokenizer",
                                 tokenizer_model=str(model)))
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "spiece.model").write_bytes(model.read_bytes())
    hf = T5TokenizerFast.from_pretrained(str(tmp_path / "hf"))
    assert ours.vocab_size == len(hf) == 700
    assert (ours.pad, ours.eod) == (hf.pad_token_id, hf.eos_token_id) == (0, 1)
    sentinels = hf.convert_tokens_to_ids([f"<extra_id_{i}>" for i in range(100)])
    assert ours.sentinel_ids == sentinels and sentinels[0] == ours.vocab_size - 1
    rng = np.random.default_rng(seed)
    texts = [random_text(rng, int(rng.integers(1, 200))) for _ in range(100)]
    # The sentencepiece library is the reference for how a .model segments text ...
    sp = spm.SentencePieceProcessor(model_file=str(model))
    for text in texts:
        assert ours.tokenize(text) == sp.encode(text), f"ids differ for {text!r}"
    # ... and HF's (Rust) conversion agrees with it except on combining marks, which its
    # normalizer drops ("\ufb01\u0301" -> "fi"): compare the id layout on text without them.
    plain = ["".join(c for c in t if not unicodedata.combining(c)) for t in texts]
    plain.append("span <extra_id_3> inside")
    expected = hf(plain, add_special_tokens=False)["input_ids"]
    for text, want in zip(plain, expected):
        assert ours.tokenize(text) == want, f"ids differ from HF for {text!r}"
    assert ours.detokenize(ours.tokenize("hello world")) == "hello world"


def test_sentencepiece_without_pad_appends_it_below_the_sentinels(tmp_path, seed):
    import sentencepiece as spm

    rng = np.random.default_rng(seed)
    lines = [random_text(rng, 30) for _ in range(300)]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(
        tmp_path / "m"), vocab_size=1000, hard_vocab_limit=False, pad_id=-1, minloglevel=2)
    n = spm.SentencePieceProcessor(model_file=str(tmp_path / "m.model")).get_piece_size()
    tok = build_tokenizer(_args(tokenizer_type="SentencePieceTokenizer",
                                tokenizer_model=str(tmp_path / "m.model"), vocab_extra_ids=10))
    assert tok.pad == n and tok.vocab_size == n + 11
    assert tok.sentinel_ids == list(range(n + 10, n, -1))
    assert tok.detokenize([tok.pad, tok.sentinel_ids[2]]) == "<pad><extra_id_2>"


def test_char_tokenizer_is_a_per_character_lookup(vocabs, seed):
    path = vocabs / "char" / "vocab.txt"
    tok = build_tokenizer(_args(tokenizer_type="CharTokenizer", vocab_file=str(path)))
    lines = path.read_text(encoding="utf-8").split("\n")[:-1]
    ref = {t: i for i, t in reversed(list(enumerate(lines)))}
    rng = np.random.default_rng(seed)
    text = random_text(rng, 200) + "\u9fa5"  # a character surely missing from the vocab
    want = [ref["[SEP]"] if c == "\n" else ref["[SPACE]"] if c.isspace()
            else ref.get(c, ref["[UNK]"]) for c in text]
    assert tok.tokenize(text) == want
    normalized = "".join("\n" if c == "\n" else " " if c.isspace() else
                         c if c in ref else "[UNK]" for c in text)
    assert tok.detokenize(tok.tokenize(text)) == normalized
    assert (tok.pad, tok.eod) == (ref["[PAD]"], ref["[CLS]"])


def test_padded_vocab_size(seed, vocabs):
    rng = np.random.default_rng(seed)
    for _ in range(200):
        n, div, tp = int(rng.integers(1, 100000)), int(rng.integers(1, 300)), int(
            rng.integers(1, 9))
        want = next(m for m in range(n, n + div * tp + 1) if m % (div * tp) == 0)
        assert vocab_size_with_padding(n, div, tp) == want
    args = _args(tokenizer_type="GPT2BPETokenizer", vocab_file=str(vocabs / "gpt2" / "vocab.json"),
                 merge_file=str(vocabs / "gpt2" / "merges.txt"),
                 make_vocab_size_divisible_by=128, tensor_model_parallel_size=2)
    tok = build_tokenizer(args)
    derive_vocab(args, tok.vocab_size)  # the run configuration derives it, once
    assert args.padded_vocab_size == vocab_size_with_padding(tok.vocab_size, 128, 2)


def test_bad_tokenizer_files_name_the_file(vocabs, tmp_path):
    vocab, merges = vocabs / "gpt2" / "vocab.json", vocabs / "gpt2" / "merges.txt"
    kind = "GPT2BPETokenizer"
    with pytest.raises(DataError, match="nope.json not found"):
        build_tokenizer(_args(tokenizer_type=kind, vocab_file=str(tmp_path / "nope.json"),
                              merge_file=str(merges)))
    other = json.loads(vocab.read_text(encoding="utf-8"))
    other = {t: i for t, i in other.items() if len(t) == 1 or t == "<|endoftext|>"}
    (tmp_path / "small.json").write_text(json.dumps(other), encoding="utf-8")
    with pytest.raises(DataError, match="merges.txt:2: .*different tokenizers"):
        build_tokenizer(_args(tokenizer_type=kind, vocab_file=str(tmp_path / "small.json"),
                              merge_file=str(merges)))
    (tmp_path / "bad.json").write_text("[1, 2", encoding="utf-8")
    with pytest.raises(DataError, match="bad.json is not a JSON vocab"):
        build_tokenizer(_args(tokenizer_type=kind, vocab_file=str(tmp_path / "bad.json"),
                              merge_file=str(merges)))
    with pytest.raises(DataError, match="needs --merge-file"):
        build_tokenizer(_args(tokenizer_type=kind, vocab_file=str(vocab)))
    with pytest.raises(DataError, match="not a sentencepiece model"):
        build_tokenizer(_args(tokenizer_type="SentencePieceTokenizer",
                              tokenizer_model=str(vocab)))
    with pytest.raises(ConfigError, match="not known"):
        build_tokenizer(_args(tokenizer_type="BertWordPiece"))
    assert not os.path.exists(tmp_path / "nope.json")

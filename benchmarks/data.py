#!/usr/bin/env python
"""Data-pipeline benchmark: preprocessing throughput and sample-index build time.

    python benchmarks/data.py [--corpus-mb 8] [--vocab-size 8192] [--workers 2]

1. Preprocess: the demo corpus (tools/make_sample_corpus.py) is tokenized by
   tools/preprocess_data.py with ``--workers`` processes (JSON parsing, our GPT-2 BPE, writing
   the .bin/.idx), against transformers' GPT2TokenizerFast (Rust) batch-encoding the same
   documents, loaded from the same vocab.json/merges.txt (trained here by our trainer).
   Throughput is MB of raw UTF-8 text per second. Target: >= 0.5x the Rust baseline.
2. Sample index: build_sample_idx for ~1e8 tokens in 1e6 documents (sizes uniform in
   [1, 200), a shuffled doc order, seq_length 1024), C++ against the NumPy fallback.
   Target: C++ >= 10x faster.
Each figure is the best of ``--repeats`` runs; both sides of a ratio run in this process.
"""
import argparse
import json
import os
import platform
import shlex
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tools"))

import numpy as np  # noqa: E402

from benchmarks.machine import cpu_model  # noqa: E402


def machine():
    model = cpu_model()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{model}, {cores} cores available, Python {platform.python_version()}, " \
           f"NumPy {np.__version__}"


def best_of(repeats, fn):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def bench_preprocess(tmp, args):
    import make_sample_corpus
    import preprocess_data
    from megatron.tokenizer.bpe_trainer import save_bpe, train_bpe
    from transformers import GPT2TokenizerFast

    corpus = os.path.join(tmp, "corpus.jsonl")
    make_sample_corpus.write_corpus(corpus, args.corpus_mb, 20)
    with open(corpus, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    mb = sum(len(t.encode("utf-8")) for t in texts) / 1e6
    start = time.perf_counter()
    vocab, merges = train_bpe(texts, args.vocab_size)
    train_s = time.perf_counter() - start
    vocab_file, merge_file = save_bpe(vocab, merges, tmp)
    print(f"corpus: {len(texts)} documents, {mb:.2f} MB of text; BPE vocab {len(vocab)} "
          f"trained by megatron/tokenizer/bpe_trainer.py in {train_s:.1f}s")
    pre_args = preprocess_data.get_args([
        "--input", corpus, "--output-prefix", os.path.join(tmp, "out"), "--tokenizer-type",
        "GPT2BPETokenizer", "--vocab-file", vocab_file, "--merge-file", merge_file,
        "--append-eod", "--workers", str(args.workers), "--log-interval", str(10**9)])
    ours = best_of(args.repeats, lambda: preprocess_data.run(pre_args))
    hf = GPT2TokenizerFast(vocab=vocab_file, merges=merge_file)
    rust = best_of(args.repeats, lambda: hf(texts, add_special_tokens=False))
    ratio = (mb / ours) / (mb / rust)
    print(f"preprocess_data.py, {args.workers} workers : {mb / ours:8.2f} MB/s "
          f"({ours:.2f}s, includes JSON parsing and writing .bin/.idx)")
    print(f"GPT2TokenizerFast batch encode : {mb / rust:8.2f} MB/s ({rust:.2f}s, tokenization "
          f"only, Rust threads: {os.environ.get('RAYON_NUM_THREADS', 'default')})")
    print(f"ratio ours / Rust              : {ratio:8.2f}x  (target >= 0.5x: "
          f"{'met' if ratio >= 0.5 else 'NOT met'})")


def bench_index(args):
    from megatron.data import helpers

    if helpers.cpp_module() is None:
        print("C++ helpers unavailable: no index comparison")
        return
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 200, args.docs).astype(np.int32)
    doc_idx = rng.permutation(args.docs).astype(np.int64)
    tokens = int(sizes.sum())
    n = (tokens - 1) // args.seq_length
    out = {}
    times = {impl: best_of(args.repeats, lambda impl=impl: out.__setitem__(
        impl, helpers.build_sample_idx(sizes, doc_idx, args.seq_length, n, impl=impl)))
        for impl in ("cpp", "numpy")}
    assert np.array_equal(out["cpp"], out["numpy"])
    ratio = times["numpy"] / times["cpp"]
    print(f"sample index, {tokens:.3g} tokens, {args.docs:.0e} documents, seq_length "
          f"{args.seq_length}, {n} samples:")
    print(f"  C++ (csrc/data/helpers.cpp)  : {times['cpp'] * 1e3:8.2f} ms")
    print(f"  NumPy fallback (vectorised)  : {times['numpy'] * 1e3:8.2f} ms")
    print(f"  speed-up C++ / NumPy         : {ratio:8.2f}x  (target >= 10x: "
          f"{'met' if ratio >= 10 else 'NOT met'})")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus-mb", type=float, default=8.0)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--docs", type=int, default=10**6)
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print("command:", " ".join(shlex.quote(a) for a in [sys.executable] + sys.argv))
    print("machine:", machine())
    with tempfile.TemporaryDirectory(prefix="bench_data_") as tmp:
        bench_preprocess(tmp, args)
    bench_index(args)


if __name__ == "__main__":
    main()

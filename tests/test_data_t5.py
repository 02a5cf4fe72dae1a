"""T5 span corruption: reconstruction, exact noise amounts, masks vs brute force, errors."""
import argparse

import numpy as np
import pytest
import torch

from megatron.data import indexed_dataset as ids
from megatron.data import t5_dataset as t5
from megatron.common.errors import ConfigError


class _Tok:
    """Minimal tokenizer stand-in: ids 0..999 plain, 1000..1099 sentinels (HF order)."""

    name = "stub"
    pad, eod, vocab_size = 0, 1, 1100
    sentinel_ids = list(range(1099, 999, -1))


def _reconstruct(sample, plan):
    """Merge encoder input and labels back into the raw chunk (brute force, token by token)."""
    sentinel_pos = {s: i for i, s in enumerate(plan["sentinels"].tolist())}
    enc = sample["text_enc"].tolist()
    labels = sample["labels"][sample["loss_mask"] == 1].tolist()
    assert enc[enc.index(plan["eos"])] == plan["eos"] and labels[-1] == plan["eos"]
    spans, current = {}, None
    for tok in labels[:-1]:
        if tok in sentinel_pos:
            current = sentinel_pos[tok]
            spans[current] = []
        else:
            spans[current].append(tok)
    out = []
    for tok in enc[:enc.index(plan["eos"])]:
        out.extend(spans[sentinel_pos[tok]] if tok in sentinel_pos else [tok])
    return out, spans


def test_t5_paper_lengths():
    # T5 paper / random_spans_helper: inputs 512 -> 568 raw tokens, 114 targets.
    assert t5.raw_length_for(512, 0.15, 3.0) == 568
    assert t5.corrupted_lengths(568, 0.15, 3.0) == (85, 28, 512, 114)


def test_span_corruption_round_trip_and_masks(seed):
    rng = np.random.default_rng(seed)
    enc_len = int(rng.integers(16, 300))
    dec_len = t5.corrupted_lengths(t5.raw_length_for(enc_len, 0.15, 3.0), 0.15, 3.0)[3]
    dec_len += int(rng.integers(0, 5))
    plan = t5.make_plan(enc_len, dec_len, _Tok(), 0.15, 3.0)
    raw = rng.integers(2, 1000, plan["raw"])
    sample = t5.make_t5_sample(raw, plan, np.random.default_rng([seed, 0]))
    for key, value in sample.items():
        assert value.dtype == np.int64, key
    rebuilt, spans = _reconstruct(sample, plan)
    assert rebuilt == raw.tolist()
    assert len(spans) == plan["num_spans"]
    assert sum(len(s) for s in spans.values()) == plan["num_noise"]
    assert all(len(s) >= 1 for s in spans.values())
    # Decoder input is the labels shifted right behind pad (HF T5's shift_right).
    n_dec = int(sample["loss_mask"].sum())
    assert sample["text_dec"][0] == plan["pad"]
    assert np.array_equal(sample["text_dec"][1:n_dec], sample["labels"][:n_dec - 1])
    n_enc = int((np.arange(enc_len) < (sample["text_enc"].tolist().index(plan["eos"]) + 1)).sum())
    assert sample["enc_real"].tolist() == [int(i < n_enc) for i in range(enc_len)]
    # The attention masks built from them (on the device in training), brute force: masked
    # unless both positions are real (and, in the decoder, the key is not in the future).
    from megatron.model.t5_model import t5_attention_masks

    masks = t5_attention_masks(torch.from_numpy(sample["enc_real"]).bool()[None],
                               torch.from_numpy(sample["loss_mask"]).bool()[None])
    for mask, (rows, cols, causal) in zip(masks, [(n_enc, n_enc, False), (n_dec, n_dec, True),
                                                  (n_dec, n_enc, False)]):
        assert mask.dtype == torch.bool and mask.shape[:2] == (1, 1)
        mask = mask[0, 0].numpy()
        for i in range(mask.shape[0]):
            for j in range(mask.shape[1]):
                want_masked = not (i < rows and j < cols and (not causal or j <= i))
                assert mask[i, j] == want_masked, (rows, cols, i, j)
    assert np.all(sample["text_enc"][n_enc:] == plan["pad"])
    assert np.all(sample["labels"][n_dec:] == plan["pad"])


def test_noise_mask_statistics(seed):
    rng = np.random.default_rng(seed)
    lengths = []
    for _ in range(300):
        mask = t5.noise_mask(568, 85, 28, rng)
        assert mask.sum() == 85 and not mask[0]
        edges = np.flatnonzero(np.diff(np.concatenate(([0], mask.astype(int), [0]))))
        starts, ends = edges[::2], edges[1::2]
        assert len(starts) == 28
        lengths.extend((ends - starts).tolist())
    assert abs(np.mean(lengths) - 85 / 28) < 1e-9  # mean span length ~3 by construction


def _write(prefix, rng, n_docs):
    builder = ids.MMapIndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(n_docs):
        builder.add_item(rng.integers(2, 1000, int(rng.integers(5, 200))))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


def test_dataset_is_deterministic_per_seed_and_index(tmp_path, seed):
    rng = np.random.default_rng(seed)
    prefix = _write(str(tmp_path / "d"), rng, 80)
    build = lambda s: t5.build_train_valid_test_datasets(  # noqa: E731
        [prefix], "9,1,0", [40, 5, 0], 64, 24, s, _Tok())
    train, valid, test = build(11)
    assert test is None and len(train) >= 40 and len(valid) >= 5
    again = build(11)[0]
    other = build(12)[0]
    a = [train[i] for i in range(10)]
    for i in reversed(range(10)):  # order of access does not matter
        b = again[i]
        assert all(np.array_equal(a[i][k], b[k]) for k in a[i])
        assert a[i]["text_enc"].shape == (64,) and a[i]["enc_real"].shape == (64,)
    assert any(not np.array_equal(a[i]["text_enc"], other[i]["text_enc"]) for i in range(10))


def test_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match="raise it to 114"):
        t5.make_plan(512, 100, _Tok(), 0.15, 3.0)
    no_sentinels = argparse.Namespace(name="GPT2BPETokenizer", pad=0, eod=1, sentinel_ids=[])
    with pytest.raises(ConfigError, match="sentinel tokens.*--vocab-extra-ids"):
        t5.make_plan(512, 128, no_sentinels, 0.15, 3.0)
    few = argparse.Namespace(name="x", pad=0, eod=1, sentinel_ids=[5, 4])
    with pytest.raises(ConfigError, match="raise --vocab-extra-ids to 28"):
        t5.make_plan(512, 128, few, 0.15, 3.0)


def test_batch_benchmark_builds_the_masks_the_dataset_used_to():
    """benchmarks/t5_batch.py asserts, before timing, that the device-built masks equal the
    former per-sample 2-D masks; a tiny run keeps it working."""
    import benchmarks.t5_batch as bench

    bench.main(["--batch", "2", "--enc", "64", "--dec", "24", "--repeats", "1",
                "--device", "cpu"])

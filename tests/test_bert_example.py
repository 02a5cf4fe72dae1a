"""The BERT example (examples/bert/bert_model.py), a masked LM written on the public API: its
batch function masks at random, its MLM head is tied to the word embedding through
megatron.model.lm_head, and it declares a Hugging Face name table.

- the random masking draws the same masks on every stage: pp 2 with 1F1B, interleaved (v 2)
  and ZB-V equal the serial run within 1e-5 over 8 steps and in the evaluation after them
  (tp 2 with sequence parallelism too);
- the 1F1B run trains through a family object built as a family was written before
  ``ModelFamily.supports`` existed (its features are what it provides: pipeline, recompute);
- the pp 2 runs print no "autograd kernel was not registered" warning;
- the tied head's checkpoints resume at pp 1 from pp 2 and from tp 2, continuing the serial
  run, and tools/convert_checkpoint.py converts the pp 2 one to one stage (same tensors; the
  first step from it is the serial run's);
- megatron.model.lm_head's untied and tied heads at tp 2 (with and without sequence
  parallelism) equal F.linear / F.embedding on their whole weights, padded rows at -inf;
- tools/convert_checkpoint.py --family converts transformers' BertForMaskedLM to native and a
  native checkpoint to it: logits within 1e-5 of transformers' at tp 1 and 2 (HF input is
  written as one stage; --target-pp 2 is refused with what to do).
"""
import os

import pytest

from bert_runs import (AUTOGRAD_WARNING, BERT_SPEC, VOCAB, pipelines, serial_and_resumes,
                       tensor_parallel_and_hf)
from harness import run_distributed
from megatron.common.errors import ConfigError

TOL = 1e-5
EXACT = 1e-6  # a resume: float32 rounding of the logged loss only (measured 8e-8)


def _relative(a, b):
    assert len(a) == len(b), (a, b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def _convert(*argv):
    import convert_checkpoint  # tools/, on the path through bert_runs

    convert_checkpoint.main.__wrapped__(list(argv))


def _random_hf(path, seed):
    """A random BertForMaskedLM saved as ``save_pretrained`` does (biases and norms moved off
    0 and 1, so a swapped pair of names would show)."""
    import torch
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(seed)
    model = BertForMaskedLM(BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    model.save_pretrained(path)


def _same_tensors(a, b):
    import torch

    from megatron.checkpoint.native_reader import read_native

    one, other = read_native(a, 4).state, read_native(b).state
    assert sorted(one) == sorted(other)
    return all(torch.equal(one[k], other[k]) for k in one)


@pytest.mark.slow
def test_bert_pipelines_equal_serial_resume_and_convert_to_one_stage(gpt2_data, tmp_path):
    ck = str(tmp_path)
    ranks = run_distributed(pipelines, 2, gpt2_data, ck, timeout=400)
    runs = ranks[-1][0]
    warned = [w for _, rank_warned in ranks for w in rank_warned]
    with open(os.path.join(ck, "pp2", "latest_checkpointed_iteration.txt"), "w") as handle:
        handle.write("4")  # resume from the step-4 checkpoint
    _convert("--input", f"{ck}/pp2", "--output", f"{ck}/pp2_to_pp1", "--target-pp", "1")
    loads = {"from pp2": ["--load", f"{ck}/pp2"],
             "converted": ["--load", f"{ck}/pp2_to_pp1", "--no-load-optim", "--no-load-rng",
                           "--train-iters", "5"]}
    (serial,) = run_distributed(serial_and_resumes, 1, gpt2_data, loads, timeout=300)
    reference = serial["serial"]
    for name in ("pp2 1f1b", "pp2 v2", "pp2 zbv"):
        assert _relative(runs[name], reference) < TOL, (name, runs[name], reference)
    assert not [w for w in warned if AUTOGRAD_WARNING in w], warned
    # steps 5-8 and the evaluation
    assert _relative(serial["from pp2"], reference[4:]) < EXACT, (serial, reference)
    assert _same_tensors(f"{ck}/pp2", f"{ck}/pp2_to_pp1")
    assert serial["converted"][0] == pytest.approx(reference[4], rel=EXACT)


@pytest.mark.slow
def test_bert_tensor_parallel_resumes_and_converts_to_and_from_transformers(
        gpt2_data, tmp_path, seed):
    pytest.importorskip("transformers")
    ck = str(tmp_path)
    _random_hf(f"{ck}/hf", seed)
    from_hf = {"hf": f"{ck}/hf"}
    for tp in (1, 2):
        from_hf[tp] = f"{ck}/from_hf_tp{tp}"
        _convert("--family", BERT_SPEC, "--input", f"{ck}/hf", "--output", from_hf[tp],
                 "--target-tp", str(tp))
    with pytest.raises(ConfigError, match=r"changes in a conversion only to 1.*--load"):
        _convert("--family", BERT_SPEC, "--input", f"{ck}/hf", "--output", f"{ck}/pp2_hf",
                 "--target-pp", "2")  # one stage: a run at any pp loads it
    ranks = run_distributed(tensor_parallel_and_hf, 2, gpt2_data, ck, from_hf, seed,
                            timeout=400)
    losses, errors, (heads, records) = ranks[-1]
    (serial,) = run_distributed(serial_and_resumes, 1, gpt2_data,
                                {"from tp2": ["--load", f"{ck}/tp2"]}, timeout=300)
    reference = serial["serial"]
    assert _relative(losses, reference[:4]) < TOL  # (it stops at step 4)
    assert _relative(serial["from tp2"], reference[4:]) < EXACT, (serial, reference)
    for key, (error, scale) in errors.items():
        assert error < TOL * max(1.0, scale), (key, error, scale)
    assert max(heads.values()) < 1e-6, heads  # lm_head's pieces at tp 2, SP or not
    assert records["linear.weight"][:3] == records["linear.bias"][:3] == \
        records["bias"][:3] == [0, 1, 1]  # split on the vocabulary, marked as its rows

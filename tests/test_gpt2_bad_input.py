"""Bad input to pretrain_gpt2.py: one clear message, non-zero exit, no hang, nothing written."""
import os

import pytest

from gpt2_runs import gpt2_argv, run_script


def _tiny(data, *extra):
    return ["pretrain_gpt2.py", *gpt2_argv(data, "--batch-size", "2", "--train-iters", "2",
                                           *extra)]


def _assert_user_error(result, *phrases):
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    for phrase in phrases:
        assert phrase in result.stderr, (phrase, result.stderr[-3000:])


def test_heads_not_divisible_by_tp_fails_under_torchrun(gpt2_data):
    result = run_script(_tiny(gpt2_data, "--num-attention-heads", "3", "--hidden-size", "36",
                              "--model-parallel-size", "2"), nproc=2)
    assert result.returncode != 0
    assert "--num-attention-heads (3) is not divisible by the tensor-model-parallel size (2)" \
        in result.stderr
    assert "exitcode  : 2" in result.stderr  # the rank exited with the user-error status ...
    # ... with no traceback through our code (torchrun prints its own launcher traceback).
    assert "megatron/" not in result.stderr and 'pretrain_gpt2.py", line' not in result.stderr


def test_sequence_longer_than_positions(gpt2_data):
    result = run_script(_tiny(gpt2_data, "--max-position-embeddings", "16"))
    _assert_user_error(result, "--seq-length (32) is longer than --max-position-embeddings (16)")


def test_missing_data_prefix(gpt2_data, tmp_path):
    result = run_script(_tiny(gpt2_data, "--data-path", str(tmp_path / "nothing_here")))
    _assert_user_error(result, "nothing_here' has no .bin or .idx file")


def test_vocab_file_of_another_tokenizer(gpt2_data, tmp_path):
    chars = tmp_path / "vocab.txt"
    chars.write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n的\n是\n")
    result = run_script(_tiny(gpt2_data, "--vocab-file", str(chars)))
    _assert_user_error(result, str(chars))


@pytest.mark.slow
def test_load_with_a_different_hidden_size_writes_nothing(gpt2_data, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    made = run_script(_tiny(gpt2_data, "--save", ckpt))
    assert made.returncode == 0, made.stderr[-3000:]
    before = sorted(os.walk(ckpt))
    result = run_script(_tiny(gpt2_data, "--hidden-size", "64", "--load", ckpt, "--save", ckpt))
    _assert_user_error(result, "was made for a different model", "hidden_size: checkpoint 32, "
                                                                 "flags 64")
    assert sorted(os.walk(ckpt)) == before

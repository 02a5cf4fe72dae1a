"""Bad input to pretrain_t5.py: one clear message, exit status 2, no hang, before any compute."""
import os

from gpt2_runs import run_script
from t5_runs import t5_argv


def _tiny(data, *extra):
    return ["pretrain_t5.py", *t5_argv(data, "--batch-size", "2", "--train-iters", "2",
                                       *extra)]


def _assert_user_error(result, *phrases):
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "training from iteration" not in result.stdout  # nothing started
    for phrase in phrases:
        assert phrase in result.stderr, (phrase, result.stderr[-3000:])


def test_decoder_too_short_for_the_labels_fails_on_every_rank(t5_data):
    # enc 32 with noise 0.15 and mean span 3 gives 8 label tokens (2 sentinels, 5 noise, eos).
    result = run_script(_tiny(t5_data, "--dec-seq-length", "6", "--model-parallel-size", "2"),
                        nproc=2)
    assert result.returncode != 0
    assert result.stderr.count("--decoder-seq-length 6 is too short") == 2  # both ranks
    assert "raise it to 8" in result.stderr
    assert "exitcode  : 2" in result.stderr
    assert "megatron/" not in result.stderr and 'pretrain_t5.py", line' not in result.stderr


def test_relative_attention_and_length_settings_listed_together(t5_data):
    result = run_script(_tiny(t5_data, "--relative-attention-num-buckets", "32",
                              "--relative-attention-max-distance", "12", "--seq-length", "64"))
    _assert_user_error(result, "invalid T5 configuration",
                       "--relative-attention-max-distance (12) must be larger than the "
                       "exactly-bucketed distances (16 in the decoder)",
                       "--seq-length (64) and --enc-seq-length (32) disagree")


def test_encoder_sample_longer_than_the_data(t5_data):
    # A 1% train split of the sample corpus holds ~2k tokens, one 4096-token encoder sample
    # needs ~4.5k raw tokens (long mean spans keep the sentinels needed under 100).
    result = run_script(_tiny(t5_data, "--enc-seq-length", "4096", "--dec-seq-length", "1024",
                              "--mean-span-length", "8", "--split", "1,99,0"))
    _assert_user_error(result, "--enc-seq-length 4096 needs", "raw tokens per sample but the "
                       "train split of", "shorten the sequences or give more data")


def test_tokenizer_without_sentinels(t5_data, gpt2_data):
    argv = _tiny(t5_data, "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
                 gpt2_data["vocab"], "--merge-file", gpt2_data["merges"])
    result = run_script(argv)
    _assert_user_error(result, "T5 needs sentinel tokens", "GPT2BPETokenizer tokenizer has none",
                       "--tokenizer-type SentencePieceTokenizer")


def test_load_a_checkpoint_of_another_t5_variant(t5_data, tmp_path, seed):
    from t5_hf import make_hf_t5

    from megatron.checkpoint_conversion.t5_convert import T5ConversionRequest, run_t5_conversion

    make_hf_t5(tmp_path / "hf", seed)  # ReLU, tied
    ckpt = str(tmp_path / "ckpt")
    run_t5_conversion(T5ConversionRequest(str(tmp_path / "hf"), ckpt))
    before = sorted(os.walk(ckpt))
    result = run_script(_tiny(t5_data, "--load", ckpt, "--save", ckpt, "--finetune",
                              "--t5-ff", "gated-gelu", "--untie-embeddings"))
    _assert_user_error(result, "was made for a different model",
                       "t5_ff: checkpoint 'relu', flags 'gated-gelu'",
                       "untie_embeddings: checkpoint False, flags True")
    assert sorted(os.walk(ckpt)) == before  # nothing written

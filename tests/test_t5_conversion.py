"""T5 <-> Hugging Face T5ForConditionalGeneration (the reference), and resharding.

- HF -> native at tp = 1 and 2, T5 v1.0 (ReLU, tied + scaled) and v1.1 (gated-GeLU, untied):
  T5Model's logits equal transformers' (max abs < 1e-4, fp32) on fresh random ids with
  padding in both stacks; the padded vocabulary rows give -inf logits.
- native (tp=2, pp=2) -> HF gives back the original tensors bit for bit.
- the tool's bad input exits 2 with a message.
"""
import json
import subprocess
import sys

import pytest
import torch

from harness import run_distributed
from t5_hf import VOCAB, hf_logits, load_into_pipe, make_hf_t5, native_logits, random_batch
from megatron.checkpoint_conversion import safetensors_io
from megatron.checkpoint_conversion.t5_convert import T5ConversionRequest, run_t5_conversion
from megatron.checkpoint_conversion.t5_convert import read_native_t5

TOL = 1e-4
REPO = __import__("os").path.dirname(__import__("os").path.dirname(__file__))


@pytest.mark.parametrize("v1_1", [False, True], ids=["v1.0", "v1.1"])
@pytest.mark.parametrize("tp", [1, 2])
def test_hf_to_native_logits_match_transformers(tmp_path, seed, tp, v1_1):
    model = make_hf_t5(tmp_path / "hf", seed, v1_1)
    out = tmp_path / f"native_tp{tp}"
    run_t5_conversion(T5ConversionRequest(str(tmp_path / "hf"), str(out), tp=tp))
    batch = random_batch(seed)
    expected = hf_logits(model, batch)  # [b, sd, vocab]
    padded = 384 if tp == 1 else 512
    real = batch["dec_real"]
    for logits in map(torch.from_numpy, run_distributed(native_logits, tp, str(out), batch)):
        assert logits.shape == (3, 9, padded)
        err = (logits[..., :VOCAB] - expected)[real].abs().max().item()
        assert err < TOL, f"tp={tp} v1_1={v1_1}: max abs logit difference {err}"
        assert torch.isneginf(logits[..., VOCAB:]).all()  # padded rows take no probability
    saved = read_native_t5(str(out)).args
    assert (saved["padded_vocab_size"], saved["true_vocab_size"]) == (padded, VOCAB)
    assert saved["untie_embeddings"] == v1_1 and saved["t5_ff"] == ("gated-gelu" if v1_1
                                                                   else "relu")


@pytest.mark.parametrize("v1_1", [False, True], ids=["v1.0", "v1.1"])
def test_native_pipeline_layout_to_hf_round_trip_is_exact(tmp_path, seed, v1_1):
    from transformers import T5ForConditionalGeneration

    make_hf_t5(tmp_path / "hf", seed, v1_1)
    native, back = tmp_path / "native", tmp_path / "back"
    run_t5_conversion(T5ConversionRequest(str(tmp_path / "hf"), str(native), tp=2, pp=2))
    run_t5_conversion(T5ConversionRequest(str(native), str(back), output_format="hf"))
    original = safetensors_io.load_file(str(tmp_path / "hf" / "model.safetensors"))
    converted = safetensors_io.load_file(str(back / "model.safetensors"))
    if not v1_1:
        original.pop("lm_head.weight", None)  # tied: HF may or may not store it
    assert sorted(converted) == sorted(original)
    for key, tensor in original.items():
        assert torch.equal(converted[key], tensor), key
    config = json.loads((back / "config.json").read_text())
    reloaded = T5ForConditionalGeneration.from_pretrained(str(back))
    assert reloaded.config.scale_decoder_outputs == (not v1_1)
    assert config["feed_forward_proj"] == ("gated-gelu" if v1_1 else "relu")
    # dropout_rate survives both ways (make_hf_t5 saves 0.0; the old default was 0.1).
    saved = read_native_t5(str(native)).args
    assert (saved["hidden_dropout"], saved["attention_dropout"]) == (0.0, 0.0)
    assert config["dropout_rate"] == 0.0 and reloaded.config.dropout_rate == 0.0


@pytest.mark.parametrize("rate", [0.0, 0.25])
def test_dropout_rate_maps_to_both_native_dropouts_and_back(rate):
    from megatron.checkpoint_conversion import t5_hf

    hf = {"num_layers": 1, "d_model": 8, "num_heads": 2, "d_kv": 4, "d_ff": 16,
          "vocab_size": 32, "dropout_rate": rate}
    args = t5_hf.hf_args(hf)
    assert (args["hidden_dropout"], args["attention_dropout"]) == (rate, rate)
    assert t5_hf.hf_args({k: v for k, v in hf.items() if k != "dropout_rate"})[
        "hidden_dropout"] == 0.1  # HF's own default when the config omits it


def test_tool_rejects_a_layout_that_does_not_divide(tmp_path, seed):
    make_hf_t5(tmp_path / "hf", seed)
    result = subprocess.run(
        [sys.executable, "tools/convert_checkpoint_t5.py", "--input", str(tmp_path / "hf"),
         "--output", str(tmp_path / "out"), "--target-tensor-parallel-size", "3"],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "attention heads (4) is not divisible by --target-tensor-parallel-size 3" \
        in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("v1_1", [False, True], ids=["v1.0", "v1.1"])
def test_pipeline_layout_loads_strictly_into_t5_model_pipe(tmp_path, seed, v1_1):
    # 2 layers per stack on 4 stages: relative-bias copies and the tied embedding (v1.0) sit
    # on several stages, and every stage's file must hold exactly its module's tensors.
    make_hf_t5(tmp_path / "hf", seed, v1_1)
    out = tmp_path / "native"
    run_t5_conversion(T5ConversionRequest(str(tmp_path / "hf"), str(out), tp=1, pp=4))
    keys = run_distributed(load_into_pipe, 4, str(out))
    assert "encoder_relative_bias.weight" in keys[0] and "encoder_relative_bias.weight" in keys[1]
    assert "decoder_relative_bias.weight" in keys[2] and "decoder_relative_bias.weight" in keys[3]
    assert ("tied_modules.embed.word_embeddings.weight" in keys[3]) == (not v1_1)
    assert ("7.lm_head.weight" in keys[3]) == v1_1

"""HF GPT-2 <-> native conversion against transformers' GPT2LMHeadModel (the reference).

- HF -> native at tp = 1 and 2: GPT2Model's logits equal GPT2LMHeadModel's (max abs < 1e-4,
  fp32) on fresh random ids; the padded vocabulary rows give -inf logits.
- native -> HF gives back the original tensors bit for bit, and transformers loads it.
- The safetensors wrapper round-trips through the library and reports a bad file clearly.
"""
import json
import os

import pytest
import torch

from gpt2_hf import hf_logits, make_hf_gpt2, native_logits
from harness import run_distributed
from megatron.checkpoint_conversion import ConversionRequest, read_native, run_conversion
from megatron.checkpoint_conversion import safetensors_io
from megatron.common.errors import CheckpointError

TOL = 1e-4
VOCAB = 300  # pads to 384 at tp=1 and 512 at tp=2 with --make-vocab-size-divisible-by 128


@pytest.fixture
def hf_model(tmp_path, seed):
    return make_hf_gpt2(tmp_path / "hf", seed, VOCAB), tmp_path / "hf"


@pytest.mark.parametrize("tp", [1, 2])
def test_hf_to_native_logits_match_transformers(hf_model, tmp_path, seed, tp):
    model, hf_dir = hf_model
    out = tmp_path / f"native_tp{tp}"
    run_conversion(ConversionRequest(str(hf_dir), str(out), tp=tp))
    ids = torch.randint(0, VOCAB, (3, 20), generator=torch.Generator().manual_seed(seed))
    per_rank = run_distributed(native_logits, tp, str(out), ids)
    expected = hf_logits(model, ids)  # [b, s, vocab]
    padded = 384 if tp == 1 else 512
    for logits in map(torch.from_numpy, per_rank):  # every tp rank has the gathered logits
        assert logits.shape == (3, 20, padded)
        err = (logits[..., :VOCAB] - expected).abs().max().item()
        assert err < TOL, f"tp={tp}: max abs logit difference {err}"
        # Padded rows take no probability: their logits are -inf (the model knows VOCAB).
        assert torch.isneginf(logits[..., VOCAB:]).all()
    saved = read_native(str(out)).args
    assert (saved["padded_vocab_size"], saved["true_vocab_size"]) == (padded, VOCAB)


def test_native_to_hf_round_trip_is_exact(hf_model, tmp_path, seed):
    from transformers import GPT2LMHeadModel

    model, hf_dir = hf_model
    native, back = tmp_path / "native", tmp_path / "back"
    run_conversion(ConversionRequest(str(hf_dir), str(native), tp=2, pp=2))
    run_conversion(ConversionRequest(str(native), str(back), output_format="hf"))
    original = safetensors_io.load_file(str(hf_dir / "model.safetensors"))
    converted = safetensors_io.load_file(str(back / "model.safetensors"))
    original.pop("lm_head.weight", None)  # tied: HF may or may not store it
    assert sorted(converted) == sorted(original)
    for key, tensor in original.items():
        assert torch.equal(converted[key], tensor), key
    config = json.loads((back / "config.json").read_text())
    for key in ("n_layer", "n_embd", "n_head", "n_positions", "vocab_size", "eos_token_id"):
        assert config[key] == getattr(model.config, key), key
    reloaded = GPT2LMHeadModel.from_pretrained(str(back)).eval()
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(seed + 1))
    assert torch.equal(hf_logits(reloaded, ids), hf_logits(model, ids))


def test_hf_n_inner_and_epsilon_are_carried(tmp_path, seed):
    model = make_hf_gpt2(tmp_path / "hf", seed, 100, n_inner=96, layer_norm_epsilon=1e-3)
    run_conversion(ConversionRequest(str(tmp_path / "hf"), str(tmp_path / "native")))
    args = read_native(str(tmp_path / "native")).args
    assert (args["ffn_hidden_size"], args["layernorm_epsilon"]) == (96, 1e-3)
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(seed))
    logits = torch.from_numpy(run_distributed(native_logits, 1, str(tmp_path / "native"), ids)[0])
    assert (logits[..., :100] - hf_logits(model, ids)).abs().max().item() < TOL


def test_safetensors_io_round_trip_and_bad_file(tmp_path, seed):
    """The wrapper writes what the library reads (non-contiguous tensors included) and
    reports a truncated file as a CheckpointError naming it."""
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(seed)
    tensors = {"f32": torch.randn(5, 3, generator=g).t(), "bf16": torch.randn(7, generator=g).bfloat16(),
               "f16": torch.randn(2, 2, 3, generator=g).half(), "i64": torch.arange(5),
               "bool": torch.rand(9, generator=g) > 0.5, "scalar": torch.tensor(2.5)}
    out = tmp_path / "ours.safetensors"
    safetensors_io.save_file(tensors, str(out), metadata={"format": "pt"})
    # the mode of any file this process creates (the library alone makes it 0600)
    beside = tmp_path / "beside.json"
    beside.write_text("{}")
    assert os.stat(out).st_mode & 0o777 == os.stat(beside).st_mode & 0o777
    for loaded in (load_file(str(out)), safetensors_io.load_file(str(out))):
        assert sorted(loaded) == sorted(tensors)
        for key, tensor in tensors.items():
            assert loaded[key].dtype == tensor.dtype and torch.equal(loaded[key], tensor), key
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(out.read_bytes()[:20])
    with pytest.raises(CheckpointError, match="bad.safetensors"):
        safetensors_io.load_file(str(bad))

"""Greedy T5 decoding: KV cache == full recompute == transformers' generate, at tp 1 and 2."""
import pytest
import torch

from harness import run_distributed
from t5_hf import make_hf_t5, native_generate, random_batch

NEW_TOKENS = 12


@pytest.mark.parametrize("tp,v1_1", [(1, False), (2, True)], ids=["tp1-v1.0", "tp2-v1.1"])
def test_cached_greedy_equals_recompute_and_hf_generate(tmp_path, seed, tp, v1_1):
    model = make_hf_t5(tmp_path / "hf", seed, v1_1)
    batch = random_batch(seed, b=4, se=15)
    enc, enc_real = batch["enc"], batch["enc_real"]
    with torch.no_grad():
        expected = model.generate(input_ids=enc, attention_mask=enc_real.long(),
                                  max_new_tokens=NEW_TOKENS, do_sample=False, num_beams=1,
                                  decoder_start_token_id=0, eos_token_id=1, pad_token_id=0)
    for cached, full in run_distributed(native_generate, tp, str(tmp_path / "hf"), enc,
                                        enc_real, NEW_TOKENS):
        cached, full = torch.from_numpy(cached), torch.from_numpy(full)
        assert torch.equal(cached, full), (cached, full)
        assert cached[:, 0].eq(0).all() and cached.shape[1] > 2
        assert torch.equal(cached, expected), (cached, expected)

"""examples/llama/convert_llama.py --from-hf: a transformers LlamaForCausalLM directory becomes a
native checkpoint of the example at a given (tp, pp, v), cut by the sharding record of the
example's layers at that layout. A run at that layout loads it (--load, --finetune) and its
first loss is transformers' loss on the same batch (to 1e-5); native -> HF -> native gives
back the same tensors."""
import dataclasses
import os

import pytest
import torch

from harness import run_distributed
from llama_runs import llama_argv

pytest.importorskip("transformers")

#: the llama_argv model (4 layers, hidden 32, 4 heads, 2 kv heads, ffn 48, 32 positions)
SIZES = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32, rms_norm_eps=1e-5,
             rope_theta=10000.0, tie_word_embeddings=False)


def _tokenizer_vocab(data):
    from megatron.checkpoint.vocab_padding import tokenizer_from_args

    return tokenizer_from_args({"tokenizer_type": "GPT2BPETokenizer", "vocab_file": data["vocab"],
                                "merge_file": data["merges"]}).vocab_size


def _random_hf(path, vocab, seed):
    """A random tiny LlamaForCausalLM saved as HF saves it; returns its state dict."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, **SIZES))
    with torch.no_grad():  # norms away from 1, so a wrong norm weight shows
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _first_loss_and_transformers(argv, hf_dir):
    """Rank body: one step of the example from the converted checkpoint; on the last stage,
    (the step's loss, transformers' mean loss on the micro-batches that step read)."""
    from transformers import LlamaForCausalLM

    from llama_model import LLAMA
    from megatron.families import decoder_lm
    from megatron.training import pretrain

    seen = []

    def recording_batch_fn(cfg, tokenizer):
        inner = decoder_lm.make_batch_fn(cfg, tokenizer)

        def batch(raw):
            inputs, labels = inner(raw)
            seen.append((inputs[0].clone(), labels[0].clone(), labels[1].clone()))
            return inputs, labels

        return batch

    family = dataclasses.replace(LLAMA, make_batch_fn=recording_batch_fn)
    state = pretrain(family=family, argv=argv)
    if not state.losses:
        return None  # not the last stage
    gas = 8 // 2  # llama_argv: global batch 8, micro batch 2, dp 1
    hf = LlamaForCausalLM.from_pretrained(hf_dir).eval()
    losses = []
    with torch.no_grad():
        for tokens, labels, loss_mask in seen[:gas]:
            logits = hf(tokens).logits  # [b, s, v]
            each = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                                                     reduction="none")
            losses.append((each * loss_mask.flatten()).sum() / loss_mask.sum())
    return state.losses[0], sum(losses).item() / gas, len(seen)


@pytest.mark.parametrize("layout", [
    pytest.param("tp2 pp2", marks=[pytest.mark.slow, pytest.mark.exhaustive]), "pp2 v2"])
def test_from_hf_trains_at_that_layout_with_transformers_first_loss(gpt2_data, tmp_path, seed,
                                                                   layout):
    from convert_llama import main

    tp, pp, vpp = {"tp2 pp2": (2, 2, 1), "pp2 v2": (1, 2, 2)}[layout]
    hf_dir, ckpt = str(tmp_path / "hf"), str(tmp_path / "native")
    _random_hf(hf_dir, _tokenizer_vocab(gpt2_data), seed)
    assert main(["--from-hf", hf_dir, "--output", ckpt, "--tensor-model-parallel-size", str(tp),
                 "--pipeline-model-parallel-size", str(pp),
                 "--virtual-pipeline-model-parallel-size", str(vpp),
                 "--make-vocab-size-divisible-by", "64"]) == 0
    assert sorted(os.listdir(os.path.join(ckpt, "iter_0000000"))) == \
        ["manifest.json"] + [f"mp_rank_{t:02d}_{p:03d}" for t in range(tp) for p in range(pp)]
    argv = llama_argv(gpt2_data, tp, pp, "--load", ckpt, "--finetune", vpp=vpp, steps=1)
    ranks = run_distributed(_first_loss_and_transformers, tp * pp, argv, hf_dir, timeout=300)
    ours, theirs, batches = ranks[-1]
    assert batches >= 4 and theirs > 1.0  # a real loss over the step's 4 micro-batches
    assert abs(ours - theirs) < 1e-5, (layout, ours, theirs)


def test_native_to_hf_to_native_gives_the_same_tensors(tmp_path, seed):
    from transformers import LlamaForCausalLM

    from convert_llama import export_hf, import_hf
    from llama_model import LLAMA, from_hf
    from megatron.checkpoint.native_reader import read_native

    vocab = 100
    original = _random_hf(str(tmp_path / "hf"), vocab, seed)
    import_hf(str(tmp_path / "hf"), str(tmp_path / "a"), tp=2, pp=2, divisible_by=64)
    first = read_native(str(tmp_path / "a"))
    config = LLAMA.config_from_saved(first.args)
    expected = from_hf(original, config)
    assert sorted(first.state) == sorted(expected)
    for key, tensor in expected.items():  # vocabulary rows unpadded by the record
        assert torch.equal(first.state[key], tensor), key
    assert first.args["padded_vocab_size"] == 128 and first.args["true_vocab_size"] == vocab

    export_hf(str(tmp_path / "a"), str(tmp_path / "hf2"))
    back = LlamaForCausalLM.from_pretrained(str(tmp_path / "hf2")).state_dict()
    assert sorted(back) == sorted(original)
    for key, tensor in original.items():
        assert torch.equal(back[key], tensor), key

    import_hf(str(tmp_path / "hf2"), str(tmp_path / "b"), tp=1, pp=2, vpp=2, schedule="zbv")
    again = read_native(str(tmp_path / "b"))
    assert sorted(again.state) == sorted(first.state)
    for key, tensor in first.state.items():
        assert torch.equal(again.state[key], tensor), key
    # the V: rank 0 holds the first and the last chunk (embedding and head), rank 1 the middle
    chunks = {p: sorted({spec[4] for spec in r.values()}) for p, r in again.stage_records.items()}
    assert chunks == {0: [0, 3], 1: [1, 2]}
    assert "0.embed_tokens.weight" in again.stage_records[0]
    assert "6.lm_head.weight" in again.stage_records[0]


def test_from_hf_refusals(tmp_path, seed):
    import json

    from convert_llama import import_hf
    from megatron.common.errors import ConfigError

    _random_hf(str(tmp_path / "hf"), 100, seed)
    with pytest.raises(ConfigError, match="num_key_value_heads \\(2\\) is not divisible by "
                                          "--tensor-model-parallel-size 4"):
        import_hf(str(tmp_path / "hf"), str(tmp_path / "x"), tp=4)
    with pytest.raises(ConfigError, match="need at least 8 layers"):
        import_hf(str(tmp_path / "hf"), str(tmp_path / "x"), pp=4, vpp=2)
    config_file = tmp_path / "hf" / "config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "attention_bias": True}))
    with pytest.raises(ConfigError, match="cannot be converted: attention_bias True"):
        import_hf(str(tmp_path / "hf"), str(tmp_path / "x"))
    assert not (tmp_path / "x").exists()

"""Which key map a checkpoint is read with: the run's family's (``cfg.model_family.keys``)
when there is one; else the family the files record, else GPT-2's or T5's only when the
saved args and the tensor names are theirs. Another model's checkpoint is never taken for a
GPT-2 (it used to be, and failed with "the checkpoint mixes files from different runs")."""
import dataclasses
import os
import types

import pytest
import torch

from megatron.checkpoint import gpt2_keys, t5_keys
from megatron.checkpoint.format import checkpoint_name, write_tracker
from megatron.checkpoint.key_maps import key_map_for
from megatron.common.errors import CheckpointError

ARGS = {"num_layers": 1, "hidden_size": 8, "num_attention_heads": 2, "ffn_hidden_size": 16,
        "padded_vocab_size": 16, "max_position_embeddings": 8,
        "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1}
#: a Llama-style model's names (examples/llama), split like its mpu layers: [dim, stride,
#: vocab rows, stage, chunk] as the sharding record writes them
RECORD = {"0.embed_tokens.weight": [0, 1, 1, 0, 0], "1.input_layernorm.weight": [-1, 1, 0, 0, 0],
          "1.q_proj.weight": [0, 1, 0, 0, 0], "1.o_proj.weight": [1, 1, 0, 0, 0]}


def _llama_like(root, seed, record, family=None):
    """A tp=2 checkpoint of a model that is not GPT-2 (names of the Llama example), written
    by hand: random shards, the replicated norm equal on both ranks; optionally with the
    sharding record and a family name. Returns the whole tensors."""
    g = torch.Generator().manual_seed(seed)
    full = {"0.embed_tokens.weight": torch.randn(16, 8, generator=g),
            "1.input_layernorm.weight": torch.rand(8, generator=g),
            "1.q_proj.weight": torch.randn(8, 8, generator=g),
            "1.o_proj.weight": torch.randn(8, 8, generator=g)}
    for tp_rank in range(2):
        model = {k: (v if RECORD[k][0] < 0 else v.chunk(2, RECORD[k][0])[tp_rank]).clone()
                 for k, v in full.items()}
        state = {"iteration": 4, "args": dict(ARGS), "model": model}
        if record:
            state.update(sharding=RECORD, family=family)
        path = checkpoint_name(root, 4, tp_rank, 0)
        os.makedirs(os.path.dirname(path))
        torch.save(state, path)
    write_tracker(root, 4)
    return full


def test_gpt2_matches_only_gpt2_names():
    llama = list(RECORD)
    assert gpt2_keys.matches(ARGS) and gpt2_keys.matches(ARGS, [gpt2_keys.WORD_EMBEDDINGS])
    assert gpt2_keys.matches(ARGS, ["tied_modules.embed.word_embeddings.weight", "1.x"])
    assert not gpt2_keys.matches(ARGS, llama)
    assert not gpt2_keys.matches({**ARGS, "t5_ff": "gelu"})  # a T5's args
    assert t5_keys.matches({**ARGS, "t5_ff": "gelu"}, [t5_keys.WORD_EMBEDDINGS])
    assert not t5_keys.matches({**ARGS, "t5_ff": "gelu"}, llama)
    with pytest.raises(CheckpointError, match="not a GPT-2 or T5 checkpoint.*0.embed_tokens"):
        key_map_for(ARGS, names=llama)
    with pytest.raises(CheckpointError, match="no checkpoint key map for model family 'llama'"):
        key_map_for(ARGS, names=llama, saved_family="llama")


def test_the_run_familys_key_map_is_the_one_used():
    from megatron.families.gpt2 import FAMILY as GPT2

    mine = types.ModuleType("my_keys")  # a key map of the user's: any module with the API
    mine.__dict__.update({k: v for k, v in vars(gpt2_keys).items() if not k.startswith("__")})
    mine.NAME, mine.FAMILY = "Mine", "mine"
    family = dataclasses.replace(GPT2, name="mine", keys=mine)
    assert key_map_for(ARGS, family) is mine  # not GPT-2's, though the args match both
    assert key_map_for(ARGS, GPT2, [gpt2_keys.WORD_EMBEDDINGS]) is gpt2_keys
    with pytest.raises(CheckpointError, match="holds a T5 checkpoint.*trains the 'gpt2'"):
        key_map_for({**ARGS, "t5_ff": "gelu"}, GPT2, [t5_keys.WORD_EMBEDDINGS])
    with pytest.raises(CheckpointError, match="'llama' model family has no key map.*tp=2"):
        key_map_for(ARGS, dataclasses.replace(GPT2, name="llama", keys=None), list(RECORD))


def test_another_models_checkpoint_is_not_read_as_gpt2(tmp_path, seed):
    from megatron.checkpoint.native_reader import read_native

    _llama_like(str(tmp_path / "plain"), seed, record=False)
    with pytest.raises(CheckpointError) as error:
        read_native(str(tmp_path / "plain"))
    assert "not a GPT-2 or T5 checkpoint" in str(error.value)
    assert "0.embed_tokens.weight" in str(error.value)
    assert "mixes files" not in str(error.value)
    # a provider run (no family name) that recorded its sharding: read by the record
    full = _llama_like(str(tmp_path / "provider"), seed, record=True)
    read = read_native(str(tmp_path / "provider"))
    assert sorted(read.state) == sorted(full)
    for key, tensor in full.items():
        assert torch.equal(read.state[key], tensor), key
    with pytest.raises(CheckpointError, match="not GPT-2 or T5 .*provider run.*not 'gpt2'"):
        read_native(str(tmp_path / "provider"), family="gpt2")


class _Cfg:
    """What a resume at another layout reads of a run configuration (tp=1 here)."""

    def __init__(self, family):
        self.model_family, self.family = family, family.name
        self.model = types.SimpleNamespace(true_vocab_size=None, padded_vocab_size=16)
        self.parallel = types.SimpleNamespace(tp=1, pp=1, vpp=1, pipeline_schedule="1f1b")

    def get(self, key, default=None):
        return {**ARGS, "tensor_model_parallel_size": 1}.get(key, default)


def test_a_resume_without_record_or_key_map_says_so(tmp_path, seed):
    from llama_runs import train_llama  # noqa: F401  (puts examples/llama on the path)
    from llama_model import LLAMA

    from megatron.checkpoint.layout_change import read_at_new_layout
    from megatron.families.gpt2 import FAMILY as GPT2

    root = str(tmp_path / "ck")
    _llama_like(root, seed, record=False)
    with pytest.raises(CheckpointError) as error:
        read_at_new_layout(root, 4, _Cfg(LLAMA), load_optim=False)
    assert "'llama' model family has no key map" in str(error.value)
    assert "tp=2, pp=1" in str(error.value) and "mixes files" not in str(error.value)
    with pytest.raises(CheckpointError, match="tensors that are not a GPT-2's .*0.embed_tokens"):
        read_at_new_layout(root, 4, _Cfg(GPT2), load_optim=False)

"""A name table whose HF tensor has another shape than ours: BART's ``final_logits_bias`` is
``[1, V]`` where the model's ``VocabParallelBias`` is ``[V]``. Declared
(``hf_table.LeadingOne``), it converts both ways, HF -> native at tp 2 -> HF, every tensor
equal; undeclared, HF -> native is refused with a message that names the shape mismatch
(both shapes, both names, the fix), and a tensor whose vocabulary rows alone differ keeps the
vocabulary advice. The family: the BERT example with its output bias named as BART names
its own (tests/bert_runs.py's example, examples/bert/bert_model.py)."""
import dataclasses
import os

import pytest
import torch

import bert_runs  # noqa: F401 (examples/bert and tools/ on the path)
from megatron.checkpoint_conversion import hf_io
from megatron.checkpoint_conversion.hf_table import LeadingOne
from megatron.common.errors import CheckpointError

HERE = os.path.abspath(__file__)
VOCAB = 100


def _family(bias_name):
    from bert_model import BERT, HF_NAMES

    def names(args):
        out = HF_NAMES.names(args)
        ours = next(k for k, v in out.items() if v == "cls.predictions.bias")
        return dict(out, **{ours: bias_name})

    table = dataclasses.replace(HF_NAMES, names=names, tied={
        "cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight"})
    return dataclasses.replace(BERT, name="bert_bart_bias", hf_names=table)


#: The bias declared with its leading 1, and the same table without it.
DECLARED = _family(LeadingOne("final_logits_bias"))
UNDECLARED = _family("final_logits_bias")


def _random_hf(path, seed, vocab_rows=VOCAB):
    """A random BertForMaskedLM's tensors, its output bias as ``final_logits_bias`` [1, V]
    (every tensor moved off its init, so a swapped pair would show)."""
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(seed)
    config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=64,
                        max_position_embeddings=32)
    state = {k: v + 0.05 * torch.randn_like(v) for k, v in
             BertForMaskedLM(config).state_dict().items() if "position_ids" not in k}
    state["final_logits_bias"] = state.pop("cls.predictions.bias").unsqueeze(0)  # [1, V]
    for key in ("cls.predictions.decoder.weight", "cls.predictions.decoder.bias"):
        state.pop(key, None)  # tied: from_pretrained ties them back
    words = "bert.embeddings.word_embeddings.weight"
    state[words] = state[words][:vocab_rows]
    hf_io.write_hf_dir(path, dict(config.to_dict(), architectures=["BertForMaskedLM"]),
                       {k: v.contiguous() for k, v in state.items()})
    return state


def _convert(*argv):
    import convert_checkpoint

    convert_checkpoint.main.__wrapped__(list(argv))


def test_a_leading_one_converts_both_ways_and_an_undeclared_one_is_named(tmp_path, seed):
    pytest.importorskip("transformers")
    hf = _random_hf(str(tmp_path / "hf"), seed)
    _convert("--family", f"{HERE}:DECLARED", "--input", str(tmp_path / "hf"), "--output",
             str(tmp_path / "native"), "--target-tp", "2")
    from megatron.checkpoint.native_reader import read_native

    native = read_native(str(tmp_path / "native"))
    bias = [v for k, v in native.state.items() if k.endswith(".bias") and v.shape == (VOCAB,)]
    assert len(bias) == 1 and torch.equal(bias[0], hf["final_logits_bias"][0])
    _convert("--family", f"{HERE}:DECLARED", "--input", str(tmp_path / "native"),
             "--output", str(tmp_path / "back"), "--output-format", "hf")
    back = hf_io.read_weights(str(tmp_path / "back"))
    assert back["final_logits_bias"].shape == (1, VOCAB)
    assert sorted(back) == sorted(hf) and all(torch.equal(back[k], hf[k]) for k in hf)

    with pytest.raises(CheckpointError) as refused:
        _convert("--family", f"{HERE}:UNDECLARED", "--input", str(tmp_path / "hf"),
                 "--output", str(tmp_path / "refused"))
    message = str(refused.value)
    ours = [k for k in native.state if native.state[k] is bias[0]][0]
    assert f"final_logits_bias has shape [1, {VOCAB}] but the model's {ours} has [{VOCAB}]" \
        in message, message
    assert "LeadingOne('final_logits_bias')" in message and "shape [1, 100]" in message
    assert "--true-vocab-size" not in message and not os.path.exists(tmp_path / "refused")

    _random_hf(str(tmp_path / "short"), seed, vocab_rows=VOCAB - 4)
    with pytest.raises(CheckpointError, match=r"bert\.embeddings\.word_embeddings\.weight has "
                                              r"96 vocabulary rows, the config\.json's "
                                              r"vocab_size is 100"):
        _convert("--family", f"{HERE}:DECLARED", "--input", str(tmp_path / "short"),
                 "--output", str(tmp_path / "refused2"))

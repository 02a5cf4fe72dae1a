"""The Llama example (examples/llama/llama_model.py) trained by pretrain(): every layout
equals the serial run, and a checkpoint saved at one layout resumes at another, moved by the
sharding the checkpoint records (the example has no key map)."""
import os

import pytest

from harness import run_distributed
from llama_runs import llama_argv, train_llama

STEPS, AT = 8, 4
#: name -> (tp, pp, vpp, dp, extra flags)
LAYOUTS = {
    "tp2 sp recompute": (2, 1, 1, 1, ("--sequence-parallel", "--checkpoint-activations")),
    "pp2 dp2": (1, 2, 1, 2, ()),
    "pp2 v2": (1, 2, 2, 1, ()),
    "tp2 pp2 sp recompute": (2, 2, 1, 1, ("--sequence-parallel", "--checkpoint-activations")),
}


def _relative(a, b):
    assert len(a) == len(b), (a, b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def _run(data, layout, *extra):
    tp, pp, vpp, dp, flags = LAYOUTS[layout]
    ranks = run_distributed(train_llama, tp * pp * dp,
                            llama_argv(data, tp, pp, *flags, *extra, vpp=vpp, steps=STEPS),
                            timeout=300)
    return ranks[-1]


def _same_weights_at_every_layout(tmp_path, names):
    """Each layout's step-4 checkpoint, merged by its record, is the same whole model."""
    import torch

    from megatron.checkpoint.native_reader import read_native

    from megatron.common.errors import CheckpointError

    fulls = [read_native(str(tmp_path / n.replace(" ", "_")), 4).state for n in names]
    with pytest.raises(CheckpointError, match="holds a 'llama' model, not 'gpt2'.*convert_llama"):
        read_native(str(tmp_path / names[0].replace(" ", "_")), 4, family="gpt2")  # the tool
    assert len(fulls[0]) == 4 * 9 + 3  # 4 layers of 9 tensors, embedding, norm, head
    for name, full in zip(names[1:], fulls[1:]):
        assert sorted(full) == sorted(fulls[0]), name
        for key, tensor in full.items():
            assert torch.allclose(tensor, fulls[0][key], rtol=1e-5, atol=1e-6), (name, key)


def _exported_to_hf(tmp_path, name):
    """examples/llama/convert_llama.py writes a directory HF loads, holding the weights."""
    import torch

    transformers = pytest.importorskip("transformers")
    from convert_llama import main
    from megatron.checkpoint.native_reader import read_native

    ckpt, out = str(tmp_path / name.replace(" ", "_")), str(tmp_path / "hf")
    assert main(["--load", ckpt, "--output", out, "--iteration", "4"]) == 0
    hf = transformers.LlamaForCausalLM.from_pretrained(out).state_dict()
    full = read_native(ckpt, 4).state
    assert torch.equal(hf["model.layers.3.self_attn.k_proj.weight"],
                       full["4.k_proj.weight"])
    assert torch.equal(hf["lm_head.weight"], full["6.lm_head.weight"])  # unpadded rows


@pytest.mark.slow
def test_every_layout_equals_serial_and_resumes_at_another(gpt2_data, tmp_path):
    (serial,) = run_distributed(train_llama, 1, llama_argv(gpt2_data, 1, 1, steps=STEPS),
                                timeout=300)
    names = list(LAYOUTS)
    for name in names:
        ckpt = str(tmp_path / name.replace(" ", "_"))
        losses = _run(gpt2_data, name, "--save", ckpt, "--save-interval", str(AT))
        assert _relative(losses, serial) < 1e-5, (name, losses, serial)
        with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as handle:
            handle.write(str(AT))  # resume from the step-4 checkpoint
    _same_weights_at_every_layout(tmp_path, names)
    _exported_to_hf(tmp_path, names[-1])
    for i, saved in enumerate(names):
        at = names[(i + 1) % len(names)]
        resumed = _run(gpt2_data, at, "--load", str(tmp_path / saved.replace(" ", "_")))
        assert _relative(resumed, serial[AT:]) < 1e-5, (saved, at, resumed, serial[AT:])


def test_logits_and_generation_equal_transformers_llama_at_tp_1_and_2(seed):
    pytest.importorskip("transformers")
    from llama_runs import hf_logit_errors

    for per_tp in run_distributed(hf_logit_errors, 2, seed, timeout=180):
        assert sorted(per_tp) == [1, 2]
        for tp, (into_ours, into_hf, scale, same_text) in per_tp.items():
            assert scale > 0.1  # logits of random weights, not zeros
            assert into_ours < 1e-5 and into_hf < 1e-5, (tp, into_ours, into_hf)
            assert same_text, tp  # greedy generation: the same 8 tokens as HF's generate


def test_compile_takes_the_familys_layers_one_graph_each(seed):
    from llama_runs import compile_counts

    ((compiled, graphs, breaks),) = run_distributed(compile_counts, 1, seed, timeout=180)
    assert (compiled, graphs, breaks) == (3, 1, 0)

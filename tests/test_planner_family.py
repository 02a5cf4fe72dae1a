"""The planner for any family: tools/plan_layout.py takes a family by import path
(``--family examples.llama.llama_model:LLAMA``), and the memory model describes it from
the family's own description of its layers (megatron/memory/describe.py; the Llama
example's: RMSNorm, SwiGLU, grouped-query SDPA attention with rotary positions, no biases,
no dropout, an untied output layer). Its predictions are held to what the example's
layers really keep, with the memory-peak test's method (tests/test_memory_peak.py): what
one micro-batch saves (saved-tensor hooks) and the whole peak of a real training step
through tds's pipeline engine (tests/peak_tracker.py), each rank within 5%."""
import json
import os
import random
import subprocess
import sys

import pytest

from harness import run_distributed

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAMILY = "examples.llama.llama_model:LLAMA"
TOL = 0.05


def test_plan_layout_ranks_a_family_given_by_import_path(tmp_path):
    config = tmp_path / "llama.yaml"
    config.write_text("num_layers: 8\nhidden_size: 1024\nnum_attention_heads: 16\n"
                      "num_key_value_heads: 4\nffn_hidden_size: 2816\nseq_length: 2048\n"
                      "max_position_embeddings: 2048\nbatch_size: 1\nglobal_batch_size: 64\n"
                      "lr: 3.0e-4\ntrain_iters: 100\nbf16: true\n"
                      "tokenizer_type: GPT2BPETokenizer\n")
    out = subprocess.run([sys.executable, os.path.join(REPO, "tools", "plan_layout.py"),
                          "--config", str(config), "--family", FAMILY, "--gpus", "8",
                          "--gpu-memory", "24GiB", "--json"], cwd=REPO, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "PYTHONPATH": REPO})
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["family"] == "llama" and plan["layouts"]
    speeds = [x["tokens_per_gpu_s"] for x in plan["layouts"]]
    assert speeds == sorted(speeds, reverse=True)
    for x in plan["layouts"]:  # tp splits the 4 key-value heads; nothing over 20 GiB
        assert 4 % x["tp"] == 0 and x["peak_bytes"] <= plan["usable_bytes"]
    assert plan["config_layout"]["peak_bytes"] > 0


def test_an_import_path_that_is_not_a_family_is_refused():
    from megatron.common.errors import ConfigError
    from megatron.families import load_family

    with pytest.raises(ConfigError, match="examples.llama.llama_model has no 'NOPE'"):
        load_family("examples.llama.llama_model:NOPE")
    with pytest.raises(ConfigError, match=r"LlamaConfig is not a megatron.families.ModelFamily "
                                          r"\(its type: type\)"):
        load_family("examples.llama.llama_model:LlamaConfig")


def _base(micro, layers):
    return ["--num-layers", str(layers), "--hidden-size", "64", "--num-attention-heads", "4",
            "--num-key-value-heads", "2", "--ffn-hidden-size", "160", "--seq-length", "64",
            "--max-position-embeddings", "64", "--batch-size", str(micro), "--train-iters",
            "2", "--lr", "1e-3", "--gas", "4"]


def measure(family, activation_layouts, peak_layouts, vocab, seed):
    """Rank body: both measurements in one launch."""
    from memory_peak_runs import measure_peaks
    from memory_runs import measure_activations

    return (measure_activations(family, activation_layouts, seed),
            measure_peaks(peak_layouts, vocab, seed, family))


def test_the_llama_examples_memory_is_predicted(capsys):
    micro = random.choice([1, 2])
    tp_sp = ["--model-parallel-size", "2", "--pipe-parallel-size", "2", "--sequence-parallel"]
    activations = [_base(micro, 4), _base(micro, 4) + ["--model-parallel-size", "2"],
                   _base(micro, 4) + ["--bf16"],  # autocast: each projection's input copy
                   _base(micro, 4) + ["--pipe-parallel-size", "4"]]
    peaks = {"tp2 pp2 SP": _base(micro, 4) + tp_sp,
             "pp4 v2": _base(micro, 8) + ["--pipe-parallel-size", "4",
                                          "--virtual-pipeline-model-parallel-size", "2"],
             "bf16 pp2 dp2, recompute": _base(micro, 4) + [
                 "--pipe-parallel-size", "2", "--bf16", "--checkpoint-activations"]}
    results = run_distributed(measure, 4, FAMILY, activations, list(peaks.values()), 1024,
                              random.randrange(2**31), timeout=600)
    worst = {"activations": 0.0, "peak": 0.0}
    for rank, (acts, stage_peaks) in enumerate(results):
        for r in acts:
            error = r["predicted"] / r["measured"] - 1
            assert abs(error) <= TOL, (rank, micro, r)
            worst["activations"] = max(worst["activations"], abs(error), key=abs)
        for name, r in zip(peaks, stage_peaks):
            pred = r["predicted"]
            assert r["kept_by_runner"]["peak"] == 0
            assert abs(pred["peak"] / r["peak"] - 1) <= TOL, (name, rank, micro, r)
            assert r["states"]["weights"] == pred["states"]["weight_bytes"], (name, rank)
            worst["peak"] = max(worst["peak"], abs(pred["peak"] / r["peak"] - 1))
    with capsys.disabled():
        print(f"Llama example (micro-batch {micro}): largest |error| {worst}")


def test_an_encoder_decoder_that_is_not_t5_is_told_it_has_no_description(tmp_path):
    """No generic encoder-decoder description exists (only T5's, read from T5's settings):
    a family naming one gets the reason, at start-up as a line and from the planner as its
    refusal, not a T5 model silently missing its settings."""
    import dataclasses

    from megatron.common.errors import ConfigError
    from megatron.families import load_family
    from megatron.memory.describe import describe

    with pytest.raises(ConfigError, match=r"describes T5's encoder-decoder only \('t5'"):
        describe("encoder-decoder", None)
    llama = load_family(FAMILY)
    family = dataclasses.replace(llama, name="bart_like", memory_model="encoder-decoder")
    globals()["BART_LIKE"] = family
    config = tmp_path / "tiny.yaml"
    config.write_text("num_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\n"
                      "seq_length: 64\nbatch_size: 1\nglobal_batch_size: 8\n")
    sys.path.insert(0, os.path.join(REPO, "tools"))
    import plan_layout

    with pytest.raises(ConfigError, match=r"memory model 'encoder-decoder': the memory model "
                                          r"describes T5's encoder-decoder only"):
        plan_layout.main(["--config", str(config), "--family", f"{__name__}:BART_LIKE",
                          "--gpus", "8"])

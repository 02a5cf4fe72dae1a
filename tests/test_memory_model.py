"""The memory model (megatron/memory) against bytes measured on CPU ranks (gloo).

Activations: what one micro-batch's forward saves for the backward on each rank, counted
with ``torch.autograd.graph.saved_tensors_hooks`` (each storage once, parameters
excluded), at several layouts in one launch, next to the model's per-stage figure; the
stage's in-flight count multiplies both sides (the schedule's action lists, checked
against 1F1B's min(p - r, m) here).
"""
import random

import pytest

from harness import run_distributed
from memory_runs import measure_activations, measure_states

TOL = 0.05
SELECTIVE = ["--recompute-granularity", "selective"]


def _report(name, errors):
    """Print the largest relative error (docs/memory.md quotes it: pytest -s)."""
    worst = max(errors, key=abs)
    print(f"{name}: {len(errors)} rank-layouts, largest relative error {worst:+.2%}")


def _gpt2_base(micro):
    return ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "32", "--max-position-embeddings", "32", "--batch-size",
            str(micro), "--gas", "4", "--train-iters", "1", "--lr", "1e-3",
            # SDPA's CPU kernel has no dropout (PyTorch falls back to its math path)
            "--attention-dropout", "0"]


def _gpt2_layouts(micro):
    base = _gpt2_base(micro)
    return [base,
            base + ["--model-parallel-size", "2"],
            base + ["--model-parallel-size", "2", "--sequence-parallel"],
            base + ["--pipe-parallel-size", "4"],  # first, two middle and last stages
            base + ["--model-parallel-size", "2", "--pipe-parallel-size", "2"],
            base + ["--attention-backend", "unfused", "--attention-dropout", "0.1"],
            base + ["--checkpoint-activations"],
            base + ["--checkpoint-activations", "--model-parallel-size", "2",
                    "--sequence-parallel"],
            base + ["--bf16"],
            base[:-2] + ["--model-parallel-size", "2"],  # SDPA's math path on the CPU
            base[:-2] + ["--bf16"],
            # selective recompute: q, k, v and the context kept, the core's s x s recomputed
            base + ["--attention-backend", "unfused", "--attention-dropout", "0.1",
                    "--model-parallel-size", "2", "--sequence-parallel"] + SELECTIVE,
            base[:-2] + ["--bf16"] + SELECTIVE,  # the math path's core, recomputed
            # block: the first of each stage's 2 layers keeps its input
            base + ["--pipe-parallel-size", "2", "--recompute-granularity", "full",
                    "--recompute-method", "block"]]


@pytest.mark.slow  # ~10-15 s on 2 shared cores: 14 layouts x 4 ranks
def test_gpt2_activations_match_saved_tensors():
    micro = random.choice([1, 2, 3])
    seed = random.randrange(2**31)
    results = run_distributed(measure_activations, 4, "gpt2", _gpt2_layouts(micro), seed,
                              timeout=300)
    stages_seen, errors = set(), []
    for rank, per_layout in enumerate(results):
        for r in per_layout:
            measured = r["measured"] * r["in_flight"]
            predicted = r["predicted"] * r["in_flight"]
            assert r["measured"] > 0
            assert abs(predicted - measured) <= TOL * measured, (rank, micro, r)
            errors.append(predicted / measured - 1)
            if "--pipe-parallel-size 4" in r["argv"]:
                stages_seen.add(r["stage"])
                assert r["in_flight"] == min(4 - r["stage"], 4), r
    assert stages_seen == {0, 1, 2, 3}
    _report(f"GPT-2 activations (micro-batch {micro})", errors)


def test_in_flight_counts_follow_the_schedules():
    from megatron.memory.schedule import in_flight

    p = random.randint(2, 6)
    m = random.randint(1, 12)
    assert in_flight(p, m) == [min(p - r, m) for r in range(p)]
    # interleaving holds more (smaller) chunks: Megatron-LM's warm-up + 1 when p divides m
    counts = in_flight(p, 2 * p, 2)
    assert counts == [min(2 * (p - r - 1) + p + 1, 4 * p) for r in range(p)]


def _t5_layouts(micro):
    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--kv-channels", "16", "--ffn-hidden-size", "128", "--encoder-seq-length", "32",
            "--dec-seq-length", "16", "--seq-length", "32", "--max-position-embeddings", "32",
            "--batch-size", str(micro), "--gas", "4", "--train-iters", "1", "--lr", "1e-3",
            "--attention-dropout", "0"]
    return [base,
            base + ["--model-parallel-size", "2"],
            base + ["--model-parallel-size", "2", "--sequence-parallel"],
            base + ["--pipe-parallel-size", "4"],  # embedding+enc, enc, dec, dec+head
            base + ["--attention-backend", "unfused", "--attention-dropout", "0.1"],
            base + ["--checkpoint-activations"],
            base[:-2] + ["--pipe-parallel-size", "2"]]  # attention dropout: math path


def test_t5_activations_match_saved_tensors():
    micro = random.choice([1, 2, 3])
    seed = random.randrange(2**31)
    results = run_distributed(measure_activations, 4, "t5", _t5_layouts(micro), seed,
                              timeout=300)
    errors = []
    for rank, per_layout in enumerate(results):
        for r in per_layout:
            measured = r["measured"] * r["in_flight"]
            predicted = r["predicted"] * r["in_flight"]
            assert r["measured"] > 0
            assert abs(predicted - measured) <= TOL * measured, (rank, micro, r)
            errors.append(predicted / measured - 1)
    _report(f"T5 activations (micro-batch {micro})", errors)


@pytest.mark.slow  # ~10 s: 9 backends built and stepped on 4 ranks
def test_gpt2_model_states_and_engine_activations_after_a_real_step():
    """Weights, gradients (every storage a gradient lands in) and optimizer tensors (all
    the optimizer reaches: moments, ZeRO's fp32 partition) on each rank after one real step,
    DDP against the pipeline engine and ZeRO-1; on pipeline stages also the most activation
    bytes alive at once in the real engine (saved by its forward passes, freed by its
    backward passes: the schedule's in-flight count included, with and without
    recompute), each next to the model's figure."""
    micro = random.choice([1, 2])
    base = _gpt2_base(micro)[:-2] + ["--gas", "2"]
    pipe4, pipe2 = ["--pipe-parallel-size", "4", "--gas", "4"], \
        ["--model-parallel-size", "2", "--pipe-parallel-size", "2", "--gas", "4"]
    layouts = [base,
               base + ["--model-parallel-size", "2"],
               base + pipe4,
               base + pipe2,
               base + pipe4 + ["--checkpoint-activations"],
               base + pipe2 + ["--checkpoint-activations", "--sequence-parallel"],
               base + ["--deepspeed", "--zero-stage", "1"],
               base + ["--deepspeed", "--zero-stage", "1", "--model-parallel-size", "2"],
               base + ["--pipe-parallel-size", "2", "--zero-stage", "1"]]
    results = run_distributed(measure_states, 4, "gpt2", layouts, random.randrange(2**31),
                              timeout=300)
    errors = {"model states": [], "engine in-flight activations": []}
    for rank, per_layout in enumerate(results):
        for r in per_layout:
            for what, measured, predicted in zip(r["what"], r["measured"], r["predicted"]):
                assert measured > 0
                assert abs(predicted - measured) <= TOL * measured, (rank, what, r)
                kind = "engine in-flight activations" if what == "in-flight activations" \
                    else "model states"
                errors[kind].append(predicted / measured - 1)
    for kind, values in errors.items():
        _report(f"GPT-2 {kind} (micro-batch {micro})", values)

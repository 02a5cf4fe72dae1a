"""benchmarks/compiled_step.py's counts of the compiled GPT-2 step hold issue 42's CPU bounds.

A 2-layer GPT-2 (the counts per layer do not depend on the width), bf16 autocast and fused
AdamW as on a GPU, tp = pp = 1, against the plain GPT-2 compiled whole with clipping at 1.0:
two compiled-graph calls per step (the model with its loss, forward and backward), kernels
launched outside compiled graphs at most 1.5x the plain model's, as many GEMMs, no graph
break, nothing compiled after the warm-up; the loss path moves at most 1.2x the bytes of a
compiled ``F.cross_entropy``, and less than the eager loss. The per-layer compile (before
issue 42) is measured too: one region per layer, which the check tells apart.
"""
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _counts():
    sys.path.insert(0, REPO)
    from benchmarks import compiled_step

    return compiled_step.main(["--layers", "2", "--hidden", "64", "--heads", "4", "--bf16",
                               "--kinds", "compile,layers,plain", "--loss-shape", "256",
                               "4096"])


@pytest.mark.slow
@pytest.mark.exhaustive  # ~100 s on a cold Inductor cache; the GPU's proxy, run with the GPU issue
def test_compiled_step_counts_meet_the_cpu_bounds():
    from harness import run_distributed

    results, loss = run_distributed(_counts, 1, timeout=900)[0]
    ours, layers, plain = results["compile"], results["layers"], results["plain"]
    assert ours["compiled graph calls"] == plain["compiled graph calls"] == 2, results
    assert layers["compiled graph calls"] == 2 * 2  # each layer forward and backward
    assert ours["kernels outside compiled graphs"] <= 1.5 * plain["kernels outside compiled graphs"]
    assert ours["GEMM calls"] == plain["GEMM calls"] > 0
    assert ours["graph breaks"] == ours["graphs compiled after warm-up"] == 0
    assert loss["ours compiled"] <= 1.2 * loss["F.cross_entropy compiled"], loss
    assert loss["ours compiled"] < loss["ours eager"], loss


def _t5_counts():
    sys.path.insert(0, REPO)
    from benchmarks import compiled_step

    return compiled_step.main(["--model", "t5", "--layers", "2", "--hidden", "64", "--heads",
                               "4", "--seq", "32", "--dec-seq", "8", "--ff", "128", "--bf16",
                               "--kinds", "compile,hf"])[0]


@pytest.mark.exhaustive  # 60-120 s on a cold Inductor cache: two T5s compiled; T5's compiled
# training is held to eager in the default run by test_compile_regions
def test_compiled_t5_step_counts_are_within_transformers_compiled_t5():
    """Issue 43's CPU bounds: against transformers' T5ForConditionalGeneration compiled whole at
    the same sizes, compiled-graph calls, kernels launched outside compiled graphs and Python
    calls per step at most 1.2x; no call of a norm operator inside a compiled graph."""
    from harness import run_distributed

    results = run_distributed(_t5_counts, 1, timeout=900)[0]
    ours, hf = results["compile"], results["hf"]
    for name in ("compiled graph calls", "kernels outside compiled graphs", "Python calls"):
        assert ours[name] <= 1.2 * hf[name], (name, ours[name], hf[name])
    assert ours["compiled graph calls"] == 2 and ours["graph breaks"] == 0, ours
    assert ours["norm custom-op calls inside compiled graphs"] == 0, ours

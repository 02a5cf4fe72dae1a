"""Under --compile the FP8 casts and amax reductions are inside the compiled graphs:
benchmarks/compiled_step.py's counts of a 2-layer GPT-2 step in FP8 (each recipe) against
the same step in bf16. The same compiled-graph calls (2: the model with its loss, forward and
backward), no graph break, nothing compiled after the warm-up, as many GEMMs (FP8's
``_scaled_mm`` counted with them), and not one kernel outside the graphs that bf16 does not
have. docs/benchmarks.md has the 24-layer figures; this holds them at 2 layers."""
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _counts(recipe):
    sys.path.insert(0, REPO)
    from benchmarks import compiled_step

    return compiled_step.main(["--layers", "2", "--hidden", "64", "--heads", "4", "--bf16",
                               "--kinds", "compile,fp8", "--fp8", recipe, "--loss-shape",
                               "256", "4096"])[0]


@pytest.mark.slow
@pytest.mark.exhaustive  # two compiled GPT-2s per recipe (the default run trains FP8 compiled)
@pytest.mark.parametrize("recipe", ["hybrid-tensorwise", "e4m3-rowwise"])
def test_compiled_fp8_step_launches_nothing_outside_the_graphs_that_bf16_does_not(recipe):
    from harness import run_distributed

    results = run_distributed(_counts, 1, recipe, timeout=1800)[0]
    bf16, fp8 = results["compile"], results["fp8"]
    assert fp8["compiled graph calls"] == bf16["compiled graph calls"] == 2, results
    assert fp8["graph breaks"] == fp8["graphs compiled after warm-up"] == 0, results
    assert fp8["GEMM calls"] == bf16["GEMM calls"] > 0, results
    assert fp8["kernels outside compiled graphs"] == bf16["kernels outside compiled graphs"]

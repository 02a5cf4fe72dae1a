"""FP8 training end to end on the real corpus (the gpt2_data fixture): tiny GPT-2 (and the
Llama example), bf16 around the FP8 GEMMs, dropout 0.

Tolerances (fp8_runs.py). The default run trains 8 steps: every FP8 curve within 2% of the
bf16 run's final loss at every step (measured: 0.01-0.2%), no NaN / inf, and not the bf16
curve itself (FP8 really ran); tp 2 (with and without sequence parallelism) within 1e-3 of tp
1 per step; a ZB-V run saved half-way and resumed gives the uninterrupted losses exactly
(dynamic scaling keeps no state). Under -m exhaustive, 300 steps (GPT-2 and the Llama
example, each recipe, tp 2 + SP, pp 2 ZB-V, --compile): there two runs' per-step losses part
as their weights do, bf16 against bf16 at tp 2 by 2.0% of the final loss at the worst step,
so the curves are compared as 25-step means, within 3% of the bf16 final loss (bf16 at tp 2:
1.0%); tp 2 against tp 1 per step over the first 8 steps as in the default run, within
max(1e-3, 4 x bf16's own tp-2 difference), and the 20-step difference printed: FP8 amplifies
bf16's rounding of tp 2's partial sums where a value sits on a float8 rounding boundary, so
by step 20 such runs part by 1.2e-3 - 3.5e-3 while bf16's own tp 2 stays at 3.4e-5. The
scales themselves agree across the tp ranks exactly (tests/test_fp8_layers.py).
"""
import os

import pytest

from fp8_runs import (TP_TOL, curve_problems, gpt2_fp8_argv, llama_fp8_argv, relative,
                      train_runs, window_problems)
from harness import run_distributed
from precision import requires_ds_bf16

STEPS = 8
#: (recipe, extra flags) of the tp-1 launch the other tests compare with (FP8 under
#: --compile: the layers' compiled forms in tests/test_fp8_layers.py and
#: test_fp8_compiled_counts.py; whole runs in the exhaustive 300-step test below).
TP1_RUNS = ((None, ()), ("e4m3-tensorwise", ()), ("hybrid-rowwise", ()))

pytestmark = pytest.mark.xdist_group("fp8_training")  # one worker: the tp-1 curves once


@pytest.fixture(scope="module")
def tp1_curves(gpt2_data):
    """{(recipe, extra): per-step losses} of TP1_RUNS, in one launch."""
    runs = [gpt2_fp8_argv(gpt2_data, r, STEPS, 1, 1, *extra) for r, extra in TP1_RUNS]
    out = run_distributed(train_runs, 1, "gpt2", runs, timeout=900)[0]
    return dict(zip(TP1_RUNS, out))


def _finite_and_close(curves, bf16, names):
    problems = []
    for name in names:
        problems += curve_problems(str(name), curves[name], bf16)
        if curves[name] == bf16:
            problems.append(f"{name}: the bf16 curve exactly (FP8 did not run)")
    return problems


@pytest.mark.slow
def test_fp8_tracks_bf16(tp1_curves):
    """tensorwise e4m3 and rowwise hybrid against bf16."""
    bf16 = tp1_curves[(None, ())]
    assert not _finite_and_close(tp1_curves, bf16, TP1_RUNS[1:])


@pytest.mark.slow
def test_fp8_at_tp2_with_sequence_parallel_equals_tp1(gpt2_data, tp1_curves):
    layouts = (("e4m3-tensorwise", ()), ("hybrid-rowwise", ("--sequence-parallel",)))
    runs = [gpt2_fp8_argv(gpt2_data, r, STEPS, 2, 1, *extra) for r, extra in layouts]
    per_rank = run_distributed(train_runs, 2, "gpt2", runs, timeout=900)
    bf16 = tp1_curves[(None, ())]
    for rank, curves in enumerate(per_rank):
        for (recipe, extra), losses in zip(layouts, curves):
            where = f"rank {rank} {recipe} tp 2 {' '.join(extra)}"
            assert not curve_problems(where, losses, bf16)
            error = relative(losses, tp1_curves[(recipe, ())])
            assert error <= TP_TOL, f"{where}: {error:.2e} from tp 1 in FP8"


@pytest.mark.slow
@pytest.mark.precision
@requires_ds_bf16
def test_fp8_pipeline_zbv_tracks_bf16_and_resumes_exactly(gpt2_data, tmp_path):
    """pp 2 under ZB-V (deferred FP8 weight GEMMs, DeepSpeed's bf16 optimizer): the bf16 ZB-V
    curve within tolerance; saved half-way and resumed, the same losses as uninterrupted."""
    ckpt, at = str(tmp_path / "ckpt"), STEPS // 2
    zbv = ("--pipeline-schedule", "zbv")
    bf16_argv = gpt2_fp8_argv(gpt2_data, None, STEPS, 1, 2, *zbv, layers=4)
    fp8_argv = gpt2_fp8_argv(gpt2_data, "hybrid-tensorwise", STEPS, 1, 2, *zbv, layers=4)
    bf16, full = run_distributed(train_runs, 2, "gpt2",
                                 [bf16_argv, [*fp8_argv, "--save", ckpt, "--save-interval",
                                              str(at)]], timeout=900)[-1]
    assert not curve_problems("fp8 zbv", full, bf16) and full != bf16
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as handle:
        handle.write(str(at))
    resumed = run_distributed(train_runs, 2, "gpt2", [[*fp8_argv, "--load", ckpt]],
                              timeout=900)[-1][0]
    assert resumed == full[at:], (resumed, full[at:])


# ------------------------------------------------------------------ the 300-step curves
LONG = 300
RECIPES = ("e4m3-tensorwise", "hybrid-tensorwise", "e4m3-rowwise", "hybrid-rowwise")
#: Steps over which tp 2 is held to tp 1 per step, as the default test holds them. Further
#: on FP8 amplifies bf16's rounding of tp 2's partial sums (two bf16 partials all-reduced
#: against tp 1's one fp32 sum rounded once) wherever an element sits on a float8 rounding
#: boundary: by step 20 such runs part by 1.2e-3 - 3.5e-3 (GPT-2: the hybrid recipes, e5m2
#: gradients; the Llama example: all four) while bf16's own tp 2 stays at 3.4e-5; over the
#: 8 steps GPT-2's are at 1.7e-5 - 5.3e-5 (printed by this test,
#: docs/measurements/training.md).
TP_STEPS = STEPS
TP_SHOWN = 20


@pytest.mark.slow
@pytest.mark.exhaustive
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_fp8_300_steps_every_recipe_tp1_and_tp2_sp(family, gpt2_data):
    """Every recipe at tp 1 and at tp 2 with sequence parallelism against bf16 over 300
    steps (25-step means within 3% of the bf16 final loss, no NaN / inf); over the first 8
    steps tp 2 against tp 1 per step within max(1e-3, 4 x bf16's own tp-2 difference)."""
    argv = gpt2_fp8_argv if family == "gpt2" else llama_fp8_argv
    recipes = (None,) + RECIPES
    tp1 = run_distributed(train_runs, 1, family, [argv(gpt2_data, r, LONG) for r in recipes],
                          timeout=3600)[0]
    tp2 = run_distributed(train_runs, 2, family,
                          [argv(gpt2_data, r, LONG, 2, 1, "--sequence-parallel")
                           for r in recipes], timeout=3600)[0]
    bf16 = tp1[0]
    floor = relative(tp2[0][:TP_STEPS], bf16[:TP_STEPS])
    problems = window_problems("bf16 tp 2 + SP", tp2[0], bf16)
    for recipe, one, two in zip(recipes[1:], tp1[1:], tp2[1:]):
        problems += window_problems(f"{recipe} tp 1", one, bf16)
        problems += window_problems(f"{recipe} tp 2 + SP", two, bf16)
        error = relative(two[:TP_STEPS], one[:TP_STEPS])
        print(f"{family} {recipe}: tp 2 from tp 1 over {TP_STEPS} steps {error:.2e}, over "
              f"{TP_SHOWN} {relative(two[:TP_SHOWN], one[:TP_SHOWN]):.2e} (bf16's own "
              f"{relative(tp2[0][:TP_SHOWN], bf16[:TP_SHOWN]):.2e})")
        if error > max(TP_TOL, 4 * floor):
            problems.append(f"{recipe}: tp 2 {error:.2e} from tp 1 (bf16's own {floor:.2e})")
    assert not problems, problems


@pytest.mark.slow
@pytest.mark.exhaustive
@pytest.mark.precision
@requires_ds_bf16
def test_fp8_300_steps_pipeline_zbv_and_compile(gpt2_data):
    """pp 2 ZB-V (each recipe) against bf16 ZB-V, and --compile against eager bf16, over 300
    steps (the same tolerance)."""
    zbv = ("--pipeline-schedule", "zbv")
    recipes = (None,) + RECIPES
    pipe = run_distributed(train_runs, 2, "gpt2",
                           [gpt2_fp8_argv(gpt2_data, r, LONG, 1, 2, *zbv, layers=4)
                            for r in recipes], timeout=3600)[0]
    compiled = run_distributed(train_runs, 1, "gpt2",
                               [gpt2_fp8_argv(gpt2_data, r, LONG, 1, 1, *extra) for r, extra in
                                ((None, ()), ("hybrid-tensorwise", ("--compile",)),
                                 ("e4m3-rowwise", ("--compile",)))], timeout=3600)[0]
    problems = []
    for recipe, curve in zip(RECIPES, pipe[1:]):
        problems += window_problems(f"{recipe} pp 2 zbv", curve, pipe[0])
    for recipe, curve in zip(("hybrid-tensorwise", "e4m3-rowwise"), compiled[1:]):
        problems += window_problems(f"{recipe} --compile", curve, compiled[0])
    assert not problems, problems

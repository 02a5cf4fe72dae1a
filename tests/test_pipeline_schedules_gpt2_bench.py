"""benchmarks/pipeline_schedules_gpt2.py, short: real GPT-2 chunks on 4 gloo ranks under
1F1B, interleaved, ZB-H1 and ZB-V; every schedule's measured step against the simulator's
prediction from the costs measured in the same run, and the zero-bubble schedules' measured
bubble below 1F1B's.

Tolerance (docs/measurements/pipeline_schedules.md, "Measured with real GPT-2 chunks"): at this size
on the shared 2-core VM, loaded by other jobs (load average 4-35), measured / predicted was
0.98-1.25 over repeated runs, highest for interleaved and ZB-V: the runner's own time per
action and a blocked rank's wake-up on a busy machine are not in the prediction, and those
two send about twice 1F1B's messages. MEAS_OVER_PRED keeps a margin on both sides for a
busier machine; it catches a runner that loses the pipelining (2-3 x the prediction) or a
simulator that no longer models the runner, not a 10-20% slowdown (the benchmark's own
band, 0.90-1.20 at its larger size, is for that). Each schedule's row is its
least-contended run of two (the benchmark's rule), so one burst of another job's work
does not decide the bubble comparison.
"""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))

from pipeline_schedules_gpt2 import data_flags, parse_args, run, table  # noqa: E402

MEAS_OVER_PRED = (0.85, 1.40)
#: the short run: 8 layers of hidden 384 (chunks of 1 or 2 layers), 4 micro-batches of 2 x 64
#: tokens, two runs per schedule in turns, each one warm-up and 3 timed steps (37-50 s here)
FLAGS = ["--pp", "4", "--micro-batches", "4", "--layers", "8", "--hidden", "384",
         "--heads", "8", "--seq", "64", "--micro-batch", "2", "--rounds", "2",
         "--warmup", "1", "--steps", "3", "--timeout", "600"]


@pytest.mark.slow
@pytest.mark.exhaustive  # a 40-50 s timing that stops the other workers: -m exhaustive
@pytest.mark.alone  # a timing: neighbours in the same test run would skew it
def test_gpt2_schedules_match_the_simulator_and_zero_bubble_beats_1f1b(gpt2_data):
    opts = parse_args(FLAGS)
    rows = {r["name"]: r for r in run(opts, data_flags(gpt2_data["prefix"], gpt2_data["vocab"],
                                                       gpt2_data["merges"]))}
    report = "\n".join(table(list(rows.values())))
    assert set(rows) == {"1f1b", "interleaved", "zb-h1", "zbv"}, report
    for name, r in rows.items():
        ratio = r["ratio"]
        assert MEAS_OVER_PRED[0] < ratio < MEAS_OVER_PRED[1], f"{name}: {ratio:.3f}\n{report}"
    for name in ("zb-h1", "zbv"):
        assert rows[name]["bubble"] < rows["1f1b"]["bubble"], f"{name}\n{report}"
        assert rows[name]["pred_bubble"] < rows["1f1b"]["pred_bubble"], f"{name}\n{report}"

"""Activation peaks per pipeline rank under the interleaved schedule, measured in the real
engine (tds's interleaved runner, CPU, gloo): each chunk forward's saved tensors counted
with saved-tensor hooks until its backward, the largest sum alive at once, against the
memory model's walk of the same action list with each chunk charged its own bytes (the
embedding in chunk 0, the head and loss in the last chunk)."""
import random

import pytest

from harness import run_distributed
from memory_peak_runs import measure_interleaved

TOL = 0.05


def _base(micro, layers):
    return ["--num-layers", str(layers), "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "32", "--max-position-embeddings", "32", "--batch-size",
            str(micro), "--train-iters", "1", "--lr", "1e-3", "--attention-dropout", "0"]


@pytest.mark.slow  # ~15 s: two interleaved engines built and stepped on 4 ranks
def test_interleaved_activation_peak_per_rank_matches_the_engine():
    micro = random.choice([1, 2])
    layouts = [_base(micro, 8) + ["--pipe-parallel-size", "4", "--gas", "4",
                                  "--virtual-pipeline-model-parallel-size", "2"],
               _base(micro, 4) + ["--model-parallel-size", "2", "--pipe-parallel-size", "2",
                                  "--gas", "4", "--virtual-pipeline-model-parallel-size", "2",
                                  "--sequence-parallel"]]
    results = run_distributed(measure_interleaved, 4, layouts, random.randrange(2**31),
                              timeout=300)
    errors = []
    for rank, per_layout in enumerate(results):
        for r in per_layout:
            assert r["measured"] > 0, r
            assert abs(r["predicted"] - r["measured"]) <= TOL * r["measured"], (rank, r)
            errors.append(r["predicted"] / r["measured"] - 1)
    # the old figure (a rank's mean chunk x its in-flight count) spread the head over the
    # last rank's chunks and overstated it beyond the tolerance (~+10% at pp 4 here)
    last = [r for per in results for r in per if r["stage"] == max(x["stage"] for x in per)]
    assert any(r["averaged"] > (1 + TOL) * r["measured"] for r in last), last
    worst = max(errors, key=abs)
    print(f"interleaved activation peaks (micro-batch {micro}): {len(errors)} rank-layouts, "
          f"largest relative error {worst:+.2%}")

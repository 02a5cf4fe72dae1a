"""Peak memory per pipeline stage against one real step of the tds engine (CPU, gloo), for
1F1B and the interleaved schedule.

Measured on each rank: the activations alive at once (each forward pass's saved tensors,
counted with saved-tensor hooks, each storage once, parameters excluded, until its backward:
per micro-batch under 1F1B, per (chunk, micro-batch) interleaved) and the model states after
the step (parameter storages, every storage a gradient lands in, every other tensor the
optimizer reaches). The model's peak is states + activation peak + buffers + transient; the
measured peak is the measured states + the measured activation peak + the model's own
buffers and transient (the stage outputs the engine keeps, the 16-bit logits: not measured
here), so the test holds the two measured parts, which are most of the peak, to 5% of the
whole. Interleaved: the model walks the rank's action list with each chunk charged its own
bytes (the embedding in chunk 0, the head and loss in the last).
"""
import random

import pytest

from harness import run_distributed
from memory_peak_runs import measure_peaks

TOL = 0.05


def _base(micro, layers, attention_dropout=0.0):
    return ["--num-layers", str(layers), "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "32", "--max-position-embeddings", "32", "--batch-size",
            str(micro), "--train-iters", "1", "--lr", "1e-3", "--attention-dropout",
            str(attention_dropout), "--gas", "4"]


@pytest.mark.slow  # ~15 s: five pipeline engines built and stepped on 4 ranks
def test_stage_peaks_match_a_real_step_for_1f1b_and_interleaved():
    micro = random.choice([1, 2])
    interleaved = ["--virtual-pipeline-model-parallel-size", "2"]
    layouts = [_base(micro, 8) + ["--pipe-parallel-size", "4"],
               _base(micro, 4) + ["--model-parallel-size", "2", "--pipe-parallel-size", "2",
                                  "--sequence-parallel"],
               _base(micro, 8) + ["--pipe-parallel-size", "4"] + interleaved,
               _base(micro, 4) + ["--model-parallel-size", "2", "--pipe-parallel-size", "2",
                                  "--sequence-parallel"] + interleaved,
               # bf16 weights: DeepSpeed's BF16_Optimizer; attention dropout on: the CPU's
               # SDPA math path, which computes in fp32
               _base(micro, 4, attention_dropout=0.1) + ["--pipe-parallel-size", "2", "--bf16"]]
    results = run_distributed(measure_peaks, 4, layouts, random.randrange(2**31), timeout=300)
    errors = {"activation peak": [], "stage peak": []}
    for rank, per_layout in enumerate(results):
        for r in per_layout:
            pred = r["predicted"]
            measured = r["states"] + r["activations"] + pred["buffers"] + pred["transient"]
            assert r["activations"] > 0 and r["states"] > 0, r
            assert abs(pred["activations"] - r["activations"]) <= TOL * r["activations"], \
                (rank, r)
            assert abs(pred["peak"] - measured) <= TOL * measured, (rank, measured, r)
            errors["activation peak"].append(pred["activations"] / r["activations"] - 1)
            errors["stage peak"].append(pred["peak"] / measured - 1)
    # interleaved: the old figure (a rank's mean chunk x its in-flight count) spread the head
    # over the last rank's chunks and overstated it beyond the tolerance (~+10% at pp 4)
    last = [r for per in results for r in per
            if "virtual" in r["argv"] and r["stage"] == max(x["stage"] for x in per)]
    assert any(r["averaged"] > (1 + TOL) * r["activations"] for r in last), last
    for what, values in errors.items():
        worst = max(values, key=abs)
        print(f"{what} (micro-batch {micro}): {len(values)} rank-layouts, largest relative "
              f"error {worst:+.2%}")

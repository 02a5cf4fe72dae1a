"""Zero-bubble pipeline schedules (ZB-H1, ZB-V) on GPT-2, T5 and the Llama example built on
mpu layers: per-step losses equal the serial run's (fp32, 8 steps, clipping on), the weight
passes really run the deferred GEMMs, every rank stays within its schedule's bound of
chunk-micro-batches in flight, and checkpoints move between schedules exactly.

Models have one transformer layer per ZB-V chunk (2 pp chunks; T5 both stacks). The
unmarked tests cover every (pp, schedule) in {2, 4} x {zb-h1, zbv}, tp 1 and 2, m = p and
2p + 1 and dp 2 in one 4-rank launch per family; ``-m exhaustive`` runs the whole matrix
(pp x schedule x tp x m: 16 layouts per family, 8 ranks).
"""
import itertools

import pytest

from harness import run_distributed
from zero_bubble_runs import STEPS, argv, layers_for, train_layouts

TOL = 1e-5

# (tp, pp, dp, m, schedule): every (pp, schedule), tp 1 and 2, m = p and 2p + 1, dp 2
COVER = [(1, 2, 2, 2, "zb-h1"), (2, 2, 1, 5, "zbv"), (1, 4, 1, 9, "zb-h1"), (1, 4, 1, 4, "zbv")]
MATRIX = [(tp, pp, 8 // (tp * pp), m, schedule)
          for pp, schedule, tp in itertools.product((2, 4), ("zb-h1", "zbv"), (1, 2))
          for m in (pp, 2 * pp + 1)]


def _data(family, gpt2_data, t5_data):
    return t5_data if family == "t5" else gpt2_data


def _serial(family, data, keys):
    """{(layers, global batch): serial per-step losses}, in one launch."""
    runs = [argv(family, data, layers, 1, 1, batch, "1f1b") for layers, batch in keys]
    out = run_distributed(train_layouts, 1, family, runs, timeout=600)[0]
    return {key: losses for key, (losses, _) in zip(keys, out)}


def _check_equal_serial(family, data, layouts, world):
    from tds.pipe.schedules import peak_bound

    keys = sorted({(layers_for(family, pp), m * dp) for _, pp, dp, m, _ in layouts})
    serial = _serial(family, data, keys)
    runs = [argv(family, data, layers_for(family, pp), tp, pp, m, s, dp)
            for tp, pp, dp, m, s in layouts]
    ranks = run_distributed(train_layouts, world, family, runs, timeout=1200)
    for (tp, pp, dp, m, schedule), *per_rank in zip(layouts, *ranks):
        where = f"{family} tp {tp} pp {pp} dp {dp} m {m} {schedule}"
        reference = serial[(layers_for(family, pp), m * dp)]
        for rank, (losses, stats) in enumerate(per_rank):
            assert len(losses) == STEPS, where
            error = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
            assert error < TOL, f"{where}: rank {rank} losses {losses} vs serial {reference}"
            assert len(stats) == STEPS and {s[0] for s in stats} == {schedule}, where
            stage = stats[0][1][0]  # the rank's first chunk is its stage in both placements
            vpp = 2 if schedule == "zbv" else 1
            bound = peak_bound(schedule, pp, vpp, m, stage)
            peaks = [s[2] for s in stats]
            assert max(peaks) <= bound, f"{where}: rank {rank} held {peaks} > {bound}"
            gemms = {s[3] for s in stats}
            assert len(gemms) == 1 and gemms.pop() > 0, \
                f"{where}: rank {rank}: the weight passes ran {[s[3] for s in stats]} GEMMs"


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2", "t5", "llama"])
def test_zero_bubble_equals_serial(family, gpt2_data, t5_data):
    _check_equal_serial(family, _data(family, gpt2_data, t5_data), COVER, world=4)


@pytest.mark.slow
@pytest.mark.exhaustive
@pytest.mark.parametrize("family", ["gpt2", "t5", "llama"])
def test_zero_bubble_matrix_equals_serial(family, gpt2_data, t5_data):
    _check_equal_serial(family, _data(family, gpt2_data, t5_data), MATRIX, world=8)

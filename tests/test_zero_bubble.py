"""Zero-bubble pipeline schedules (ZB-H1, ZB-V) on GPT-2, T5 and the Llama example built on
mpu layers: per-step losses equal the serial run's (fp32, 8 steps, clipping on), the weight
passes really run the deferred GEMMs, every rank stays within its schedule's bound of
chunk-micro-batches in flight, and checkpoints move between schedules exactly.

Models have one transformer layer per ZB-V chunk (2 pp chunks; T5 both stacks). The
unmarked tests cover every (pp, schedule) in {2, 4} x {zb-h1, zbv}, tp 1 and 2, m = p and
2p + 1, dp 2 with ZeRO-1, sequence parallelism and recompute in one 4-rank launch per family; ``-m exhaustive`` runs the whole matrix
(pp x schedule x tp x m: 16 layouts per family, 8 ranks).
"""
import itertools

import pytest

from harness import run_distributed
from precision import requires_ds_bf16, requires_ds_fp16
from zero_bubble_runs import STEPS, argv, layers_for, train_layouts

TOL = 1e-5

# (tp, pp, dp, m, schedule, extra): every (pp, schedule), tp 1 and 2, m = p and 2p + 1,
# dp 2 with ZeRO-1, sequence parallelism and recompute
COVER = [(1, 2, 2, 2, "zb-h1", ("--zero-stage", "1")),
         (2, 2, 1, 5, "zbv", ("--sequence-parallel", "--checkpoint-activations")),
         (1, 4, 1, 9, "zb-h1", ("--checkpoint-activations",)),
         (1, 4, 1, 4, "zbv", ())]
MATRIX = [(tp, pp, 8 // (tp * pp), m, schedule, ())
          for pp, schedule, tp in itertools.product((2, 4), ("zb-h1", "zbv"), (1, 2))
          for m in (pp, 2 * pp + 1)]


FLAGS = ["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "8",
         "--seq-length", "32", "--batch-size", "2", "--train-iters", "10", "--lr", "1e-3",
         "--tokenizer-type", "GPT2BPETokenizer", "--pipe-parallel-size", "2"]


def _parse(*extra):
    from megatron.config import parse_args

    return parse_args(FLAGS + list(extra), world_size=4, rank=0, check_files=False)


@pytest.mark.parametrize("extra,schedule,vpp", [
    ((), "1f1b", 1), (("--virtual-pipeline-model-parallel-size", "2"), "interleaved", 2),
    (("--pipeline-schedule", "zb-h1"), "zb-h1", 1), (("--pipeline-schedule", "zbv"), "zbv", 2),
    (("--pipeline-schedule", "zbv", "--virtual-pipeline-model-parallel-size", "2"), "zbv", 2)])
def test_schedule_flag_and_what_it_implies(extra, schedule, vpp):
    args = _parse(*extra)
    assert (args.pipeline_schedule, args.virtual_pipeline_model_parallel_size) == (schedule, vpp)


@pytest.mark.parametrize("extra,message", [
    (("--pipeline-schedule", "zbv", "--virtual-pipeline-model-parallel-size", "4"),
     r"zbv places exactly 2 model chunks on each rank"),
    (("--pipeline-schedule", "zb-h1", "--virtual-pipeline-model-parallel-size", "2"),
     r"zb-h1 runs one model chunk per rank"),
    (("--pipeline-schedule", "interleaved",), r"interleaved needs --virtual-pipeline"),
    (("--pipeline-schedule", "1f1b", "--virtual-pipeline-model-parallel-size", "2"),
     r"1f1b runs one model chunk per rank"),
    (("--pipeline-schedule", "zbv", "--num-layers", "6"),
     r"zbv cuts the 6 layers into 2 x --pipe-parallel-size \(4\) equal chunks"),
    (("--pipeline-schedule", "zb-h1", "--pipe-parallel-size", "1"),
     r"zb-h1 needs --pipe-parallel-size >= 2"),
])
def test_bad_schedules_are_config_errors(extra, message):
    from megatron.common.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        _parse(*extra)


def _data(family, gpt2_data, t5_data):
    return t5_data if family == "t5" else gpt2_data


def _serial(family, data, keys):
    """{(layers, global batch): serial per-step losses}, in one launch."""
    runs = [argv(family, data, layers, 1, 1, batch, "1f1b") for layers, batch in keys]
    out = run_distributed(train_layouts, 1, family, runs, timeout=600)[0]
    return {key: losses for key, (losses, _) in zip(keys, out)}


def _check_equal_serial(family, data, layouts, world):
    from tds.pipe.schedules import peak_bound

    keys = sorted({(layers_for(family, pp), m * dp) for _, pp, dp, m, _, _ in layouts})
    serial = _serial(family, data, keys)
    runs = [argv(family, data, layers_for(family, pp), tp, pp, m, s, dp, *extra)
            for tp, pp, dp, m, s, extra in layouts]
    ranks = run_distributed(train_layouts, world, family, runs, timeout=1200)
    for (tp, pp, dp, m, schedule, extra), *per_rank in zip(layouts, *ranks):
        where = f"{family} tp {tp} pp {pp} dp {dp} m {m} {schedule} {' '.join(extra)}"
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


def _point_tracker(root, iteration):
    with open(root / "latest_checkpointed_iteration.txt", "w") as handle:
        handle.write(str(iteration))


def _resume_runs(family, data, root, chain, layers, extra=()):
    """argv per (tp, pp, schedule, steps, load, save) of ``chain`` (m = 4, dp 1)."""
    from interleaved_runs import family_argv

    runs = []
    for tp, pp, schedule, steps, load, save in chain:
        flags = ["--model-parallel-size", str(tp), "--pipe-parallel-size", str(pp), "--gas",
                 "4", "--pipeline-schedule", schedule, "--train-iters", str(steps),
                 "--lr-decay-iters", "8", "--save-interval", "2", "--eval-interval", "2",
                 "--eval-iters", "2", "--clip-grad", "1.0", *extra]
        flags += ["--virtual-pipeline-model-parallel-size", "2"] if schedule == "interleaved" \
            else []
        flags += ["--load", str(root / load)] if load else []
        flags += ["--save", str(root / save)] if save else []
        runs.append(family_argv(family, data, layers, *flags))
    return runs


@pytest.mark.slow
def test_resume_across_schedules_and_layouts(gpt2_data, tmp_path):
    """8 uninterrupted 1F1B steps against 1F1B -> ZB-V -> interleaved -> ZB-H1 (2 steps
    each, pp 2), and ZB-V's and interleaved's checkpoints resumed at (tp 2, pp 2, zbv) and
    (pp 4, zb-h1): losses and validation losses equal, optimizer state carried over."""
    from interleaved_runs import train_many

    def run(world, chain):
        return run_distributed(train_many, world, "gpt2",
                               _resume_runs("gpt2", gpt2_data, tmp_path, chain, 4),
                               timeout=900)[0]

    ((full, full_evals),) = run(2, [(1, 2, "1f1b", 8, None, "a")])
    _point_tracker(tmp_path / "a", 2)
    chain = run(2, [(1, 2, "zbv", 4, "a", "b"), (1, 2, "interleaved", 6, "b", "c"),
                    (1, 2, "zb-h1", 8, "c", None)])
    _point_tracker(tmp_path / "b", 4)
    other = run(4, [(2, 2, "zbv", 8, "c", None), (1, 4, "zb-h1", 6, "b", None)])
    resumed = [losses for losses, _ in chain]
    assert [len(x) for x in resumed] == [2, 2, 2]
    pairs = [(sum(resumed, []), full[2:]), (other[0][0], full[6:]), (other[1][0], full[4:6])]
    for got, want in pairs:
        assert len(got) == len(want) and \
            max(abs(a - b) / abs(b) for a, b in zip(got, want)) < TOL, (got, full)
    evals = dict(full_evals)
    for _, run_evals in chain + other:
        for step, loss in run_evals:
            assert abs(loss - evals[step]) / abs(evals[step]) < TOL, (step, run_evals, evals)


def _low_precision_equals_1f1b(precision, data):
    """The three schedules' low-precision steps (clipping off: the comparison is of the
    schedules' gradients, not of the clipping, which tests/test_one_step.py holds)."""
    runs = [argv("gpt2", data, 4, 1, 2, 4, schedule, 1, precision, "--clip-grad", "0")
            for schedule in ("1f1b", "zb-h1", "zbv")]
    for (reference, _), *others in run_distributed(train_layouts, 2, "gpt2", runs, timeout=600):
        assert reference[-1] < reference[0], reference
        for losses, stats in others:
            assert stats[0][3] > 0, stats  # the weight passes ran deferred GEMMs
            diff = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
            assert diff < 1e-4, (reference, losses)  # low-precision sums in another order


@pytest.mark.slow
@pytest.mark.precision
@requires_ds_bf16
def test_bf16_zero_bubble_equals_bf16_1f1b(gpt2_data):
    """bf16 under ZB-H1 and ZB-V (the weight passes' gradients accumulated into the fp32
    grad buffer as the input passes' are): the 1F1B schedule's steps."""
    _low_precision_equals_1f1b("--bf16", gpt2_data)


@pytest.mark.slow
@pytest.mark.precision
@requires_ds_fp16
def test_fp16_zero_bubble_equals_fp16_1f1b(gpt2_data):
    """fp16 (the loss scale applied in the last chunk's input pass) under ZB-H1 and ZB-V:
    the 1F1B schedule's steps."""
    _low_precision_equals_1f1b("--fp16", gpt2_data)

"""GPT-2 and T5 with virtual pipeline stages (interleaved 1F1B through tds.pipe.runner):
per-step losses and final weights equal the serial run's; checkpoints move between 1F1B and
interleaved layouts exactly.

Models have one transformer layer per chunk (GPT-2 p v layers, T5 p v / 2 per stack).
Several layouts run in one launch of 4 ranks (``train_many``); one serial launch per family
computes the references (``SerialReferences``). The unmarked tests cover every (pp, v),
tp and m in {p, 2p, 2p + 1} once per family, with DDP, ZeRO-1, sequence parallelism and
activation recompute; `-m exhaustive` runs the whole 36-run matrix.
"""
import pytest

from harness import run_distributed
from interleaved_runs import (SerialReferences, family_argv, layout_flags, num_layers,
                              train_many)
from precision import requires_ds_bf16, requires_ds_fp16

TOL = 1e-5
GPT2_FLAGS = ["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "8",
              "--seq-length", "32", "--batch-size", "2", "--train-iters", "10", "--lr", "1e-3",
              "--tokenizer-type", "GPT2BPETokenizer"]


def _parse(*extra, world_size=4, family=None):
    from megatron.config import parse_args

    return parse_args(GPT2_FLAGS + list(extra), world_size=world_size, rank=0,
                      check_files=False, family=family)


@pytest.mark.parametrize("extra,vpp", [
    ((), 1), (("--pipe-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2"), 2),
    (("--pipe-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"), 4),
    (("--pipe-parallel-size", "4", "--num-layers-per-virtual-pipeline-stage", "2"), 1)])
def test_virtual_stages_flag_and_derivation(extra, vpp):
    args = _parse(*extra)
    assert args.virtual_pipeline_model_parallel_size == vpp


@pytest.mark.parametrize("extra,message", [
    (("--virtual-pipeline-model-parallel-size", "2"), r"needs --pipe-parallel-size >= 2"),
    (("--pipe-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "3"),
     r"--num-layers \(8\) is not divisible by --pipe-parallel-size \(2\) x "
     r"--virtual-pipeline-model-parallel-size \(3\)"),
    (("--pipe-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "3"),
     r"--num-layers-per-virtual-pipeline-stage \(3\) must be positive and divide"),
    (("--pipe-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2",
      "--num-layers-per-virtual-pipeline-stage", "1"), r"disagrees with"),
    (("--pipe-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "0"),
     r"must be positive, got 0"),
])
def test_bad_virtual_stages_are_config_errors(extra, message):
    from megatron.common.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        _parse(*extra)


def test_t5_counts_both_stacks():
    from megatron.common.errors import ConfigError
    from megatron.families import get_family

    t5 = get_family("t5")
    # 2 x 3 layers: 6 chunks of one at (pp 2, v 3), not 4
    t5_flags = ("--dec-seq-length", "8", "--num-layers", "3", "--pipe-parallel-size", "2")
    args = _parse(*t5_flags, "--virtual-pipeline-model-parallel-size", "3", family=t5)
    assert args.virtual_pipeline_model_parallel_size == 3
    with pytest.raises(ConfigError, match=r"the 2 x --num-layers \(6\)"):
        _parse(*t5_flags, "--virtual-pipeline-model-parallel-size", "2", family=t5)


@pytest.mark.parametrize("family,pp,vpp", [("gpt2", 2, 2), ("gpt2", 4, 2), ("gpt2", 2, 3),
                                           ("t5", 2, 2), ("t5", 4, 2), ("t5", 2, 3)])
def test_checkpoint_chunks_are_the_engines(family, pp, vpp):
    """The key maps give rank r chunks r, r + p, ... of one partition covering every spec
    once, with the same number of transformer layers in each chunk."""
    from megatron.checkpoint import gpt2_keys, t5_keys

    keys = {"gpt2": gpt2_keys, "t5": t5_keys}[family]
    layers = 2 * pp * vpp // (2 if family == "t5" else 1)
    weights = [0] + [1] * layers + [0, 0] if family == "gpt2" else t5_keys.spec_weights(layers)
    per_rank = keys.stage_spec_bounds(layers, pp, vpp)
    chunks = keys.stage_spec_bounds(layers, pp * vpp)  # the same partitioner, one chunk a rank
    assert len(per_rank) == pp
    for rank, bounds in enumerate(per_rank):
        assert bounds == chunks[rank::pp]
        assert all(sum(weights[a:b]) == 2 for a, b in bounds)
    assert [a for a, _ in chunks] == [0] + [b for _, b in chunks[:-1]]
    assert chunks[-1][1] == len(weights)


@pytest.fixture(scope="session")
def serial_refs(gpt2_data, t5_data, tmp_path_factory):
    return SerialReferences({"gpt2": gpt2_data, "t5": t5_data}, tmp_path_factory)


def _check(family, serial_refs, tmp_path, world, layouts):
    """Run ``layouts`` ((tp, pp, v, m, extra flags)) in one launch of ``world`` ranks and
    compare each with the serial run of the same global batch (m x dp micro-batches)."""
    from megatron.checkpoint import read_native

    runs, keys = [], []
    for i, (tp, pp, v, m, extra) in enumerate(layouts):
        keys.append((num_layers(family, pp, v), m * world // (tp * pp)))  # m x dp
        runs.append(family_argv(family, serial_refs.data[family], keys[-1][0], *layout_flags(
            tp, pp, v, m, *extra), "--save", str(tmp_path / f"run{i}"), "--no-save-optim"))
    refs = serial_refs.get(family, keys)
    per_rank = run_distributed(train_many, world, family, runs, timeout=600)
    for i, (layout, key) in enumerate(zip(layouts, keys)):
        serial, serial_weights = refs[key]
        assert serial[-1] != serial[0]  # the weights move (3 tiny steps need not lower it)
        for rank, curves in enumerate(per_rank):
            diff = max(abs(a - b) / abs(b) for a, b in zip(curves[i][0], serial))
            assert diff < TOL, (family, layout, rank, curves[i][0], serial)
        weights = read_native(str(tmp_path / f"run{i}")).state  # gathered from every rank
        assert weights.keys() == serial_weights.keys()
        for name, tensor in weights.items():
            err = (tensor - serial_weights[name]).abs().max().item()
            assert err < TOL, (family, layout, name, err)


# (tp, pp, v, m, extra): every (pp, v), tp 1 and 2, m = p, 2p, 2p + 1 at least once
GPT2_LAYOUTS = [
    (2, 2, 2, 2, ("--sequence-parallel", "--checkpoint-activations")),
    (1, 4, 2, 8, ()),
    (1, 2, 3, 5, ("--zero-stage", "1")),  # dp 2, ZeRO-1
]
T5_LAYOUTS = [
    (1, 2, 2, 5, ()),  # dp 2: the engine's data-parallel all-reduce
    (1, 4, 2, 4, ("--checkpoint-activations",)),
    (2, 2, 3, 4, ("--sequence-parallel",)),
]


def test_gpt2_interleaved_equals_serial(serial_refs, tmp_path):
    _check("gpt2", serial_refs, tmp_path, 4, GPT2_LAYOUTS)


def test_t5_interleaved_equals_serial(serial_refs, tmp_path):
    _check("t5", serial_refs, tmp_path, 4, T5_LAYOUTS)


def _matrix(world):
    """The issue's matrix at dp = 1 for ``world`` ranks: (pp, v) in (2, 2), (4, 2), (2, 3),
    tp in 1, 2, m in p, 2p, 2p + 1."""
    return [(tp, pp, v, m, ()) for tp in (1, 2) for pp, v in ((2, 2), (4, 2), (2, 3))
            if tp * pp == world for m in (pp, 2 * pp, 2 * pp + 1)]


@pytest.mark.slow
@pytest.mark.exhaustive  # the unmarked tests above cover every (pp, v), tp and m once
@pytest.mark.parametrize("family", ["gpt2", "t5"])
def test_whole_matrix_equals_serial(family, serial_refs, tmp_path):
    """All 18 layouts of a family (36 in all), one launch per world size."""
    layouts = {world: _matrix(world) for world in (2, 4, 8)}
    assert sum(map(len, layouts.values())) == 18
    for world, group in layouts.items():
        _check(family, serial_refs, tmp_path / f"w{world}", world, group)


@pytest.mark.slow
def test_t5_chunk_across_the_stacks_equals_serial(serial_refs, tmp_path):
    """(pp, v) = (3, 3): 2 x 9 layers in 9 chunks of 2; chunk 4 (rank 1) holds the last
    encoder layer, the encoder's final norm and the first decoder layer; m = 4 is not a
    multiple of p."""
    _check("t5", serial_refs, tmp_path, 3, [(1, 3, 3, 4, ())])


def _point_tracker(root, iteration):
    with open(root / "latest_checkpointed_iteration.txt", "w") as handle:
        handle.write(str(iteration))


def _resume_chain(family, data, tmp_path, layers, extra=()):
    """1F1B for 6 steps (saving every 2); interleaved v = 2 from its step-2 checkpoint to
    step 4; 1F1B again from the interleaved step-4 checkpoint to step 6. Optimizer state,
    LR schedule and data position travel through the layout-change loader. Validation at
    steps 4 and 6 compares the interleaved evaluation with DeepSpeed's inference schedule."""
    def run(v, steps, *flags):
        argv = family_argv(family, data, layers, *layout_flags(1, 2, v, 4), "--train-iters",
                           str(steps), "--lr-decay-iters", "6", "--save-interval", "2",
                           "--eval-interval", "2", "--eval-iters", "2", *extra, *flags)
        return [result[0] for result in run_distributed(train_many, 2, family, [argv],
                                                        timeout=400)]

    one_f_one_b, interleaved = tmp_path / "1f1b", tmp_path / "interleaved"
    full = run(1, 6, "--save", str(one_f_one_b))
    _point_tracker(one_f_one_b, 2)
    middle = run(2, 4, "--load", str(one_f_one_b), "--save", str(interleaved))
    back = run(1, 6, "--load", str(interleaved))
    for rank in range(2):
        reference, resumed = full[rank][0], middle[rank][0] + back[rank][0]
        assert len(resumed) == 4
        diff = max(abs(a - b) / abs(b) for a, b in zip(resumed, reference[2:]))
        assert diff < TOL, (family, rank, reference, resumed)
        evals, resumed_evals = dict(full[rank][1]), dict(middle[rank][1] + back[rank][1])
        assert sorted(resumed_evals) == [4, 6], resumed_evals
        for step, loss in resumed_evals.items():
            assert abs(loss - evals[step]) / abs(evals[step]) < TOL, (step, evals, resumed_evals)


def test_gpt2_resume_1f1b_to_interleaved_and_back(gpt2_data, tmp_path):
    _resume_chain("gpt2", gpt2_data, tmp_path, 4)


@pytest.mark.slow
def test_t5_resume_1f1b_to_interleaved_and_back(t5_data, tmp_path):
    _resume_chain("t5", t5_data, tmp_path, 2)


@pytest.mark.slow
def test_interleaved_checkpoint_resumes_at_other_layouts(gpt2_data, tmp_path):
    """An interleaved (tp 1, pp 2, v 2) step-4 checkpoint resumes exactly at its own layout,
    (tp 2, pp 1), (tp 1, pp 4, v 1), (tp 2, pp 2, v 2) and (pp 2, v 2, dp 2): the same
    global batch of 4."""
    def argv(tp, pp, v, m, *flags):
        return family_argv("gpt2", gpt2_data, 4, *layout_flags(tp, pp, v, m), "--train-iters",
                           "6", "--lr-decay-iters", "6", *flags)

    root = tmp_path / "interleaved"
    full = run_distributed(train_many, 2, "gpt2", [argv(1, 2, 2, 4, "--save", str(root),
                                                        "--save-interval", "4")])[0][0][0]
    _point_tracker(root, 4)
    for world, (tp, pp, v, m) in ((2, (1, 2, 2, 4)), (2, (2, 1, 1, 4)), (4, (1, 4, 1, 4)),
                                  (4, (2, 2, 2, 4)), (4, (1, 2, 2, 2))):
        resumed = run_distributed(train_many, world, "gpt2",
                                  [argv(tp, pp, v, m, "--load", str(root))])
        for rank, ((losses, _),) in enumerate(resumed):
            diff = max(abs(a - b) / abs(b) for a, b in zip(losses, full[4:]))
            assert len(losses) == 2 and diff < TOL, ((tp, pp, v, m), rank, losses, full)


@pytest.mark.slow
@pytest.mark.precision
@requires_ds_bf16
def test_bf16_interleaved_equals_bf16_1f1b(gpt2_data):
    """DeepSpeed's bf16 optimizer through both pipeline paths: the same steps (chunks skip
    engine.forward, whose hooks would clear the bf16 gradients before each backward)."""
    runs = [family_argv("gpt2", gpt2_data, 4, *layout_flags(1, 2, v, 4), "--bf16")
            for v in (1, 2)]
    for (one_f_one_b, _), (interleaved, _) in run_distributed(train_many, 2, "gpt2", runs):
        diff = max(abs(a - b) / abs(b) for a, b in zip(interleaved, one_f_one_b))
        assert diff < 1e-6, (one_f_one_b, interleaved)  # 1e-4 when the gradients add twice


@pytest.mark.slow
@pytest.mark.precision
@requires_ds_fp16
def test_fp16_interleaved_equals_fp16_1f1b(gpt2_data):
    """DeepSpeed's fp16 optimizer (dynamic loss scale, applied in the last chunk's engine
    backward: tds.fp16_loss_scale) through both pipeline paths: the same steps."""
    runs = [family_argv("gpt2", gpt2_data, 4, *layout_flags(1, 2, v, 4), "--fp16",
                        "--train-iters", "6") for v in (1, 2)]
    for (one_f_one_b, _), (interleaved, _) in run_distributed(train_many, 2, "gpt2", runs):
        assert len(interleaved) == 6 and interleaved[-1] < interleaved[2] - 0.05, interleaved
        diff = max(abs(a - b) / abs(b) for a, b in zip(interleaved, one_f_one_b))
        # fp16 gradients add up in another order across chunks: 1.5e-6 measured
        assert diff < 1e-4, (one_f_one_b, interleaved)

"""GPT-2 and T5 with virtual pipeline stages (interleaved 1F1B through tds.pipe.runner):
per-step losses and final weights equal the serial run's; checkpoints move between 1F1B and
interleaved layouts exactly.

Models have one transformer layer per chunk (GPT-2 p v layers, T5 p v / 2 per stack).
Several layouts run in one launch of 4 ranks (``train_many``); one serial launch per family
computes the references (``SerialReferences``). The unmarked tests cover every (pp, v),
tp and m in {p, 2p, 2p + 1} once per family, with DDP, ZeRO-1, sequence parallelism and
activation recompute; the slow test runs the whole 36-run matrix.
"""
import pytest

from harness import run_distributed
from interleaved_runs import (SerialReferences, family_argv, layout_flags, num_layers,
                              train_many)

TOL = 1e-5


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
        assert serial[-1] < serial[0]  # it trains
        for rank, curves in enumerate(per_rank):
            diff = max(abs(a - b) / abs(b) for a, b in zip(curves[i], serial))
            assert diff < TOL, (family, layout, rank, curves[i], serial)
        weights = read_native(str(tmp_path / f"run{i}")).state  # gathered from every rank
        assert weights.keys() == serial_weights.keys()
        for name, tensor in weights.items():
            err = (tensor - serial_weights[name]).abs().max().item()
            assert err < TOL, (family, layout, name, err)


# (tp, pp, v, m, extra): every (pp, v), tp 1 and 2, m = p, 2p, 2p + 1 at least once
GPT2_LAYOUTS = [
    (2, 2, 2, 2, ("--sequence-parallel", "--checkpoint-activations")),
    (1, 4, 2, 8, ()),
    (1, 2, 3, 5, ("--zero-stage", "1")),  # dp 2
]
T5_LAYOUTS = [
    (1, 2, 2, 5, ("--zero-stage", "1")),  # dp 2
    (1, 4, 2, 4, ("--checkpoint-activations",)),
    (2, 2, 3, 4, ("--sequence-parallel",)),
]


def test_gpt2_interleaved_equals_serial(serial_refs, tmp_path):
    _check("gpt2", serial_refs, tmp_path, 4, GPT2_LAYOUTS)


def test_t5_interleaved_equals_serial(serial_refs, tmp_path):
    _check("t5", serial_refs, tmp_path, 4, T5_LAYOUTS)


def _point_tracker(root, iteration):
    with open(root / "latest_checkpointed_iteration.txt", "w") as handle:
        handle.write(str(iteration))


def _resume_chain(family, data, tmp_path, layers, extra=()):
    """1F1B for 6 steps (saving every 2); interleaved v = 2 from its step-2 checkpoint to
    step 4; 1F1B again from the interleaved step-4 checkpoint to step 6. Optimizer state,
    LR schedule and data position travel through the layout-change loader."""
    def run(v, steps, *flags):
        argv = family_argv(family, data, layers, *layout_flags(1, 2, v, 4), "--train-iters",
                           str(steps), "--lr-decay-iters", "6", "--save-interval", "2", *extra,
                           *flags)
        return run_distributed(train_many, 2, family, [argv], timeout=400)

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


def test_gpt2_resume_1f1b_to_interleaved_and_back(gpt2_data, tmp_path):
    _resume_chain("gpt2", gpt2_data, tmp_path, 4)

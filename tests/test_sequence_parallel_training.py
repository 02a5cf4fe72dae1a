"""--sequence-parallel end to end: GPT-2 and T5 (plain and tds pipeline paths) give the
serial losses and the serial final weights (fp32, dropout 0) to 1e-5.

The final weights are read back from each run's checkpoint gathered to the full model
(read_native), so a replicated LayerNorm weight whose gradient missed the tensor-parallel
sum (each rank saw only its part of the sequence) shows up as a weight difference.
"""
import pytest

from gpt2_runs import gpt2_argv, train_gpt2
from harness import run_distributed
from t5_runs import t5_argv, train_t5

STEPS, MICRO, GLOBAL = 10, 2, 8
TOL = 1e-5


def _layout(tp, pp, dp, save):
    return ["--model-parallel-size", str(tp), "--pipe-parallel-size", str(pp),
            "--batch-size", str(MICRO), "--gas", str(GLOBAL // (MICRO * dp)),
            "--train-iters", str(STEPS), "--hidden-dropout", "0", "--attention-dropout", "0",
            "--save", save, "--no-save-optim"]


def _check(train, argv_of, read, layouts, tmp_path):
    def run(tp, pp, dp, *extra):
        save = str(tmp_path / f"tp{tp}_pp{pp}_dp{dp}")
        per_rank = run_distributed(train, tp * pp * dp,
                                   argv_of(*_layout(tp, pp, dp, save), *extra), timeout=500)
        return per_rank, read(save).state  # full weights, merged from every rank

    serial_ranks, serial_weights = run(1, 1, 1)
    serial = serial_ranks[0][0]
    assert len(serial) == STEPS and serial[-1] < serial[0] - 0.2  # it trains
    for tp, pp, dp in layouts:
        per_rank, weights = run(tp, pp, dp, "--sequence-parallel")
        for rank, (losses, _) in enumerate(per_rank):
            diff = max(abs(a - b) / abs(b) for a, b in zip(losses, serial))
            assert diff < TOL, ((tp, pp, dp), rank, losses, serial)
        assert weights.keys() == serial_weights.keys()
        for name, tensor in weights.items():
            err = (tensor.float() - serial_weights[name].float()).abs().max().item()
            assert err < TOL, ((tp, pp, dp), name, err)


@pytest.mark.slow
def test_gpt2_sequence_parallel_gives_the_serial_losses_and_weights(gpt2_data, tmp_path):
    def argv(*extra):
        return gpt2_argv(gpt2_data, "--num-layers", "4", *extra)

    from megatron.checkpoint import read_native

    _check(train_gpt2, argv, read_native, [(2, 1, 1), (4, 1, 1), (2, 2, 2)], tmp_path)


@pytest.mark.slow
def test_t5_sequence_parallel_gives_the_serial_losses_and_weights(t5_data, tmp_path):
    def argv(*extra):
        return t5_argv(t5_data, *extra)

    from megatron.checkpoint_conversion.t5_convert import read_native_t5

    _check(train_t5, argv, read_native_t5, [(2, 1, 1), (2, 2, 1)], tmp_path)

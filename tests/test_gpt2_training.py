"""GPT-2 end to end through pretrain(): layout equivalence and exact resume."""
import pytest

from gpt2_runs import full_and_resumed, gpt2_argv, train_gpt2
from harness import run_distributed

STEPS = 20
GLOBAL_BATCH = 8
MICRO_BATCH = 2


def _layout_argv(data, tp, dp, *extra):
    gas = GLOBAL_BATCH // (MICRO_BATCH * dp)
    return gpt2_argv(data, "--model-parallel-size", str(tp), "--batch-size", str(MICRO_BATCH),
                     "--gas", str(gas), "--train-iters", str(STEPS), "--hidden-dropout", "0",
                     "--attention-dropout", "0", *extra)


def _rel_diff(a, b):
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


@pytest.mark.slow
def test_tensor_and_data_parallel_layouts_give_the_serial_losses(gpt2_data):
    runs = {}
    for tp, dp in [(1, 1), (2, 1), (1, 2), (2, 2)]:
        per_rank = run_distributed(train_gpt2, tp * dp, _layout_argv(gpt2_data, tp, dp),
                                   timeout=300)
        losses = per_rank[0][0]
        assert len(losses) == STEPS
        assert all(r[0] == losses for r in per_rank)  # every rank reports the same
        runs[(tp, dp)] = losses
    serial = runs[(1, 1)]
    assert serial[-1] < serial[0] - 0.5  # it trains
    for layout, losses in runs.items():
        assert _rel_diff(losses, serial) < 1e-4, (layout, losses, serial)


@pytest.mark.slow
@pytest.mark.parametrize("tp,dp", [(1, 1), (2, 2)])
def test_resume_is_exact(gpt2_data, tmp_path, tp, dp):
    # Dropout on, so the restored RNG states matter too; evaluation on, so the validation
    # data position is restored.
    argv = gpt2_argv(gpt2_data, "--model-parallel-size", str(tp), "--batch-size",
                     str(MICRO_BATCH), "--gas", str(GLOBAL_BATCH // (MICRO_BATCH * dp)),
                     "--train-iters", str(STEPS), "--hidden-dropout", "0.1",
                     "--attention-dropout", "0.1", "--eval-interval", "5")
    full, resumed = full_and_resumed(train_gpt2, tp * dp, argv, str(tmp_path / "ckpt"),
                                     STEPS // 2)
    assert len(resumed[0]) == STEPS
    assert max(abs(a - b) for a, b in zip(full[0], resumed[0])) <= 1e-6, (full, resumed)
    assert full[1] == resumed[1]  # validation losses too

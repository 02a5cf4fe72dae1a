"""GPT-2 through tds's pipeline engine: 3D layouts give the serial losses; exact resume."""
import pytest

from gpt2_runs import full_and_resumed, layout_argv, train_gpt2
from harness import run_distributed
from precision import requires_ds_fp16

STEPS, MICRO, GLOBAL = 10, 2, 8


def _argv(data, tp, pp, dp, *extra):
    return layout_argv(data, tp, pp, dp, *extra, steps=STEPS, micro=MICRO,
                       global_batch=GLOBAL)


def _run(data, tp, pp, dp, *extra):
    return run_distributed(train_gpt2, tp * pp * dp, _argv(data, tp, pp, dp, *extra),
                           timeout=400)


@pytest.mark.slow
def test_3d_layouts_give_the_serial_losses_and_weights(gpt2_data, tmp_path):
    from megatron.checkpoint import read_native

    def run(tp, pp, dp):
        save = str(tmp_path / f"tp{tp}_pp{pp}_dp{dp}")
        per_rank = _run(gpt2_data, tp, pp, dp, "--save", save, "--no-save-optim")
        return per_rank, read_native(save).state  # full weights, gathered from every rank

    serial_ranks, serial_weights = run(1, 1, 1)
    serial = serial_ranks[0][0]
    assert serial[-1] < serial[0] - 0.2
    # pp alone (1, 2, 2), all three (2, 2, 2), a deeper pipeline (1, 4, 2); tp x pp without
    # dp is (2, 2, 1) in tests/test_tds_engine.py
    for tp, pp, dp in [(1, 2, 2), (2, 2, 2), (1, 4, 2)]:
        per_rank, weights = run(tp, pp, dp)
        for rank, (losses, _) in enumerate(per_rank):
            diff = max(abs(a - b) / abs(b) for a, b in zip(losses, serial))
            assert diff < 1e-4, ((tp, pp, dp), rank, losses, serial)
        assert weights.keys() == serial_weights.keys()
        for name, tensor in weights.items():
            err = (tensor.float() - serial_weights[name].float()).abs().max().item()
            assert err < 1e-4, ((tp, pp, dp), name, err)


def _resume(data, tmp_path, tp, pp, dp, *extra):
    argv = _argv(data, tp, pp, dp, "--hidden-dropout", "0.1", "--attention-dropout", "0.1",
                 "--eval-interval", "4", *extra)
    return full_and_resumed(train_gpt2, tp * pp * dp, argv, str(tmp_path / "ckpt"), 5)


@pytest.mark.slow
def test_resume_is_exact_at_tp2_pp2_dp2(gpt2_data, tmp_path):
    (full, full_eval), (resumed, resumed_eval) = _resume(gpt2_data, tmp_path, 2, 2, 2)
    assert len(resumed) == STEPS
    assert max(abs(a - b) for a, b in zip(full, resumed)) <= 1e-6, (full, resumed)
    assert full_eval == resumed_eval


@pytest.mark.slow
@pytest.mark.precision
@requires_ds_fp16  # the refusal where fp16 is missing: tests/test_faults.py (both sides)
def test_fp16_zero1_pipeline_resume_is_exact(gpt2_data, tmp_path):
    # DeepSpeed's fp16 optimizer with ZeRO-1 shards the fp32 master weights across dp ranks:
    # every rank's shard must come back for the run to continue bit for bit.
    (full, _), (resumed, _) = _resume(gpt2_data, tmp_path, 1, 2, 2, "--fp16", "--zero-stage",
                                      "1")
    assert max(abs(a - b) for a, b in zip(full, resumed)) <= 1e-6, (full, resumed)
    assert full[-1] < full[0]

"""T5 end to end through pretrain_t5.py: layout equivalence, exact resume, loss falls.

Equivalence is asserted at a relative difference of 1e-5 per step, tighter than the
issue's 1e-4: the observed difference is ~1e-7, while dropping the reduction that keeps
the pipeline's relative-bias copies equal gives ~1e-4 within 10 steps, which 1e-4 could
miss.
"""
import pytest

from gpt2_runs import run_script
from harness import run_distributed
from t5_runs import t5_argv, train_t5

STEPS, MICRO, GLOBAL = 10, 2, 8
TOL = 1e-5


def _argv(data, tp, pp, dp, *extra):
    return t5_argv(data, "--model-parallel-size", str(tp), "--pipe-parallel-size", str(pp),
                   "--batch-size", str(MICRO), "--gas", str(GLOBAL // (MICRO * dp)),
                   "--train-iters", str(STEPS), *extra)


def _run(data, tp, pp, dp, *extra):
    return run_distributed(train_t5, tp * pp * dp, _argv(data, tp, pp, dp, *extra),
                           timeout=400)


def _rel_diff(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def _check_layouts(data, layouts, *extra):
    no_dropout = ("--hidden-dropout", "0", "--attention-dropout", "0", *extra)
    serial = _run(data, 1, 1, 1, *no_dropout)[0][0]
    assert len(serial) == STEPS and serial[-1] < serial[0] - 0.5  # it trains
    for tp, pp, dp in layouts:
        for rank, (losses, _) in enumerate(_run(data, tp, pp, dp, *no_dropout)):
            assert _rel_diff(losses, serial) < TOL, ((tp, pp, dp), rank, losses, serial)


@pytest.mark.slow
def test_t5_v1_0_layouts_give_the_serial_losses(t5_data):
    # Tied output with d_model^-0.5 scaling, ReLU; pp=2 puts the encoder on stage 0 and the
    # decoder on stage 1 (decoder embeddings ride through stage 0's boundary).
    _check_layouts(t5_data, [(2, 1, 1), (1, 2, 1), (2, 2, 2)])


@pytest.mark.slow
def test_t5_v1_1_pipeline_with_shared_bias_across_stages(t5_data):
    # 3 layers per stack on 3 stages: both stacks span two stages, so each relative-bias
    # table has copies on two stages tied by the engine. Untied lm head, gated-GeLU,
    # activation recompute.
    _check_layouts(t5_data, [(1, 3, 1)], "--num-layers", "3", "--t5-ff", "gated-gelu",
                   "--untie-embeddings", "--checkpoint-activations")


@pytest.mark.slow
def test_resume_is_exact_at_pp2_dp2(t5_data, tmp_path):
    # Dropout on, so the restored RNG states matter too.
    common = ("--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--eval-interval", "3")
    full = _run(t5_data, 1, 2, 2, *common)[0]
    ckpt = str(tmp_path / "ckpt")
    first = _run(t5_data, 1, 2, 2, *common, "--save", ckpt, "--exit-interval", "5")[0]
    second = _run(t5_data, 1, 2, 2, *common, "--save", ckpt, "--load", ckpt)[0]
    resumed = first[0] + second[0]
    assert len(resumed) == STEPS
    assert max(abs(a - b) for a, b in zip(full[0], resumed)) <= 1e-6, (full[0], resumed)
    assert full[1] == first[1] + second[1]  # validation losses too


@pytest.mark.slow
def test_loss_falls_at_tp2_pp2_and_the_model_fills_spans(t5_data, tmp_path):
    # 120 steps of one micro-batch of 8 keep this near a minute on 2 shared CPU cores; the
    # loss goes from ~6.0 (ln 512 = 6.2 for uniform guesses) to ~3.6.
    ckpt = str(tmp_path / "ckpt")
    losses = run_distributed(train_t5, 4, t5_argv(
        t5_data, "--model-parallel-size", "2", "--pipe-parallel-size", "2", "--batch-size", "8",
        "--gas", "1", "--train-iters", "120", "--hidden-dropout", "0", "--attention-dropout",
        "0", "--lr", "1e-2", "--min-lr", "1e-3", "--warmup", "10", "--log-interval", "40",
        "--save", ckpt), timeout=400)[0][0]
    assert len(losses) == 120
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < first - 1.5, (first, last)
    # The pipeline checkpoint (tp=2, pp=2) decodes in one process: the tool reshards it.
    # Every target of span corruption starts with the first sentinel; the trained model
    # has learned that much (an untrained one picks any of its 512 ids).
    result = run_script(["tools/generate_t5.py", "--load", ckpt, "--max-new-tokens", "8",
                         "--text", "Return the <extra_id_0> of the tensor."], timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    target = result.stdout.split("===== target =====\n")[1]
    assert target.startswith("<extra_id_0>"), result.stdout
    assert "===== filled =====\nReturn the [" in result.stdout

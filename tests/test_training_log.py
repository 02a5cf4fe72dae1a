"""The training log: Megatron's FLOP count, the progress line, TensorBoard scalars."""
import contextlib
import io

import pytest

from gpt2_runs import gpt2_argv
from harness import run_distributed
from megatron.config import saved_run_config
from megatron.training.training_log import model_flops_per_step, throughput


def _matmul_flops(b, s, layers, h, vocab):
    """Independent count: 2 FLOPs per multiply-add of every matmul, backward = 2x forward."""
    per_layer = (2 * b * s * h * 3 * h      # QKV projection
                 + 2 * b * s * s * h         # scores q.k
                 + 2 * b * s * s * h         # probabilities x values
                 + 2 * b * s * h * h         # attention output projection
                 + 2 * 2 * b * s * h * 4 * h)  # MLP up and down
    logits = 2 * b * s * h * vocab
    return 3 * (layers * per_layer + logits)


@pytest.mark.parametrize("b,s,layers,h,vocab", [(8, 1024, 24, 1024, 50304),
                                                (3, 64, 2, 96, 512)])
def test_flops_formula_counts_every_matmul(b, s, layers, h, vocab):
    args = saved_run_config(dict(global_batch_size=b, seq_length=s, num_layers=layers,
                                 hidden_size=h, padded_vocab_size=vocab, world_size=4,
                                 peak_tflops=100.0))
    expected = _matmul_flops(b, s, layers, h, vocab)
    assert model_flops_per_step(args) == pytest.approx(expected, rel=1e-12)
    tokens, tflops, mfu = throughput(args, 2.0)
    assert tokens == pytest.approx(b * s / 2.0)
    assert tflops == pytest.approx(expected / 2.0 / 4 / 1e12)
    assert mfu == pytest.approx(tflops / 100.0)


def _train_logged(argv):
    import pretrain_gpt2

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        state = pretrain_gpt2.main(argv)
    return state.losses, state.eval_losses, out.getvalue()


def test_log_line_and_tensorboard_scalars(gpt2_data, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = tmp_path / "tb"
    argv = gpt2_argv(gpt2_data, "--batch-size", "2", "--train-iters", "6", "--log-interval", "3",
                     "--eval-interval", "3", "--tensorboard-dir", str(tb))
    (losses, evals, out), = run_distributed(_train_logged, 1, argv)
    lines = [line for line in out.splitlines() if line.startswith("iteration")]
    assert len(lines) == 2
    for field in ("consumed samples:", "elapsed time per iteration (ms):", "learning rate:",
                  "lm loss:", "grad norm:", "skipped iterations:", "tokens/s:",
                  "TFLOP/s/device:", "MFU: n/a"):
        assert field in lines[0], (field, lines[0])
    assert "lm loss PPL" in out
    events = EventAccumulator(str(tb))
    events.Reload()
    logged = [e.value for e in events.Scalars("train/lm loss")]
    expected = [sum(losses[:3]) / 3, sum(losses[3:]) / 3]
    assert logged == pytest.approx(expected, rel=1e-6)
    assert [e.value for e in events.Scalars("validation/lm-loss")] == \
        pytest.approx([loss for _, loss in evals], rel=1e-6)

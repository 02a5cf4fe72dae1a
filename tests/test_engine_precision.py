"""bf16 and fp16 through DeepSpeed's engines (tds pipeline and ``--deepspeed``), on CPU.

bf16 runs here wherever DeepSpeed's CPU accelerator has it; fp16 only where it has fp16
(tests/precision.py says which, and the skip reason says so). Tolerances: bf16 keeps 8 bits
of mantissa, so each product rounds at ~2^-9 relative, but the loss is a mean over 2048
tokens and the rounding errors average out: over ten steps of this tiny GPT-2 the bf16
engines' losses stay within 6e-5 (relative) of the fp32 run's (measured on an AMD EPYC CPU;
the parameters are bf16 in the engine). The tolerance 1e-2 leaves room for other CPUs'
kernels while still catching a wrong loss scale, an unscaled gradient or a lost optimizer
state (a jump at the resumed step).
"""
import pytest

from gpt2_runs import full_and_resumed, layout_argv, relative_error as _relative, train_gpt2
from harness import run_distributed
from precision import requires_ds_bf16, requires_ds_fp16

STEPS = 10
BF16_TOLERANCE = 1e-2


def _argv(data, tp, pp, dp, *extra):
    return layout_argv(data, tp, pp, dp, "--eval-interval", "1000", *extra, steps=STEPS)


@pytest.fixture(scope="module")
def fp32_losses(gpt2_data):
    """The serial fp32 run every precision run is compared with."""
    return run_distributed(train_gpt2, 1, _argv(gpt2_data, 1, 1, 1), timeout=300)[0][0]


@pytest.mark.slow
@pytest.mark.precision
@requires_ds_bf16
def test_bf16_zero1_pipeline_tracks_fp32_and_resumes_exactly(gpt2_data, tmp_path,
                                                            fp32_losses):
    argv = _argv(gpt2_data, 1, 2, 2, "--bf16", "--zero-stage", "1")
    (full, _), (resumed, _) = full_and_resumed(train_gpt2, 4, argv, str(tmp_path / "ckpt"), 5)
    assert len(full) == STEPS and len(resumed) == STEPS
    assert max(abs(a - b) for a, b in zip(full, resumed)) <= 1e-6, (full, resumed)
    assert _relative(full, fp32_losses) < BF16_TOLERANCE, (full, fp32_losses)
    assert full[-1] < full[0] - 0.2


@pytest.mark.slow
@pytest.mark.precision
@requires_ds_bf16
def test_bf16_zero1_engine_resumes_at_another_tensor_parallel_size(gpt2_data, tmp_path,
                                                                   fp32_losses):
    """``--deepspeed --bf16 --zero-stage 1`` saved at dp 2, resumed at tp 2: the fp32 masters
    and moments move through their names, so the run goes on as if uninterrupted (up to
    bf16's rounding at the other layout)."""
    ckpt = str(tmp_path / "ckpt")
    extra = ("--deepspeed", "--bf16", "--zero-stage", "1")
    full = run_distributed(train_gpt2, 2, _argv(gpt2_data, 1, 1, 2, *extra, "--save", ckpt,
                                                "--save-interval", "5"), timeout=300)[0][0]
    assert _relative(full, fp32_losses) < BF16_TOLERANCE, (full, fp32_losses)
    with open(f"{ckpt}/latest_checkpointed_iteration.txt", "w") as handle:
        handle.write("5")
    per_rank = run_distributed(train_gpt2, 2, _argv(gpt2_data, 2, 1, 1, *extra, "--load", ckpt),
                               timeout=300)
    for rank, (losses, _) in enumerate(per_rank):
        assert len(losses) == STEPS - 5, (rank, losses)
        assert _relative(losses, full[5:]) < 1e-2, (rank, losses, full[5:])


@pytest.mark.slow
@pytest.mark.precision
@requires_ds_fp16
def test_fp16_zero1_engine_tracks_fp32(gpt2_data, fp32_losses):
    """fp16 with DeepSpeed's dynamic loss scaler (starting at 2^16: the first steps may
    overflow and be skipped, which the loss curve then lags by)."""
    losses = run_distributed(train_gpt2, 2, _argv(gpt2_data, 1, 1, 2, "--deepspeed", "--fp16",
                                                  "--zero-stage", "1"), timeout=300)[0][0]
    assert len(losses) == STEPS
    assert losses[-1] < losses[0] - 0.2
    assert abs(losses[0] - fp32_losses[0]) / fp32_losses[0] < BF16_TOLERANCE


def test_deepspeed_runs_as_one_process_without_a_launcher(gpt2_data):
    # `python pretrain_gpt2.py --deepspeed` on one device: no launcher sets LOCAL_RANK, which
    # DeepSpeed's engine asserts on (found on the H100: the CUDA sync test ran it so).
    import os
    import subprocess
    import sys

    from gpt2_runs import REPO, gpt2_argv

    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    argv = gpt2_argv(gpt2_data, "--batch-size", "2", "--train-iters", "3", "--deepspeed",
                     "--zero-stage", "1", "--eval-iters", "0")
    out = subprocess.run([sys.executable, "pretrain_gpt2.py", *argv], cwd=REPO,
                         env=dict(env, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "iteration        3/       3" in out.stdout, out.stdout[-2000:]

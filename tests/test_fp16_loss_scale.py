"""fp16 without ZeRO: the loss scale is applied once, and DeepSpeed's engine that would not
apply it is refused.

With the scale applied, an fp16 run's losses do not depend on the loss scale (dynamic from
2^16, static 1024, static 1: the same gradients up to fp16 rounding, as none overflows here);
a missing or doubled scale shows (measured with DeepSpeed 0.19's plain fp16 optimizers, which
divide by a scale their engine never applied, deepspeedai/DeepSpeed#8393: 6.2028 instead of
6.1969 at step 3 of the pipeline run, and the gap grows). Clipping is off so that the
comparison is of the scaled gradients alone. The reported gradient norm is the unscaled one.
The pipeline runs through the project's own step (autocast, its loss scaler): torch's fp16
runs on any CPU. ``--deepspeed --fp16`` without ZeRO is refused before any compute.
"""
import pytest

from gpt2_runs import layout_argv, user_error
from harness import run_distributed

STEPS = 6


def _train(argv_list):
    """Rank body: per run, (losses, reported gradient norms)."""
    import megatron.training.backend_step as backend_step
    import pretrain_gpt2

    norms, train_step = [], backend_step.StepBackend.train_step

    def recording(self, *args, **kwargs):
        result = train_step(self, *args, **kwargs)
        norms.append(float(result[2]))
        return result

    backend_step.StepBackend.train_step = recording
    out = []
    for argv in argv_list:
        norms.clear()
        out.append((pretrain_gpt2.main(argv).losses, list(norms)))
    return out


def _runs(data, tp, pp, dp, *extra):
    base = layout_argv(data, tp, pp, dp, "--fp16", "--zero-stage", "0", "--clip-grad", "0",
                       "--eval-interval", "1000", *extra, steps=STEPS)
    return [base, base + ["--loss-scale", "1024"], base + ["--loss-scale", "1"]]


def _check_scale_invariant(results):
    (dynamic, dyn_norms), *statics = results
    assert len(dynamic) == STEPS and dynamic[-1] < dynamic[0] - 0.1, dynamic
    for losses, norms in statics:
        diff = max(abs(a - b) / abs(b) for a, b in zip(losses, dynamic))
        assert diff < 1e-5, (dynamic, losses)
        assert max(abs(a - b) / b for a, b in zip(norms, dyn_norms)) < 1e-3, (dyn_norms, norms)
    assert all(0.1 < n < 100 for n in dyn_norms), dyn_norms  # unscaled (x65536 otherwise)


@pytest.mark.slow
@pytest.mark.precision
def test_fp16_pipeline_without_zero_applies_the_loss_scale(gpt2_data):
    per_rank = run_distributed(_train, 2, _runs(gpt2_data, 1, 2, 1), timeout=300)
    _check_scale_invariant(per_rank[0])  # every stage has the losses and the shared norm


@pytest.mark.precision
def test_fp16_deepspeed_engine_without_zero_is_refused_on_every_rank(gpt2_data):
    messages = run_distributed(user_error, 2, _runs(gpt2_data, 1, 1, 2, "--deepspeed")[0],
                               timeout=300)
    assert all(m is not None and "--zero-stage 1" in m and "#8393" in m for m in messages), \
        messages

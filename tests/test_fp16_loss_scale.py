"""fp16 without ZeRO through DeepSpeed's engines: the loss scale is applied (tds.fp16_loss_scale).

DeepSpeed 0.19's engine.backward leaves the loss unscaled for its plain fp16 optimizers while
their step divides the gradients by the scale (deepspeedai/DeepSpeed#8393): the updates were
65536 times too small. With the scale applied, an fp16 run's losses do not depend on the loss
scale (dynamic from 2^16, static 1024, static 1: the same gradients up to fp16 rounding, as
none overflows here); without it they do (measured: 6.2028 instead of 6.1969 at step 3 of
the pipeline run, and the gap grows). Clipping is off so that the comparison is of the scaled
gradients alone. The reported gradient norm is the unscaled one.
"""
import pytest
import torch

from gpt2_runs import layout_argv
from harness import run_distributed
from precision import requires_ds_fp16

STEPS = 6


def _train(argv_list):
    """Rank body: per run, (losses, reported gradient norms)."""
    import megatron.training.backend_engine as backend_engine
    import pretrain_gpt2

    norms, train_step = [], backend_engine.EngineBackend.train_step

    def recording(self, *args, **kwargs):
        result = train_step(self, *args, **kwargs)
        norms.append(float(result[2]))
        return result

    backend_engine.EngineBackend.train_step = recording
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
@requires_ds_fp16
def test_fp16_pipeline_without_zero_applies_the_loss_scale(gpt2_data):
    per_rank = run_distributed(_train, 2, _runs(gpt2_data, 1, 2, 1), timeout=300)
    _check_scale_invariant(per_rank[1])  # the last stage's losses and the shared norm


@pytest.mark.slow
@pytest.mark.precision
@requires_ds_fp16
def test_fp16_deepspeed_engine_without_zero_applies_the_loss_scale(gpt2_data):
    per_rank = run_distributed(_train, 2, _runs(gpt2_data, 1, 1, 2, "--deepspeed"),
                               timeout=300)
    _check_scale_invariant(per_rank[0])


class _Optimizer:
    loss_scale = 256.0


class _Engine:
    optimizer = _Optimizer()

    @staticmethod
    def gradient_accumulation_steps():
        return 4


@pytest.mark.parametrize("deepspeed_scaled", [False, True])
def test_the_scale_is_applied_once_whether_deepspeed_applies_it_or_not(deepspeed_scaled):
    """A DeepSpeed with the fix (#8393) sends ``scale/gas`` into the loss: nothing is added;
    without it ``1/gas``: the hook multiplies by the scale. Anything else is an error."""
    from tds.fp16_loss_scale import LossScale

    fix = LossScale(_Engine())
    leaf = torch.rand((), requires_grad=True)
    loss = leaf * 3.0
    scaled = loss * (256.0 if deepspeed_scaled else 1.0) / 4  # what DeepSpeed's backward runs
    fix.attach(loss)
    scaled.backward()
    assert fix.deepspeed_scales is deepspeed_scaled
    assert torch.allclose(leaf.grad, torch.tensor(3.0 * 256.0 / 4))  # scaled exactly once
    with pytest.raises(RuntimeError, match="scaled the loss by 16"):
        LossScale._deepspeed_applied(16.0, 256.0)

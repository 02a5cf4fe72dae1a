"""One training step at every layout: a pp 2 step runs the same optimizer, clipping,
loss-scaler and gradient-reduction code as a pp 1 step, each once per step, fp16 overflow
skips included; and the stats a forward step returns are logged at pp 2 as at pp 1.

The run is GPT-2 through pretrain() in fp16 with an initial loss scale of 2^24, so the
first steps overflow and are skipped (the scale halves each time, hysteresis 1) before it
trains. Counters wrap the classes' methods in the rank processes: the optimizer's step, the
norm (:func:`megatron.mpu.norm_of_grads`: the clipping's), the loss scaler's update and
the data-parallel wrapper's gradient reduction. The family's loss returns an extra stat
(``loss squared``, which is not ``lm loss``'s square: the mean of squares over
micro-batches), which must reach the log line at both layouts with the same values.
"""
import dataclasses

import pytest

from gpt2_runs import layout_argv
from harness import run_distributed

STEPS = 6


def _counted(argv):
    """Rank body: pretrain GPT-2 with counting wrappers; per step what was called, the
    classes that ran, the logged stats, the skipped steps and the losses."""
    import collections

    from megatron import mpu
    from megatron.distributed import DataParallel
    from megatron.families.gpt2 import FAMILY as GPT2
    from megatron.optimizer import DynamicGradScaler, MegatronOptimizer
    from megatron.training import loop, pretrain

    calls, classes, logged = collections.Counter(), set(), []

    def counting(owner, name, label):
        original = getattr(owner, name)

        def run(*args, **kwargs):
            calls[label] += 1
            if args and not isinstance(owner, type(mpu)):
                classes.add((label, type(args[0]).__name__))
            return original(*args, **kwargs)

        setattr(owner, name, run)

    counting(MegatronOptimizer, "step", "optimizer step")
    counting(DataParallel, "finish_grad_sync", "gradient reduction")
    counting(DynamicGradScaler, "update", "loss scaler")
    counting(mpu, "norm_of_grads", "gradient norm")
    log = loop.log_training_step
    loop.log_training_step = lambda cfg, state, stats, *a, **kw: (
        logged.append(dict(stats)), log(cfg, state, stats, *a, **kw))[1]

    def loss_with_stats(outputs, labels):
        loss = GPT2.loss_fn(outputs, labels)
        return loss, {"loss squared": loss.detach() ** 2}

    def build(cfg, pipeline):
        model = GPT2.build_model(cfg, pipeline)
        if pipeline:
            model.loss_fn = loss_with_stats
        return model

    family = dataclasses.replace(GPT2, loss_fn=loss_with_stats, build_model=build)
    state = pretrain(family=family, argv=argv)
    return dict(calls), sorted(classes), logged, state.skipped_iters, state.losses


def _argv(data, pp):
    return layout_argv(data, 1, pp, 1, "--fp16", "--initial-scale-power", "24",
                       "--hysteresis", "1", "--log-interval", "1", "--eval-interval", "1000",
                       steps=STEPS)


@pytest.mark.slow
def test_a_pp2_step_is_a_pp1_step(gpt2_data):
    serial = run_distributed(_counted, 1, _argv(gpt2_data, 1), timeout=300)[0]
    pipeline = run_distributed(_counted, 2, _argv(gpt2_data, 2), timeout=300)
    calls, classes, logged, skipped, losses = serial
    assert 1 <= skipped < STEPS  # overflows were skipped, then it trained
    # fp16 steps with torch's fused AdamW: the overflow is a non-finite norm, skipped on the
    # device, so every step measures the norm
    assert calls == {"optimizer step": STEPS, "gradient reduction": STEPS, "loss scaler": STEPS,
                     "gradient norm": STEPS}
    assert classes == sorted({("optimizer step", "MegatronOptimizer"),
                              ("gradient reduction", "DataParallel"),
                              ("loss scaler", "DynamicGradScaler")})
    for rank, (p_calls, p_classes, p_logged, p_skipped, p_losses) in enumerate(pipeline):
        assert (p_calls, p_classes, p_skipped) == (calls, classes, skipped), rank
        assert len(p_losses) == STEPS
        assert max(abs(a - b) / b for a, b in zip(p_losses, losses)) < 1e-3, (p_losses, losses)
    logged_pp = pipeline[-1][2]  # the rank that prints the log line
    assert [sorted(s) for s in logged_pp] == [sorted(s) for s in logged] and \
        all("loss squared" in s for s in logged), logged
    for one, two in zip(logged, logged_pp):
        assert one["loss squared"] == pytest.approx(two["loss squared"], rel=1e-3)
        # the mean of each micro-batch's square, not the square of the mean
        assert one["loss squared"] >= one["lm loss"] ** 2 * (1 - 1e-6)

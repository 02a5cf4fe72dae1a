"""Rank body of tests/test_recompute.py: several training runs in one launch, each with its
losses and how many recomputed blocks ran their backward (every ``mpu.checkpoint`` call
that ran again in the backward)."""


def _counting():
    """Patch CheckpointFunction.backward to count its calls; returns the counter."""
    from megatron.mpu import random as mpu_random

    counter = {"n": 0}
    original = mpu_random.CheckpointFunction.backward
    if getattr(original, "_counting", False):
        return original._counter

    def backward(ctx, *grads):
        counter["n"] += 1
        return original(ctx, *grads)

    backward._counting, backward._counter = True, counter
    mpu_random.CheckpointFunction.backward = staticmethod(backward)
    return counter


def train_variants(script, variants):
    """``pretrain`` of ``script`` ("gpt2" or "t5") for each argv of ``variants``, one after
    another in this process; per run ``(losses, recomputed blocks, start-up lines about
    recompute)``."""
    import contextlib
    import importlib
    import io

    from megatron import mpu

    main = importlib.import_module(f"pretrain_{script}").main
    counter = _counting()
    out = []
    for argv in variants:
        counter["n"] = 0
        log = io.StringIO()
        try:
            with contextlib.redirect_stdout(log):
                state = main(argv)
        finally:
            if mpu.model_parallel_is_initialized():
                mpu.destroy_model_parallel()
        lines = [x for x in log.getvalue().splitlines() if x.startswith("> recompute")]
        out.append((state.losses, counter["n"], lines))
    return out

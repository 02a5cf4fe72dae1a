"""Loss scaler (against DeepSpeed's), overflow skipping, parameter groups and the LR schedule."""
import math
import random

import pytest
import torch

from harness import run_distributed
from megatron import mpu
from megatron.optimizer.learning_rates import AnnealingLR
from megatron.optimizer import DynamicGradScaler, MegatronOptimizer, get_param_groups


def _compare_with_deepspeed(seed, window, hysteresis):
    import tds as deepspeed
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    deepspeed.init_distributed(dist_backend="gloo")  # its scaler logs via deepspeed.comm
    rng = random.Random(seed)
    ours = DynamicGradScaler(2.0**16, min_scale=4.0, window=window, hysteresis=hysteresis)
    ref = DynamicLossScaler(init_scale=2.0**16, scale_window=window, min_scale=4.0,
                            delayed_shift=hysteresis, consecutive_hysteresis=False,
                            raise_error_at_min_scale=False)
    scales = []
    # Bursts of overflows and long clean stretches, so growth, backoff and floor all happen.
    for _ in range(400):
        overflow = rng.random() < (0.6 if rng.random() < 0.2 else 0.02)
        ours.update(overflow)
        ref.update_scale(overflow)
        scales.append((ours.scale, ref.cur_scale))
    return scales


@pytest.mark.parametrize("window,hysteresis", [(5, 1), (7, 2), (3, 3)])
def test_dynamic_scaler_matches_deepspeed(seed, window, hysteresis):
    (scales,) = run_distributed(_compare_with_deepspeed, 1, seed, window, hysteresis)
    assert [a for a, _ in scales] == [b for _, b in scales]
    assert len({a for a, _ in scales}) > 3  # the sequence really moved the scale


def test_scaler_semantics_by_hand():
    s = DynamicGradScaler(1024.0, min_scale=1.0, window=3, hysteresis=2)
    s.update(True)
    assert s.scale == 1024.0  # first overflow absorbed by hysteresis
    s.update(True)
    assert s.scale == 512.0   # second one halves
    for _ in range(3):
        s.update(False)
    assert s.scale == 512.0   # window not complete yet (DeepSpeed counts from the next step)
    s.update(False)
    assert s.scale == 1024.0


def _overflow_step(seed):
    mpu.initialize_model_parallel(1, 1)
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    before = [p.detach().clone() for p in model.parameters()]
    scaler = DynamicGradScaler(2.0**10, window=2, hysteresis=1)
    opt = MegatronOptimizer(torch.optim.AdamW(model.parameters(), lr=0.1), scaler, clip_grad=1.0)
    x = torch.randn(5, 4)
    opt.scale_loss(model(x).sum()).backward()
    model.weight.grad[0, 0] = float("inf")  # injected overflow
    updated, norm = opt.step()
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    result = {"skipped": not updated, "norm": norm, "unchanged": unchanged,
              "scale_after_overflow": scaler.scale, "grads_cleared": model.weight.grad is None}
    scales = []
    for _ in range(3):
        opt.zero_grad()
        opt.scale_loss(model(x).sum()).backward()
        updated, _ = opt.step()
        scales.append((updated, scaler.scale))
    result["scales"] = scales
    return result


def test_injected_overflow_skips_step_and_halves_scale(seed):
    (r,) = run_distributed(_overflow_step, 1, seed)
    assert r["skipped"] and r["norm"] is None and r["unchanged"] and r["grads_cleared"]
    assert r["scale_after_overflow"] == 2.0**9
    # window=2: the 3rd clean step (2 after the first) doubles the scale.
    assert r["scales"] == [(True, 2.0**9), (True, 2.0**9), (True, 2.0**10)]


def _unscaled_grads_match(seed):
    mpu.initialize_model_parallel(1, 1)
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    x = torch.randn(5, 4)
    model(x).pow(2).sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    scaler = DynamicGradScaler(2.0**12)
    opt = MegatronOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), scaler, clip_grad=0.0)
    opt.scale_loss(model(x).pow(2).sum()).backward()
    opt.step()
    return max((p.grad - e).abs().max().item() for p, e in zip(model.parameters(), expected))


def test_gradients_are_unscaled_before_the_update(seed):
    (err,) = run_distributed(_unscaled_grads_match, 1, seed)
    assert err < 1e-6


def test_no_weight_decay_on_biases_and_norms():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.LayerNorm(4),
                                torch.nn.Linear(4, 4))
    decay, no_decay = get_param_groups([model], 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert {id(p) for p in decay["params"]} == {id(model[0].weight), id(model[2].weight)}
    assert {id(p) for p in no_decay["params"]} == {id(model[1].weight), id(model[1].bias),
                                                   id(model[2].bias)}


@pytest.mark.parametrize("style", ["linear", "cosine", "constant"])
def test_lr_schedule(style):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = AnnealingLR(opt, max_lr=1.0, min_lr=0.1, warmup_steps=10, decay_steps=110,
                        decay_style=style)
    lrs = [opt.param_groups[0]["lr"]] + [sched.step() for _ in range(130)]
    assert lrs[0] == 0.0 and lrs[5] == pytest.approx(0.5) and lrs[10] == pytest.approx(1.0)
    mid = {"linear": 0.55, "cosine": 0.55, "constant": 1.0}[style]
    assert lrs[60] == pytest.approx(mid)
    if style == "cosine":
        assert lrs[35] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.25)))
    end = 1.0 if style == "constant" else 0.1
    assert lrs[110] == pytest.approx(end) and lrs[130] == pytest.approx(end)
    restored = AnnealingLR(opt, 1.0, 0.1, 10, 110, style)
    restored.load_state_dict(sched.state_dict())
    assert restored.get_lr() == pytest.approx(lrs[130])


def _overflow_on_device(seed):
    """fp16 loss scaling with a fused AdamW: an injected overflow is skipped on the device
    (weights, moments and step count untouched), the scale halves, nothing is read back."""
    from sync_count import SyncCounter

    mpu.initialize_model_parallel(1, 1)
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    scaler = DynamicGradScaler(2.0**10, window=2, hysteresis=1)
    opt = MegatronOptimizer(torch.optim.AdamW(model.parameters(), lr=0.1, fused=True), scaler,
                            clip_grad=1.0)
    x = torch.randn(5, 4)
    results = []
    for step in range(5):
        opt.zero_grad()
        opt.scale_loss(model(x).sum()).backward()
        if step == 1:
            model.weight.grad[0, 0] = float("inf")  # injected overflow
        before = [p.detach().clone() for p in model.parameters()]
        state = [{k: v.clone() for k, v in opt.optimizer.state[p].items()}
                 for p in model.parameters()] if step else None
        with SyncCounter() as counter:
            updated, _ = opt.step()
        unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        same_state = state is not None and all(
            torch.equal(v, opt.optimizer.state[p][k])
            for p, s in zip(model.parameters(), state) for k, v in s.items())
        results.append((bool(updated), unchanged, same_state, scaler.scale, counter.events))
    return results


def test_overflow_skipped_on_the_device_without_a_read(seed):
    (results,) = run_distributed(_overflow_on_device, 1, seed)
    assert [r[4] for r in results] == [[]] * 5  # no host read in any step
    assert [r[0] for r in results] == [True, False, True, True, True]
    assert [r[1] for r in results] == [False, True, False, False, False]
    assert results[1][2]  # moments and step count untouched by the skipped step
    # window 2, hysteresis 1: halved at the overflow, doubled 2 clean steps after the first
    assert [r[3] for r in results] == [2.0**10, 2.0**9, 2.0**9, 2.0**9, 2.0**10]

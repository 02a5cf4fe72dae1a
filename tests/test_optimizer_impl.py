"""The fused AdamW used on CUDA takes the same steps as the default implementation."""
import pytest
import torch

from megatron.optimizer import get_param_groups
from megatron.optimizer.adamw import adamw_kwargs, build_adamw


def _train(impl, seed, steps=5):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                                torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))
    opt = build_adamw(get_param_groups([model], 0.1), lr=1e-2, betas=(0.9, 0.95), eps=1e-8,
                      weight_decay=0.1, impl=impl)
    g = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], opt


@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_fused_and_foreach_adamw_match_the_default_path(seed, impl):
    reference, opt = _train("auto", seed)  # CPU: torch's default (the path used so far)
    assert opt.defaults.get("fused") in (None, False)
    ours, opt = _train(impl, seed)
    assert opt.defaults.get(impl) is True
    for a, b in zip(ours, reference):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert any(not torch.equal(a, torch.zeros_like(a)) for a in ours)


def test_auto_picks_fused_only_on_cuda():
    assert adamw_kwargs([torch.nn.Parameter(torch.zeros(2))]) == {}
    meta = torch.nn.Parameter(torch.zeros(2, device="meta"))
    assert adamw_kwargs([{"params": [meta]}]) == {}
    with pytest.raises(ValueError, match="unknown AdamW implementation"):
        adamw_kwargs([], impl="apex")


def _megatron_steps(impl, seed, fp16, steps=6, overflow_at=3):
    """MegatronOptimizer over a small model on one gloo rank: ``steps`` steps with clipping
    that acts (max norm 0.05), fp16 with a dynamic loss scale and a gradient made inf at
    ``overflow_at``. Returns the parameters, the grad norms and the loss scales."""
    from megatron import mpu
    from megatron.optimizer import MegatronOptimizer, build_grad_scaler

    mpu.initialize_model_parallel(1, 1)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    adam = build_adamw(get_param_groups([model], 0.1), lr=1e-2, betas=(0.9, 0.95), eps=1e-8,
                       weight_decay=0.1, impl=impl)
    precision = type("P", (), {"fp16": fp16, "loss_scale": 0, "initial_scale_power": 8,
                               "min_loss_scale": 1.0, "loss_scale_window": 1000,
                               "hysteresis": 1})()
    opt = MegatronOptimizer(adam, build_grad_scaler(precision) if fp16 else None, 0.05)
    g = torch.Generator().manual_seed(seed + 1)
    norms, scales = [], []
    for step in range(steps):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        opt.zero_grad()
        opt.scale_loss(torch.nn.functional.mse_loss(model(x), y)).backward()
        if fp16 and step == overflow_at:
            model[0].weight.grad[0, 0] = float("inf")
        updated, norm = opt.step()
        norms.append(float("nan") if norm is None else float(norm))
        scales.append(opt.loss_scale)
        assert bool(updated) == (not fp16 or step != overflow_at)
    return [p.detach().clone() for p in model.parameters()], norms, scales


@pytest.mark.parametrize("fp16", [False, True])
def test_fused_step_takes_the_clip_and_the_unscale_as_its_grad_scale(seed, fp16):
    """The fused path (clip coefficient and loss scale in AdamW's grad_scale, overflow from the
    norms) takes the steps of the explicit path (unscale, clip in place, then AdamW)."""
    from harness import run_distributed

    fused, explicit = (run_distributed(_megatron_steps, 1, impl, seed, fp16)[0]
                       for impl in ("fused", "foreach"))
    for a, b in zip(fused[0], explicit[0]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert fused[2] == explicit[2]  # the same loss-scale history (the overflow halves it)
    finite = [(a, b) for a, b in zip(fused[1], explicit[1]) if b == b and abs(b) != float("inf")]
    torch.testing.assert_close(torch.tensor([a for a, _ in finite]),
                               torch.tensor([b for _, b in finite]), rtol=1e-5, atol=0)
    assert min(b for _, b in finite) > 0.05  # the clip acted on every step

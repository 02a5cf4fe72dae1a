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

"""Shared experts (Qwen-MoE, DeepSeek-MoE): a dense feed-forward every token goes through,
added to the routed experts' output; split over tp like any dense MLP."""
import math

import torch
from torch import nn

from ..layers import ColumnParallelLinear, RowParallelLinear
from .experts import _activation


def _normal(std):
    return lambda w: nn.init.normal_(w, mean=0.0, std=std)


class SharedExpertMLP(nn.Module):
    """``[T, h] -> [T, h]`` of width ``shared_expert_intermediate_size`` (gated like the
    routed experts when their activation is).

    Args:
        config: the :class:`~megatron.mpu.moe.MoEConfig`.
    """

    def __init__(self, config):
        super().__init__()
        width = config.shared_expert_intermediate_size
        out_std = config.output_init_std or config.init_method_std
        self.gated = config.gated
        self.activation = _activation(config.activation)
        # gated: [gate; up] laid out per tp rank (stride 2), as the routed experts
        self.fc1 = ColumnParallelLinear(config.hidden_size, (2 if self.gated else 1) * width,
                                        bias=False, gather_output=False,
                                        init_method=_normal(config.init_method_std),
                                        stride=2 if self.gated else 1)
        self.fc2 = RowParallelLinear(width, config.hidden_size, bias=False,
                                     input_is_parallel=True, init_method=_normal(out_std))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.fc1(x)  # [T, F1/tp]
        out, _ = self.fc2(self.activation(hidden))
        return out


def scaled_output_std(std: float, num_layers: int) -> float:
    """GPT-2's ``std / sqrt(2 L)`` for projections that feed the residual."""
    return std / math.sqrt(2.0 * num_layers)

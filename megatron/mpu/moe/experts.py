"""The experts of one MoE layer as stacked weights (Megatron-core's ``GroupedMLP``).

This rank holds ``E / ep`` experts (the expert-parallel split, dim 0), each expert's
feed-forward split over the tensor-parallel ranks like a dense one (expert tensor
parallelism = tp: the first projection's outputs and the second's inputs):

    weight1  [E/ep, F1/tp, h]    F1 = ffn (or 2 ffn: [gate; up] for swiglu / geglu)
    weight2  [E/ep, h, ffn/tp]

The output is this rank's partial sum over tp (the MoE layer reduces it once). No biases, as
Megatron-core's grouped experts. Each expert's full weights are drawn from a seed of its own
(``derive_seed(seed, expert)``), so any ep / tp slice of any layout holds the same numbers.

Every expert parameter carries ``allreduce = False`` and ``expert_parallel = True`` (its
gradient is reduced over the expert-data-parallel group, not dp x cp) and
``expert_dim = 0`` / ``num_experts`` for the checkpoint's sharding record.
"""
import hashlib
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..layers import set_tensor_model_parallel_attributes
from ..utils import divide, get_device
from .grouped_gemm import (expert_offsets, grouped_linear, looped_linear, padded_linear,
                           use_grouped)


def _activation(name):
    def gated(act):
        def f(x):
            gate, up = x.chunk(2, dim=-1)
            return act(gate) * up
        return f

    gelu = lambda x: F.gelu(x, approximate="tanh")  # noqa: E731
    return {"gelu": gelu, "relu": F.relu, "swiglu": gated(F.silu), "geglu": gated(gelu)}[name]


def mark_expert_parameter(param: torch.Tensor, num_experts: int) -> None:
    """The marks every expert parameter carries (see the module docstring)."""
    param.allreduce = False
    param.expert_parallel = True
    param.expert_dim = 0
    param.num_experts = num_experts


def is_expert_parameter(param: torch.Tensor) -> bool:
    """Whether ``param`` is split over the expert-parallel ranks."""
    return bool(getattr(param, "expert_parallel", False))


def _tp_slice(master, dim, tp_rank, tp_size, stride):
    chunks = torch.chunk(master, tp_size * stride, dim=dim)
    return torch.cat(chunks[tp_rank::tp_size], dim=dim)


class GroupedExperts(nn.Module):
    """This rank's experts: rows grouped by expert in, their partial outputs out.

    Args:
        config: the :class:`~megatron.mpu.moe.MoEConfig`.
        seed: the layer's expert seed (each expert's weights: ``derive_seed(seed, e)``).
        ep_rank, ep_size: this rank's place in the expert-parallel group.
        tp_rank, tp_size: and in the tensor-parallel group.
        device: parameter device (default: mpu's).
    """

    def __init__(self, config, seed: int, ep_rank: int, ep_size: int, tp_rank: int,
                 tp_size: int, device=None):
        super().__init__()
        e, f, h = config.num_experts, config.ffn_hidden_size, config.hidden_size
        self.num_local = divide(e, ep_size, "--num-experts", "--expert-model-parallel-size")
        divide(f, tp_size, "--moe-ffn-hidden-size", "the tensor-model-parallel size")
        self.first = ep_rank * self.num_local
        self.grouped, self.activation = config.grouped_gemm, _activation(config.activation)
        stride = 2 if config.gated else 1
        w1, w2 = [], []
        for expert in range(self.first, self.first + self.num_local):
            fc1, fc2 = _draw_expert(config, seed, expert)
            w1.append(_tp_slice(fc1, 0, tp_rank, tp_size, stride))
            w2.append(_tp_slice(fc2, 1, tp_rank, tp_size, 1))
        device = get_device() if device is None else device
        self.weight1 = nn.Parameter(torch.stack(w1).to(device))
        self.weight2 = nn.Parameter(torch.stack(w2).to(device))
        set_tensor_model_parallel_attributes(self.weight1, True, 1, stride)
        set_tensor_model_parallel_attributes(self.weight2, True, 2, 1)
        for weight in (self.weight1, self.weight2):
            mark_expert_parameter(weight, e)

    def forward(self, rows: torch.Tensor, sizes: torch.Tensor,
                sizes_host: Optional[List[int]] = None) -> torch.Tensor:
        """``rows [N, h]`` grouped by local expert -> ``[N, h]`` (partial over tp).

        Args:
            rows: expert 0's rows first.
            sizes: ``[E/ep]`` rows per local expert, on the device.
            sizes_host: the same on the host, when the caller has it (the loop needs it).
        """
        if use_grouped(rows, self.grouped, self.weight1, self.weight2):
            offsets = expert_offsets(sizes)
            hidden = self.activation(grouped_linear(rows, self.weight1, offsets))
            return grouped_linear(hidden, self.weight2, offsets)
        host = sizes_host if sizes_host is not None else sizes.tolist()
        hidden = self.activation(looped_linear(rows, self.weight1, host))
        return looped_linear(hidden, self.weight2, host)

    def forward_padded(self, buffer: torch.Tensor) -> torch.Tensor:
        """``[E/ep, M, h]`` (each expert's rows padded to M) -> ``[E/ep, M, h]``."""
        return padded_linear(self.activation(padded_linear(buffer, self.weight1)), self.weight2)


def expert_seed(seed: int, expert: int) -> int:
    """A stable 63-bit seed of one expert (the same in every process, run and layout)."""
    digest = hashlib.sha256(f"{seed}/expert/{expert}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % (2**63 - 1)


def _draw_expert(config, seed, expert):
    """One expert's full ``(fc1 [F1, h], fc2 [h, ffn])``, drawn on the CPU from its own
    generator (the default generator is not touched)."""
    h, f = config.hidden_size, config.ffn_hidden_size
    generator = torch.Generator().manual_seed(expert_seed(seed, expert))
    out_std = config.output_init_std or config.init_method_std
    fc1 = torch.empty((2 if config.gated else 1) * f, h).normal_(
        0.0, config.init_method_std, generator=generator)
    fc2 = torch.empty(h, f).normal_(0.0, out_std, generator=generator)
    return fc1, fc2

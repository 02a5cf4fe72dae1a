"""The default gradient clip of tds's pipeline engine: the model's norm at any layout.

DeepSpeed's fp32 ``clip_grad_norm_`` with a pipeline grid counts replicated parameters
(layer norms, row-parallel biases) only where the rank in the pipe x tensor group is 0,
i.e. on the first stage, and the tied embedding on both of its stages, so its norm is not
the serial model's once pp > 1. Here each parameter counts exactly once: a tensor-parallel
one (``tensor_model_parallel`` / ``model_parallel``, DeepSpeed's test) on every tensor-
parallel rank, a replicated one on tensor-parallel rank 0, a tied copy
(``ds_pipe_replicated``, set by DeepSpeed on every holder but the first) nowhere; the sum
runs over the pipe x tensor group. Gradients are scaled by ``min(1, max_norm / (norm +
1e-6))`` with no host read (DeepSpeed's and torch's coefficient).
"""
import math
from typing import Iterable

import torch
import torch.distributed as dist
from deepspeed.runtime.utils import is_model_parallel_parameter


def _counts(param, tp_rank: int) -> bool:
    if getattr(param, "ds_pipe_replicated", False) or getattr(param, "shared", False):
        return False
    return is_model_parallel_parameter(param) or tp_rank == 0


@torch.no_grad()
def clip_grad_norm_over_grid(parameters: Iterable[torch.nn.Parameter], max_norm: float,
                             grid, norm_type: float = 2.0) -> torch.Tensor:
    """Clip gradients in place by the norm of the whole model replica.

    Args:
        parameters: this stage's parameters.
        max_norm: largest allowed norm (0 or less: measure only).
        grid: DeepSpeed's ``PipelineParallelGrid`` (tensor rank, pipe x tensor group).
        norm_type: p of the p-norm; ``inf`` for the max norm.

    Returns:
        The norm before clipping, a 0-dim fp32 tensor on the gradients' device.
    """
    params = [p for p in parameters if p.grad is not None]
    device = params[0].grad.device if params else torch.device("cpu")
    counted = [p.grad for p in params if _counts(p, grid.get_slice_parallel_rank())]
    norm_type = float(norm_type)
    total = torch.zeros((), dtype=torch.float32, device=device)
    if counted:
        norms = torch.stack([n.float() for n in torch._foreach_norm(counted, norm_type)])
        total = norms.max() if math.isinf(norm_type) else norms.pow(norm_type).sum()
    group = grid.get_model_parallel_group()
    if dist.get_world_size(group) > 1:
        op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
        dist.all_reduce(total, op=op, group=group)
    if not math.isinf(norm_type):
        total = total.pow(1.0 / norm_type)
    if max_norm > 0 and params:
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_([p.grad for p in params], coef)
    return total

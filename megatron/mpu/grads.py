"""Gradient-norm clipping across a tensor x pipeline parallel model."""
import math

import torch
import torch.distributed as dist

from . import parallel_state as ps


def param_is_shared(param):
    """A copy of a parameter owned by another stage (tied embedding on the last stage)."""
    return bool(getattr(param, "shared", False) or getattr(param, "ds_pipe_replicated", False))


def _is_counted(param, tp_rank):
    """Whether ``param``'s gradient counts toward the norm on this rank: each distinct
    parameter exactly once across the model-parallel group."""
    if param_is_shared(param):
        return False
    return bool(getattr(param, "tensor_model_parallel", False) or tp_rank == 0)


def _counted_grads(parameters, tp_rank):
    """Gradients that count toward the norm: each distinct parameter exactly once."""
    return [p.grad for p in parameters if p.grad is not None and _is_counted(p, tp_rank)]


def _local_norm_pow(grads, norm_type, device):
    """Sum of |g|^p over this rank's counted gradients (max |g| for the inf-norm), fp32.

    One ``_foreach_norm`` with an fp32 result for every gradient (no cast per gradient,
    whatever their dtypes)."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    return _pow_sum(torch._foreach_norm(grads, norm_type, dtype=torch.float32), norm_type)


def _pow_sum(norms, norm_type):
    norms = torch.stack(list(norms))
    if math.isinf(norm_type):
        return norms.max()
    return norms.pow(norm_type).sum()


def _global(total, norm_type, group):
    """This rank's sum of |g|^p -> the model replica's norm (collective over ``group``)."""
    if dist.get_world_size(group) > 1:
        op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
        dist.all_reduce(total, op=op, group=group)
    return total if math.isinf(norm_type) else total.pow(1.0 / norm_type)


def clip_coefficient(total_norm, max_norm):
    """``min(1, max_norm / (norm + 1e-6))`` as a device tensor (what the gradients are
    multiplied by; no host sync to decide whether to clip)."""
    return (max_norm / (total_norm + 1e-6)).clamp(max=1.0)


@torch.no_grad()
def norm_of_grads(grads, counted, group, norm_type=2.0, device=None, expert=None,
                  expert_group=None):
    """The p-norm of the ``counted`` gradients over ``group``, and every gradient's own norm.

    The one norm every optimizer of the project measures: one ``_foreach_norm`` (fp32
    results) over the gradients, the counted ones' p-th powers summed (max for the inf-norm)
    and reduced over ``group``.

    Args:
        grads: gradient tensors (whole parameters, or the slices a rank updates).
        counted: per gradient, whether it counts toward the norm on this rank (each element
            of the model exactly once over ``group``).
        group: the process group the sum runs over (None: the default group).
        norm_type: p of the p-norm.
        device: where the result lives when there are no gradients.
        expert, expert_group: per gradient, whether it is an expert's (MoE: each
            expert-parallel rank holds other experts), whose part is first summed over
            ``expert_group`` (the expert-parallel group) before the sum over ``group``.

    Returns:
        ``(total, norms)``: the 0-dim fp32 norm and the fp32 norm of each gradient.
    """
    norm_type = float(norm_type)
    norms = list(torch._foreach_norm(list(grads), norm_type, dtype=torch.float32)) \
        if grads else []
    expert = expert or [False] * len(norms)
    device = grads[0].device if grads else (device or torch.device("cpu"))
    zero = torch.zeros((), dtype=torch.float32, device=device)
    dense = [n for n, c, e in zip(norms, counted, expert) if c and not e]
    local = _pow_sum(dense, norm_type) if dense else zero
    if any(expert):
        experts = [n for n, c, e in zip(norms, counted, expert) if c and e]
        part = _pow_sum(experts, norm_type) if experts else zero.clone()
        if expert_group is not None and dist.get_world_size(expert_group) > 1:
            op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
            dist.all_reduce(part, op=op, group=expert_group)
        local = torch.maximum(local, part) if math.isinf(norm_type) else local + part
    return _global(local, norm_type, group), norms


def counts_toward_norm(param, tp_rank=None):
    """Whether ``param``'s gradient counts toward the norm on this rank (each distinct
    parameter once across the model-parallel group: split ones on every tp rank, replicated
    ones on tp rank 0, tied copies on their owner only)."""
    tp_rank = ps.get_tensor_model_parallel_rank() if tp_rank is None else tp_rank
    return _is_counted(param, tp_rank)


@torch.no_grad()
def grad_norms(parameters, norm_type=2, group=None):
    """The model replica's gradient norm, and every gradient's own norm, from one pass.

    For a caller that applies the clip coefficient itself (a fused optimizer's
    ``grad_scale``) and reads other facts from the per-gradient norms (a non-finite one).

    Args:
        parameters: parameters with gradients (as :func:`clip_grad_norm`).
        norm_type: p of the p-norm.
        group: group to reduce over (default: mpu's model-parallel group).

    Returns:
        ``(total, norms)``: the 0-dim fp32 norm (counted as :func:`clip_grad_norm` counts)
        and the fp32 norm of each parameter's gradient, in order.
    """
    parameters = [p for p in parameters if p.grad is not None]
    group = ps.get_model_parallel_group() if group is None else group
    tp_rank = ps.get_tensor_model_parallel_rank()
    return norm_of_grads([p.grad for p in parameters],
                         [_is_counted(p, tp_rank) for p in parameters], group, norm_type)


def clip_grad_norm(parameters, max_norm, norm_type=2, group=None):
    """Clip gradients by their global norm over the whole model replica (in place).

    Megatron's signature and float result (one host sync for the ``float``); training code
    that keeps the norm on the device until it logs uses :func:`clip_grad_norm_tensor`.

    Split parameters count on every tensor-parallel rank; replicated ones only on tp
    rank 0; parameters marked ``shared`` (or DeepSpeed's ``ds_pipe_replicated``) are
    skipped because their owner counts them. The sum runs over the model-parallel
    (tensor x pipeline) group, so every rank gets the norm of the serial model.

    Args:
        parameters: iterable of parameters (or one tensor).
        max_norm: largest allowed norm; gradients are scaled by max_norm / norm if above.
        norm_type: p of the p-norm; ``float('inf')`` for the max norm.
        group: group to reduce over (default: mpu's model-parallel group).

    Returns:
        The total norm (float) before clipping.
    """
    return float(clip_grad_norm_tensor(parameters, max_norm, norm_type, group))


@torch.no_grad()
def clip_grad_norm_tensor(parameters, max_norm, norm_type=2, group=None):
    """:func:`clip_grad_norm` without a host sync: returns the norm as a 0-dim fp32 tensor
    on the gradients' device (same arguments)."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    parameters = [p for p in parameters if p.grad is not None]
    norm_type = float(norm_type)
    group = ps.get_model_parallel_group() if group is None else group
    grads = _counted_grads(parameters, ps.get_tensor_model_parallel_rank())
    device = parameters[0].grad.device if parameters else torch.device("cpu")
    total = _global(_local_norm_pow(grads, norm_type, device), norm_type, group)
    # Scale unconditionally by min(1, coef): no host sync to decide whether to clip.
    clip_coef = clip_coefficient(total, max_norm)
    all_grads = [p.grad for p in parameters]
    if all_grads:
        torch._foreach_mul_(all_grads, clip_coef.to(all_grads[0].device))
    return total

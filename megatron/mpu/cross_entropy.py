"""Cross entropy over logits whose vocabulary dimension is split across tensor-parallel ranks.

No rank ever holds the full ``[*, vocab]`` logits: each keeps its slice, and the softmax
normaliser and the target logit are assembled with two small all-reduces over ``[*]``
(Megatron-LM, Shoeybi et al. 2019, Sec. 3: the fused parallel cross entropy).

Two forms of the same loss:

- eager: :class:`_VocabParallelCrossEntropy`, which turns the fp32 logits into the softmax in
  place and keeps it for the backward (Megatron-LM's memory trick: no second ``[*, v/tp]``
  buffer);
- inside ``torch.compile`` (``--compile``): :func:`_composed_cross_entropy`, plain
  differentiable operations whose collectives are the mpu ``g`` operator (all-reduce
  forward, identity backward). Inductor then fuses the forward into one or two passes over
  the logits and recomputes the softmax in the backward from the logits (bf16 under
  autocast) and the per-token log-sum-exp, one pointwise expression: no fp32 copy of the
  logits is kept between forward and backward.
"""
from typing import Optional

import torch
import torch.distributed as dist

from . import parallel_state as ps
from .utils import VocabUtility


class _VocabParallelCrossEntropy(torch.autograd.Function):

    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, group, inplace):
        world = dist.get_world_size(group)
        logits = vocab_parallel_logits.float()  # [*, v/tp]; no copy when already fp32
        ours = inplace or logits is not vocab_parallel_logits

        # Stable softmax: subtract the global max, in the fp32 buffer when it is ours (the
        # softmax then lives in it: no second [*, v/tp] buffer, no fresh pages to fault in).
        logits_max = logits.amax(dim=-1)
        if world > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = (logits.sub_ if ours else logits.sub)(logits_max.unsqueeze(-1))

        part = logits.size(-1)
        start, end = VocabUtility.vocab_range_from_per_partition_vocab_size(
            part, dist.get_rank(group), world)
        outside = (target < start) | (target >= end)
        local_target = (target - start).masked_fill_(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        target_logit.masked_fill_(outside, 0.0)

        exp_logits = shifted.exp_()
        sum_exp = exp_logits.sum(dim=-1)
        # One all-reduce for both per-token sums.
        sums = torch.stack((target_logit, sum_exp))
        if world > 1:
            dist.all_reduce(sums, group=group)
        target_logit, sum_exp = sums.unbind(0)

        loss = torch.log(sum_exp) - target_logit  # [*]
        softmax = exp_logits.div_(sum_exp.unsqueeze(-1))
        ctx.input_dtype = vocab_parallel_logits.dtype
        ctx.save_for_backward(softmax, outside, local_target)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        softmax, outside, local_target = ctx.saved_tensors
        # d loss / d logits = softmax - one_hot(target), restricted to this slice.
        grad = softmax
        grad.scatter_add_(-1, local_target.unsqueeze(-1),
                          outside.logical_not().unsqueeze(-1).to(grad.dtype).neg_())
        grad.mul_(grad_output.unsqueeze(-1))
        return grad.to(ctx.input_dtype), None, None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                 group: Optional[dist.ProcessGroup] = None,
                                 inplace: bool = False) -> torch.Tensor:
    """Per-token cross entropy of vocabulary-split logits.

    Args:
        vocab_parallel_logits: ``[*, vocab / tp]`` this rank's slice of the logits.
        target: ``[*]`` integer ids into the full vocabulary.
        group: tensor-parallel group (default: mpu's).
        inplace: the logits may be overwritten (with the softmax), as Megatron-LM does: for
            logits nothing else reads, such as the models' training loss. fp16/bf16 logits
            are never written (their fp32 copy is).

    Returns:
        ``[*]`` fp32 losses, identical on every rank of the group.
    """
    group = ps.get_tensor_model_parallel_group() if group is None else group
    if torch.compiler.is_compiling():
        return _composed_cross_entropy(vocab_parallel_logits, target, group)
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, group, inplace)


def _composed_cross_entropy(logits: torch.Tensor, target: torch.Tensor,
                            group: dist.ProcessGroup) -> torch.Tensor:
    """The loss as differentiable operations (what compiled code traces).

    ``loss = log(sum_v exp(x_v - m)) + m - x_target`` with ``m`` the (detached) global
    maximum: its gradient is ``softmax(x) - one_hot(target)`` through autograd alone. The
    two sums cross the tensor-parallel ranks with ``g`` (all-reduce forward, identity
    backward: each rank's slice gets the gradient of its own terms once).
    """
    from .mappings import reduce_from_tensor_model_parallel_region as g

    world = dist.get_world_size(group)
    x = logits.float()  # [*, v/tp]; inductor fuses the cast into its readers
    logits_max = x.detach().amax(dim=-1)  # [*]
    if world > 1:
        logits_max = _all_reduce_max(logits_max, group)
    part = x.size(-1)
    # the target's logit as a masked sum, not a gather: its gradient is then a pointwise
    # select inductor fuses into the softmax's (a gather's is a scatter into a zeroed
    # [*, v/tp] buffer); a target in another rank's slice matches no column here
    columns = torch.arange(part, device=x.device) + dist.get_rank(group) * part
    target_logit = torch.where(columns == target.unsqueeze(-1), x, 0.0).sum(dim=-1)
    sum_exp = (x - logits_max.unsqueeze(-1)).exp().sum(dim=-1)  # [*]
    if world > 1:
        sum_exp, target_logit = g(torch.stack((sum_exp, target_logit)), group).unbind(0)
    return torch.log(sum_exp) + logits_max - target_logit


def _all_reduce_max(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Out-of-place all-reduce (max) of a tensor without gradient (a functional collective
    inside compiled code)."""
    import torch.distributed._functional_collectives as funcol

    return funcol.all_reduce(tensor, "max", group)

"""Cross entropy over logits whose vocabulary dimension is split across tensor-parallel ranks.

No rank ever holds the full ``[*, vocab]`` logits: each keeps its slice, and the softmax
normaliser and the target logit are assembled with two small all-reduces over ``[*]``
(Megatron-LM, Shoeybi et al. 2019, Sec. 3: the fused parallel cross entropy).
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
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, group, inplace)

"""Keep padded vocabulary rows out of the softmax.

The vocabulary is padded (``--make-vocab-size-divisible-by`` x tp) so it splits evenly
across the tensor-parallel ranks. The padded rows are real weights, so their logits would
take probability mass: the loss would depend on the padding multiple and on tp (Megatron-LM
has that flaw). Filling those logits with -inf before the softmax makes exp() zero there,
so loss, evaluation and sampling see only the true vocabulary, and their gradient is zero.
Only the last partition(s) hold padding: the fill touches ``[*, padding]`` on those ranks.
"""
import torch.distributed as dist

from . import parallel_state as ps


def mask_padded_vocab_logits_(logits, vocab_size, group=None, partitioned=True):
    """Fill, in place, the logits of ids ``>= vocab_size`` with -inf; returns ``logits``.

    Args:
        logits: ``[*, v/tp]`` this rank's vocabulary slice (or ``[*, v]`` when not
            ``partitioned``); part of the autograd graph is fine (the fill's gradient is 0).
        vocab_size: the true vocabulary size, or None to leave ``logits`` as they are.
        group: tensor-parallel group (default: mpu's) used to find this slice's offset.
        partitioned: False when ``logits`` hold the whole (gathered) vocabulary.
    """
    if vocab_size is None:
        return logits
    part = logits.size(-1)
    start = 0
    if partitioned:
        group = ps.get_tensor_model_parallel_group() if group is None else group
        start = dist.get_rank(group) * part
    first_padded = max(vocab_size - start, 0)
    if first_padded < part:
        logits.narrow(-1, first_padded, part - first_padded).fill_(float("-inf"))
    return logits


def mark_padded_vocab_rows(param):
    """Say that ``param``'s rows along its tensor-parallel dimension are vocabulary entries,
    padded beyond the tokenizer's size (an untied output layer; VocabParallelEmbedding marks
    its own weight): a checkpoint records it, and a layout change re-pads those rows for the
    new tensor-parallel size (megatron/checkpoint/sharding.py).

    Args:
        param: the parameter (marked in place and returned).
    """
    param.padded_vocab_rows = True
    return param

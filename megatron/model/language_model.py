"""Embeddings and the (tied) output layer of the language models."""
import torch.nn.functional as F
from torch import nn

from .. import mpu
from .utils import init_method_normal, init_rng, replicated_parameter


class Embedding(nn.Module):
    """Word embedding (vocab split across tp) + learned positions, then dropout.

    Args:
        hidden_size: h.
        vocab_size: padded vocabulary size (divisible by tp).
        max_position_embeddings: number of learned positions.
        dropout: embedding dropout.
        init_method_std: std of the normal initialisation.
        seed: base seed; the embedding draws from its own derived seed.
        true_vocab_size: the tokenizer's vocabulary (rows beyond it are padding), or None.
        sequence_parallel: return this rank's part of the sequence ``[s/tp, b, h]``.
    """

    def __init__(self, hidden_size, vocab_size, max_position_embeddings, dropout,
                 init_method_std, seed, true_vocab_size=None, sequence_parallel=False):
        super().__init__()
        # The tied output layer reads it to keep padded rows out of the softmax.
        self.true_vocab_size = true_vocab_size
        self.sequence_parallel = sequence_parallel
        init = init_method_normal(init_method_std)
        with init_rng(seed, "embedding"):
            self.word_embeddings = mpu.VocabParallelEmbedding(vocab_size, hidden_size,
                                                              init_method=init)
        # A stream of their own: drawn after the word embedding, the positions would
        # depend on how many padded vocabulary rows were drawn first (i.e. on tp).
        with init_rng(seed, "position_embedding"):
            self.position_embeddings = nn.Embedding(max_position_embeddings, hidden_size,
                                                    _weight=replicated_parameter(
                                                        (max_position_embeddings, hidden_size),
                                                        init, mpu.get_device()))
        self.dropout = nn.Dropout(dropout)

    def forward(self, input_ids, position_ids):  # [b, s] -> [s, b, h] (SP: [s/tp, b, h])
        embeddings = self.word_embeddings(input_ids) + self.position_embeddings(position_ids)
        embeddings = embeddings.transpose(0, 1).contiguous()
        if self.sequence_parallel:
            embeddings = mpu.scatter_to_sequence_parallel_region(embeddings)
        return mpu.sequence_parallel_dropout(self.dropout, embeddings, self.sequence_parallel)


def parallel_lm_logits(hidden, word_embeddings_weight, parallel_output, bias=None,
                       true_vocab_size=None, sequence_parallel=False):
    """Logits against the (tied) word embedding: ``[s, b, h] -> [s, b, v/tp]`` (or ``v``).

    Args:
        hidden: final hidden states.
        word_embeddings_weight: ``[v/tp, h]`` this rank's vocabulary slice.
        parallel_output: keep the vocabulary split (for vocab_parallel_cross_entropy);
            False gathers the full logits.
        bias: optional ``[v/tp]`` output bias.
        true_vocab_size: logits of ids at or beyond it (vocabulary padding) are -inf, so
            they take no probability in the loss, in evaluation or in sampling.
        sequence_parallel: ``hidden`` is this rank's ``[s/tp, b, h]``: all-gather it (the
            gradient is reduce-scattered back) instead of ``f``, keeping only the shard
            for the backward.

    A weight marked by ``mpu.set_weight_grad_deferral`` (the embedding's, or an untied
    head's) defers this GEMM's weight gradient while its store records (docs/mpu.md).
    """
    if sequence_parallel:  # [s/tp, b, h] -> [s, b, v/tp]; only the shard is saved
        logits = mpu.linear_with_sequence_parallel_gather(hidden, word_embeddings_weight, bias)
    else:
        hidden = mpu.copy_to_tensor_model_parallel_region(hidden)
        if mpu.weight_grad_store_of(word_embeddings_weight) is None:
            logits = F.linear(hidden, word_embeddings_weight, bias)
        else:  # mpu.set_weight_grad_deferral: a store may take the weight GEMM
            logits = mpu.deferrable_linear(hidden, word_embeddings_weight, bias)
    # In place on the matmul output (linear does not save it), last partition only.
    mpu.mask_padded_vocab_logits_(logits, true_vocab_size)
    if parallel_output:
        return logits
    return mpu.gather_from_tensor_model_parallel_region(logits)


def lm_loss(logits, labels):
    """Per-token loss ``[b, s]`` from vocab-parallel logits ``[s, b, v/tp]`` and labels ``[b, s]``."""
    return mpu.vocab_parallel_cross_entropy(logits, labels.transpose(0, 1),
                                            inplace=True).transpose(0, 1)


def masked_lm_loss(logits, labels):
    """Mean next-token loss over the unmasked tokens: the loss of GPT-2 and T5, serial and
    pipelined alike.

    Args:
        logits: ``[b, s, v/tp]`` vocab-parallel logits (the model's output, or the pipeline's
            last stage's); fp32 logits are overwritten with the softmax (the loss's own
            buffer, as in Megatron-LM): compute anything else from them first.
        labels: ``(ids [b, s], loss_mask [b, s])``; ``loss_mask`` float, 0 where not counted.

    Under context parallelism (each rank holding part of every sequence) the sums of the
    losses and of the counted tokens are added over the context-parallel group first, so
    every rank returns the mean of the whole sequences
    (:func:`megatron.mpu.reduce_loss_over_context_parallel`, which also scales the gradient
    for the data x context averaging).
    """
    ids, loss_mask = labels
    if logits.dim() == 3 and logits.stride(0) < logits.stride(1):
        # The models' [b, s, v] output is a view of the [s, b, v] matmul output: the loss on
        # that tensor itself, with the (small) labels transposed, saves the large logits a
        # strided pass forward and a copy back to [s, b, v] in the output layer's backward.
        losses = mpu.vocab_parallel_cross_entropy(logits.transpose(0, 1), ids.t(),
                                                  inplace=True).t()
    else:
        losses = mpu.vocab_parallel_cross_entropy(logits, ids, inplace=True)  # [b, s], fp32
    if mpu.model_parallel_is_initialized() and mpu.get_context_parallel_world_size() > 1:
        return mpu.reduce_loss_over_context_parallel((losses * loss_mask).sum(), loss_mask.sum())
    return (losses * loss_mask).sum() / loss_mask.sum()

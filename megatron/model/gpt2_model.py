"""GPT-2 on tensor-parallel layers."""
from torch import nn

from .language_model import Embedding, lm_loss, parallel_lm_logits
from .transformer import ParallelTransformer


class GPT2Model(nn.Module):
    """GPT-2: learned positions, pre-LN blocks, final LN, output tied to the word embedding.

    Args:
        config: :class:`TransformerConfig` (its ``true_vocab_size`` masks the padding).
        vocab_size: padded vocabulary size.
        max_position_embeddings: learned positions.
        parallel_output: return vocab-split logits (as the loss needs) when no labels.
    """

    def __init__(self, config, vocab_size, max_position_embeddings, parallel_output=True):
        super().__init__()
        self.config = config
        self.parallel_output = parallel_output
        self.embedding = Embedding(config.hidden_size, vocab_size, max_position_embeddings,
                                   config.hidden_dropout, config.init_method_std, config.seed,
                                   true_vocab_size=config.true_vocab_size,
                                   sequence_parallel=config.sequence_parallel)
        self.transformer = ParallelTransformer(config)

    def word_embeddings_weight(self):
        return self.embedding.word_embeddings.weight

    def forward(self, input_ids, position_ids, attention_mask, labels=None, kv_cache=None):
        """``[b, s]`` ids -> per-token losses ``[b, s]`` if labels else logits ``[b, s, v/tp]``.

        Args:
            input_ids, position_ids: ``[b, s]``.
            attention_mask: ``[1 or b, 1, s, s]`` bool, True = masked.
            labels: ``[b, s]`` next-token ids, or None for logits.
            kv_cache: :class:`~megatron.model.kv_cache.KVCache` for incremental decoding.
        """
        hidden = self.embedding(input_ids, position_ids)  # [s, b, h]
        hidden = self.transformer(hidden, attention_mask, kv_cache)
        if kv_cache is not None:
            kv_cache.advance(input_ids.shape[1])
        logits = parallel_lm_logits(hidden, self.word_embeddings_weight(),
                                    self.parallel_output or labels is not None,
                                    true_vocab_size=self.config.true_vocab_size,
                                    sequence_parallel=self.config.sequence_parallel)  # [s, b, v/tp]
        if labels is None:
            return logits.transpose(0, 1)
        return lm_loss(logits, labels)


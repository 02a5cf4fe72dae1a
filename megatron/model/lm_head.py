"""A language model's output layer, tied to its input embedding across pipeline stages or
not: the public pieces a model built from layer specs uses (docs/new_model.md, "Heads").

Tied (GPT-2, BERT): :func:`tied_embedding_specs` gives the two layer specs that share one
:class:`WordEmbedding`, the vocabulary-parallel word embedding and nothing else. The first
spec looks the tokens up on the first stage, the second computes the logits against the same
weight on the last stage; a pipeline builds the module on both stages, keeps the two copies
equal (the first stage's is broadcast at start-up, the gradients are summed every step) and
names it ``tied_modules.<key>.word_embeddings.weight`` on both, as
:class:`~megatron.model.spec_model.SpecModel` names it in one process: the same checkpoint
name at every (tp, pp, v). Only the shared weight lives in the tied module: positions, norms
and an output bias go in layers of their own (:class:`VocabParallelBias`), since a pipeline
keeps only the tied weight equal on the stages (whatever else the module held would go stale
on the stage that does not use it).

Untied (Llama): :class:`OutputLayer`, a column-parallel linear whose rows are vocabulary
entries (marked, so a layout change re-pads them).

Both give ``[b, s, v/tp]`` vocabulary-parallel logits with the padded vocabulary rows at
-inf (out of the softmax), what ``megatron.model.language_model.masked_lm_loss`` takes.
"""
from typing import Any, Callable, Optional, Tuple

import torch
from torch import nn

from .. import mpu
from .language_model import parallel_lm_logits
from .utils import init_method_normal, init_rng

#: The tied weight's attribute in :class:`WordEmbedding` (``TiedLayerSpec.tied_weight_attr``).
TIED_WEIGHT = "word_embeddings.weight"


class WordEmbedding(nn.Module):
    """The tied module: one vocabulary-parallel embedding (``word_embeddings``).

    Args:
        vocab_size: padded vocabulary rows (divisible by tp).
        hidden_size: h.
        init_method_std: std of the normal initialisation.
        seed: the run's seed (the weight draws from its own stream: the same at every tp).
        true_vocab_size: the tokenizer's vocabulary (logits beyond it are -inf), or None.
        sequence_parallel: the head's input is this rank's ``[s/tp, b, h]``.
    """

    def __init__(self, vocab_size: int, hidden_size: int, init_method_std: float = 0.02,
                 seed: int = 1234, true_vocab_size: Optional[int] = None,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.true_vocab_size, self.sequence_parallel = true_vocab_size, sequence_parallel
        with init_rng(seed, "embedding"):
            self.word_embeddings = mpu.VocabParallelEmbedding(
                vocab_size, hidden_size, init_method=init_method_normal(init_method_std))

    def lookup(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens [b, s] -> [b, s, h]``."""
        return self.word_embeddings(tokens)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [s, b, h]`` (SP: ``[s/tp, b, h]``) ``-> [b, s, v/tp]`` against the same
        weight, padded vocabulary rows at -inf."""
        return parallel_lm_logits(hidden, self.word_embeddings.weight, parallel_output=True,
                                  true_vocab_size=self.true_vocab_size,
                                  sequence_parallel=self.sequence_parallel).transpose(0, 1)

    def forward(self, inputs: Any) -> Any:
        return embed_tokens(self, inputs)


def embed_tokens(embedding: WordEmbedding, inputs: Any) -> Any:
    """The first stage's use: ``(tokens [b, s], *rest) -> (words [b, s, h], *rest)``."""
    if torch.is_tensor(inputs):
        return embedding.lookup(inputs)
    return (embedding.lookup(inputs[0]), *inputs[1:])


def tied_logits(embedding: WordEmbedding, inputs: Any) -> torch.Tensor:
    """The last stage's use: ``hidden [s, b, h]`` (or a tuple starting with it) ``->
    logits [b, s, v/tp]``."""
    hidden = inputs if torch.is_tensor(inputs) else inputs[0]
    return embedding.logits(hidden)


def tied_embedding_specs(vocab_size: int, hidden_size: int, *, key: str = "embed",
                         embed_fn: Callable = embed_tokens, head_fn: Callable = tied_logits,
                         **kwargs: Any) -> Tuple[Any, Any]:
    """The two layer specs of a head tied to the embedding: put the first where the tokens
    are embedded (first in the list) and the second where the logits are computed (last).

    Args:
        vocab_size, hidden_size: the :class:`WordEmbedding`'s.
        key: the tie's name (``tied_modules.<key>`` in the checkpoint).
        embed_fn: ``f(embedding, inputs) -> outputs`` on the first stage (default
            :func:`embed_tokens`).
        head_fn: ``f(embedding, inputs) -> logits`` on the last stage (default
            :func:`tied_logits`).
        kwargs: :class:`WordEmbedding`'s other arguments (``init_method_std``, ``seed``,
            ``true_vocab_size``, ``sequence_parallel``).

    Returns:
        ``(embedding_spec, head_spec)``: tds ``TiedLayerSpec`` s, for a ``PipelineModule``
        and for :class:`~megatron.model.spec_model.SpecModel` alike.
    """
    from tds.pipe import TiedLayerSpec

    def spec(fn):
        return TiedLayerSpec(key, WordEmbedding, vocab_size, hidden_size, forward_fn=fn,
                             tied_weight_attr=TIED_WEIGHT, **kwargs)

    return spec(embed_fn), spec(head_fn)


class VocabParallelBias(nn.Module):
    """An output bias after a tied head: ``logits [b, s, v/tp] -> logits + bias``.

    Its ``[v/tp]`` parameter (zeros) is split like the vocabulary and marked as vocabulary
    rows, so a checkpoint records it and a layout change re-pads it.

    Args:
        vocab_size: padded vocabulary rows (the padded rows' logits stay -inf).
    """

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        tp = mpu.get_tensor_model_parallel_world_size()
        self.bias = nn.Parameter(torch.zeros(mpu.divide(vocab_size, tp), device=mpu.get_device()))
        mpu.set_tensor_model_parallel_attributes(self.bias, True, 0, 1)
        mpu.mark_padded_vocab_rows(self.bias)

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return logits + self.bias


class OutputLayer(nn.Module):
    """An untied output layer: ``hidden [s, b, h]`` (SP: ``[s/tp, b, h]``) ``-> logits
    [b, s, v/tp]``, padded vocabulary rows at -inf.

    Args:
        hidden_size, vocab_size: h and the padded vocabulary rows.
        bias: an output bias (split and marked like the weight's rows).
        init_method_std: std of the normal initialisation.
        seed: the run's seed (the layer draws from its own stream, ``"lm_head"``).
        true_vocab_size: the tokenizer's vocabulary, or None.
        sequence_parallel: the input is this rank's sequence shard (all-gathered first).
    """

    def __init__(self, hidden_size: int, vocab_size: int, bias: bool = False,
                 init_method_std: float = 0.02, seed: int = 1234,
                 true_vocab_size: Optional[int] = None, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.true_vocab_size = true_vocab_size
        with init_rng(seed, "lm_head"):
            self.linear = mpu.ColumnParallelLinear(
                hidden_size, vocab_size, bias=bias, gather_output=False,
                init_method=init_method_normal(init_method_std),
                sequence_parallel=sequence_parallel, skip_bias_add=True)
        for param in self.linear.parameters():
            mpu.mark_padded_vocab_rows(param)

    def forward(self, hidden: Any) -> torch.Tensor:
        hidden = hidden if torch.is_tensor(hidden) else hidden[0]
        logits, bias = self.linear(hidden)  # [s, b, v/tp], [v/tp] or None
        if bias is not None:  # added here: the mask below writes in place into a new tensor
            logits = logits + bias
        mpu.mask_padded_vocab_logits_(logits, self.true_vocab_size)
        return logits.transpose(0, 1)

"""The Llama example as families were written before ``SpecModel``: the pipeline is the
example's layer specs (tensors named by spec index, ``"3.q_proj.weight"``), the serial model
a module of its own with attributes (``embedding.word_embeddings.weight``,
``layers.0.q_proj.weight``, ``final_norm.weight``, ``lm_head.weight``), built from the same
mpu layers in the same order. No key map: a layout change matches the two by structure
(megatron/checkpoint/structural_match.py).

:data:`OLD_LLAMA` is that family; :data:`OLD_LLAMA_AMBIGUOUS` the same whose serial model
creates its final norm before its layers (its state-dict order is not the order it runs),
so the match by structure is ambiguous (its norms are alike) and refused.
"""
import dataclasses
import os
import sys

from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "examples", "llama"))

from llama_model import (LLAMA, LlamaConfig, LlamaHead, LlamaLayer,  # noqa: E402
                         model_config, pipeline_model)
from megatron import mpu  # noqa: E402
from megatron.families import pipeline_placement  # noqa: E402
from megatron.model.utils import init_method_normal, init_rng  # noqa: E402


class OldEmbedding(nn.Module):
    """``(tokens [b, s], position_ids, mask) -> (hidden [s, b, h], mask)`` under its own
    attribute name (the example's LlamaEmbedding's weight, the same init)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.sequence_parallel = config.sequence_parallel
        with init_rng(config.seed, "embedding"):
            self.word_embeddings = mpu.VocabParallelEmbedding(
                config.vocab_size, config.hidden_size,
                init_method=init_method_normal(config.init_method_std))

    def forward(self, tokens, attention_mask):
        hidden = self.word_embeddings(tokens).transpose(0, 1).contiguous()  # [s, b, h]
        if self.sequence_parallel:
            hidden = mpu.scatter_to_sequence_parallel_region(hidden)  # [s/tp, b, h]
        return hidden


class OldLlamaModel(nn.Module):
    """The serial model with names of its own: ``forward(tokens [b, s], position_ids,
    attention_mask) -> logits [b, s, v/tp]``."""

    def __init__(self, config: LlamaConfig, norm_first: bool = False):
        super().__init__()
        self.config = config
        if norm_first:  # created before the layers it follows
            self.final_norm = self._norm(config)
        self.embedding = OldEmbedding(config)
        self.layers = nn.ModuleList([LlamaLayer(config, i) for i in range(config.num_layers)])
        if not norm_first:
            self.final_norm = self._norm(config)
        self.lm_head = LlamaHead(config)

    @staticmethod
    def _norm(config):
        return mpu.RMSNorm(config.hidden_size, config.norm_eps,
                           sequence_parallel=config.sequence_parallel)

    def forward(self, tokens, position_ids, attention_mask):
        hidden = self.embedding(tokens, attention_mask)
        for layer in self.layers:
            hidden, _ = layer((hidden, attention_mask))
        return self.lm_head(self.final_norm(hidden))


def _builder(norm_first):
    def build_model(cfg, pipeline):
        config = model_config(cfg)
        if pipeline:
            return pipeline_model(config, cfg.parallel.vpp, pipeline_placement(cfg))
        return OldLlamaModel(config, norm_first)
    return build_model


#: What the family provides (no recompute, no compile: an older family's plain model).
_SUPPORTS = frozenset({"pipeline", "sequence_parallel"})

OLD_LLAMA = dataclasses.replace(LLAMA, name="old_llama", label="older-API Llama",
                                build_model=_builder(False), supports=_SUPPORTS,
                                compile_classes=None, memory_model=None)
OLD_LLAMA_AMBIGUOUS = dataclasses.replace(OLD_LLAMA, build_model=_builder(True))


def train(argv, ambiguous=False):
    """Rank body: pretrain the family; its losses, or the CheckpointError's message."""
    from megatron.common.errors import CheckpointError
    from megatron.training import pretrain

    try:
        return pretrain(family=OLD_LLAMA_AMBIGUOUS if ambiguous else OLD_LLAMA,
                        argv=argv).losses
    except CheckpointError as exc:
        return str(exc)
    finally:
        if mpu.model_parallel_is_initialized():
            mpu.destroy_model_parallel()

"""GPT-2 as a tds PipelineModule: the same layers and weights as GPT2Model, split into stages.

Stage boundary tuple: ``(hidden [s, b, h] float, attention_mask [1, 1, s, s] bool)`` (under
context parallelism or document masking the second is the int token layout
``[1 or 2, b, s / cp]``, megatron/mpu/context_parallel.py, and ``s`` is ``s / cp``), the
hidden state split across tensor-parallel ranks for the send (with --sequence-parallel it is
already the rank's ``[s/tp, b, h]`` shard and travels as is). The word embedding is a
``TiedLayerSpec`` on the first stage (lookup) and the last (output logits); tds reduces its
gradient between the two.
"""
from torch import nn

from tds.pipe import LayerSpec, PipelineModule, TiedLayerSpec

from .. import mpu
from .language_model import Embedding, masked_lm_loss, parallel_lm_logits
from .recompute import apply_block_recompute, block_count
from .transformer import ParallelTransformerLayer, make_layer_norm

TIED_WEIGHT = "word_embeddings.weight"


class EmbeddingPipe(Embedding):
    """``(ids, position_ids, mask) -> (hidden [s, b, h], mask)``."""

    def forward(self, inputs):
        input_ids, position_ids, attention_mask = inputs
        return super().forward(input_ids, position_ids), attention_mask


def lm_head(embedding, hidden):
    """The tied copy on the last stage: ``[s, b, h] -> [b, s, v/tp]`` logits (GPT2Model's
    output layout, so both take the same loss)."""
    return parallel_lm_logits(hidden, embedding.word_embeddings.weight, parallel_output=True,
                              true_vocab_size=embedding.true_vocab_size,
                              sequence_parallel=embedding.sequence_parallel).transpose(0, 1)


class ParallelTransformerLayerPipe(ParallelTransformerLayer):
    """``(hidden, mask) -> (hidden, mask)``."""

    def forward(self, inputs):
        hidden, attention_mask = inputs
        return super().forward(hidden, attention_mask), attention_mask


class FinalLayerNormPipe(nn.Module):
    """``(hidden, mask) -> hidden``: the last LayerNorm, dropping the mask."""

    def __init__(self, config):
        super().__init__()
        self.norm = make_layer_norm(config)

    def forward(self, inputs):
        hidden, _ = inputs
        return self.norm(hidden)


def gpt2_pipeline_specs(config, vocab_size, max_position_embeddings):
    """GPT2Model's layers in order, as tds layer specs (what a pipeline partitions):
    the tied embedding, ``num_layers`` blocks, the final LayerNorm, the tied output layer."""
    embed_args = (config.hidden_size, vocab_size, max_position_embeddings,
                  config.hidden_dropout, config.init_method_std, config.seed)
    embed_kwargs = {"true_vocab_size": config.true_vocab_size,
                    "sequence_parallel": config.sequence_parallel}
    specs = [TiedLayerSpec("embed", EmbeddingPipe, *embed_args, tied_weight_attr=TIED_WEIGHT,
                           **embed_kwargs)]
    specs += [LayerSpec(ParallelTransformerLayerPipe, config, i + 1)
              for i in range(config.num_layers)]
    return specs + [LayerSpec(FinalLayerNormPipe, config),
                    TiedLayerSpec("embed", EmbeddingPipe, *embed_args, forward_fn=lm_head,
                                  tied_weight_attr=TIED_WEIGHT, **embed_kwargs)]


class GPT2ModelPipe(PipelineModule):
    """GPT2Model's layers as pipeline stages (``partition_method='type:transformer'``).

    Args:
        config: :class:`TransformerConfig` (``checkpoint_activations`` /
            ``checkpoint_num_layers`` set the recompute interval; block recompute marks
            the first ``recompute_num_layers`` layers of each chunk).
        vocab_size: padded vocabulary size.
        max_position_embeddings: learned positions.
        topology: DeepSpeed topology (pp x dp x tp), matching mpu's groups.
        loss_fn: ``loss_fn(logits [b, s, v/tp], labels)`` on the last stage (the family's;
            default the masked next-token loss).
        num_virtual_stages: model chunks per pipeline rank (interleaved 1F1B or ZB-V when
            > 1; the transformer layers split evenly over the pp x v chunks).
        placement: "loop" (chunk c on rank c % p) or "v" (ZB-V: 2 chunks per rank in a V).
    """

    def __init__(self, config, vocab_size, max_position_embeddings, topology,
                 loss_fn=masked_lm_loss, num_virtual_stages=1, placement="loop"):
        interval = config.checkpoint_num_layers if config.checkpoint_activations else 0
        super().__init__(layers=gpt2_pipeline_specs(config, vocab_size, max_position_embeddings),
                         loss_fn=loss_fn, topology=topology, partition_method="type:transformer",
                         activation_checkpoint_interval=interval,
                         activation_checkpoint_func=mpu.checkpoint,
                         checkpointable_layers=["ParallelTransformerLayerPipe"],
                         num_virtual_stages=num_virtual_stages, placement=placement)
        apply_block_recompute(self, block_count(config), (ParallelTransformerLayerPipe,))
        # the mask slot: a bool mask, or the int token layout (context parallelism)
        self._input_type = ["float", "int" if config.token_layout else "bool"]
        self._input_grad = [True, False]
        # Under sequence parallelism the hidden state already is 1/tp of the sequence.
        self._input_pipe_partitioned = [not config.sequence_parallel, False]

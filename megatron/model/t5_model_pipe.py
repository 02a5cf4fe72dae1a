"""T5 as a tds PipelineModule: T5Model's layers and weights, split into pipeline stages.

Specs: the embedding (0), L encoder layers, the encoder's final norm, L decoder layers, the
decoder's final norm, the output layer (tied embedding copy or lm head); the loss runs on
the last stage. Every boundary carries the same five tensors::

    (enc_hidden [se, b, h] float, enc_mask [b, 1, se, se] bool,
     dec_hidden [sd, b, h] float, dec_mask [b, 1, sd, sd] bool, cross_mask [b, 1, sd, se] bool)

The decoder's input embeddings are computed on the first stage (from the shared word
embedding) and ride through the encoder stages in the ``dec_hidden`` slot, so their
gradient flows back to the embedding; after the encoder's final norm ``enc_hidden`` holds
the encoder output, which every decoder layer cross-attends to (and sends gradient back).

Shared relative bias: every layer of a stack uses its stack's ``[buckets, heads/tp]``
table. Each stage that holds layers of a stack builds a copy of the table from the same
seed as T5Model's; the copy on the stack's first stage is the owner, the others are marked
``ds_pipe_replicated`` (counted once in the gradient norm), and
:meth:`T5ModelPipe.get_tied_weights_and_groups` adds one group per (dp, tp) coordinate
connecting the copies, so the engine's ReduceTiedGrads sums their gradients and the copies
stay identical, exactly as for the tied word embedding.
"""
import torch.distributed as dist
from torch import nn

from tds.pipe import LayerSpec, PipelineModule, TiedLayerSpec

from .. import mpu
from .language_model import masked_lm_loss
from .recompute import apply_block_recompute, block_count
from .t5_layers import (
    RelativePositionBias,
    T5DecoderLayer,
    T5Embedding,
    T5EncoderLayer,
    build_lm_head,
    rms_norm,
    sp_factor,
    t5_logits,
)
from .utils import init_rng

TIED_WEIGHT = "word_embeddings.weight"
STACKS = ("encoder", "decoder")


class SharedBias:
    """A reference to a stack's relative-bias table (not a Module: registered once, on the
    PipelineModule, whatever number of layers use it)."""

    def __init__(self):
        self.module = None

    def __call__(self, sq, sk):
        return self.module(sq, sk)  # [1, np, sq, sk]


class T5EmbeddingPipe(T5Embedding):
    """``(enc_ids, dec_ids, masks...) -> (enc_hidden, enc_mask, dec_hidden, dec_mask, cross)``."""

    def forward(self, inputs):
        enc_ids, dec_ids, enc_mask, dec_mask, cross_mask = inputs
        enc, dec = super().forward(enc_ids), super().forward(dec_ids)  # T5Model's order
        return enc, enc_mask, dec, dec_mask, cross_mask


class _SharedBiasLayer:
    """A stack's layer in a pipeline: the stack's shared relative-bias table, by reference."""

    def __init__(self, config, layer_number, shared_bias):
        super().__init__(config, layer_number)
        self.shared_bias = shared_bias
        self.sp_factor = sp_factor(config)

    def bias_for(self, hidden):
        """``[1, np, s, s]`` bias for a ``[s (/tp under SP), b, h]`` hidden state."""
        s = hidden.shape[0] * self.sp_factor  # full length under SP
        return self.shared_bias(s, s)


class T5EncoderLayerPipe(_SharedBiasLayer, T5EncoderLayer):
    """Updates ``enc_hidden``; the other four tensors pass through."""

    def forward(self, inputs):
        enc, enc_mask, dec, dec_mask, cross_mask = inputs
        enc = super().forward(enc, enc_mask, self.bias_for(enc))
        return enc, enc_mask, dec, dec_mask, cross_mask


class T5EncoderFinalNormPipe(nn.Module):
    """The encoder's final RMSNorm and dropout: ``enc_hidden`` becomes the encoder output."""

    def __init__(self, config):
        super().__init__()
        self.norm = rms_norm(config)
        self.dropout = nn.Dropout(config.hidden_dropout)
        self.sequence_parallel = config.sequence_parallel

    def _norm_dropout(self, hidden):
        return mpu.sequence_parallel_dropout(self.dropout, self.norm(hidden),
                                             self.sequence_parallel)

    def forward(self, inputs):
        enc, *rest = inputs
        return (self._norm_dropout(enc), *rest)


class T5DecoderLayerPipe(_SharedBiasLayer, T5DecoderLayer):
    """Updates ``dec_hidden`` (cross-attending to the encoder output in ``enc_hidden``)."""

    def forward(self, inputs):
        enc, enc_mask, dec, dec_mask, cross_mask = inputs
        dec = super().forward(dec, dec_mask, self.bias_for(dec), enc, cross_mask)
        return enc, enc_mask, dec, dec_mask, cross_mask


class T5DecoderFinalNormPipe(T5EncoderFinalNormPipe):
    """The decoder's final RMSNorm and dropout; drops everything but ``dec_hidden``."""

    def forward(self, inputs):
        return self._norm_dropout(inputs[2])  # [sd, b, h] (SP: [sd/tp, b, h])


class T5LMHeadPipe(nn.Module):
    """The untied output layer: ``[sd, b, h] -> [sd, b, v/tp]``."""

    def __init__(self, config):
        super().__init__()
        self.lm_head = build_lm_head(config)
        self.true_vocab_size = config.true_vocab_size
        self.sequence_parallel = config.sequence_parallel

    def forward(self, hidden):  # [sd, b, h] -> [b, sd, v/tp], T5Model's output layout
        return t5_logits(hidden, self.lm_head.weight, tied=False, parallel_output=True,
                         true_vocab_size=self.true_vocab_size,
                         sequence_parallel=self.sequence_parallel).transpose(0, 1)


def tied_lm_head(embedding, hidden):
    """The tied copy on the last stage: scaled hidden against the word embedding,
    ``[sd, b, h] -> [b, sd, v/tp]`` (T5Model's output layout)."""
    return t5_logits(hidden, embedding.word_embeddings.weight, tied=True, parallel_output=True,
                     true_vocab_size=embedding.true_vocab_size,
                     sequence_parallel=embedding.sequence_parallel).transpose(0, 1)


def t5_pipeline_specs(config, biases):
    """T5Model's layers in order, as tds layer specs (what a pipeline partitions)."""
    L = config.num_layers
    embed = TiedLayerSpec("embed", T5EmbeddingPipe, config, tied_weight_attr=TIED_WEIGHT)
    specs = [embed]
    specs += [LayerSpec(T5EncoderLayerPipe, config, i + 1, biases["encoder"]) for i in range(L)]
    specs += [LayerSpec(T5EncoderFinalNormPipe, config)]
    specs += [LayerSpec(T5DecoderLayerPipe, config, i + 1, biases["decoder"]) for i in range(L)]
    specs += [LayerSpec(T5DecoderFinalNormPipe, config)]
    if config.tie_embeddings:
        specs.append(TiedLayerSpec("embed", T5EmbeddingPipe, config, forward_fn=tied_lm_head,
                                   tied_weight_attr=TIED_WEIGHT))
    else:
        specs.append(LayerSpec(T5LMHeadPipe, config))
    return specs


class T5ModelPipe(PipelineModule):
    """T5Model's layers as pipeline stages (``partition_method`` balances the 2L layers).

    Args:
        config: :class:`T5TransformerConfig` (``checkpoint_activations`` /
            ``checkpoint_num_layers`` set the recompute interval).
        topology: DeepSpeed topology (pp x dp x tp), matching mpu's groups.
        loss_fn: ``loss_fn(logits [b, sd, v/tp], labels)`` on the last stage (the family's;
            default the masked next-token loss).
        num_virtual_stages: model chunks per pipeline rank (interleaved 1F1B when > 1): the
            2L layers, encoder then decoder, split evenly over the pp x v chunks; a chunk
            may end in the encoder and start the decoder (docs/pipeline_schedules.md).
        placement: "loop" (chunk c on rank c % p) or "v" (ZB-V: 2 chunks per rank in a V).
    """

    def __init__(self, config, topology, loss_fn=masked_lm_loss, num_virtual_stages=1,
                 placement="loop"):
        biases = {stack: SharedBias() for stack in STACKS}
        interval = config.checkpoint_num_layers if config.checkpoint_activations else 0
        super().__init__(layers=t5_pipeline_specs(config, biases), loss_fn=loss_fn,
                         topology=topology,
                         partition_method="type:t5(encoder|decoder)layerpipe",
                         activation_checkpoint_interval=interval,
                         activation_checkpoint_func=mpu.checkpoint,
                         checkpointable_layers=["T5EncoderLayerPipe", "T5DecoderLayerPipe"],
                         num_virtual_stages=num_virtual_stages, placement=placement)
        apply_block_recompute(self, block_count(config), (T5EncoderLayerPipe,
                                                          T5DecoderLayerPipe))
        self._bias_groups = []  # (bias module, group of the stages holding its copies)
        for stack in STACKS:
            self._build_shared_bias(config, stack, biases[stack])
        self._input_type = ["float", "bool", "float", "bool", "bool"]
        self._input_grad = [True, False, True, False, False]
        # Under sequence parallelism both hidden states already are 1/tp of their sequence.
        split = not config.sequence_parallel
        self._input_pipe_partitioned = [split, False, split, False, False]

    def _stages_with(self, stack, num_layers):
        """Pipeline stages holding at least one layer of ``stack``, in order."""
        first = 1 if stack == "encoder" else num_layers + 2  # spec indices: t5_pipeline_specs
        return sorted({self.stage_owner(i) for i in range(first, first + num_layers)})

    def _build_shared_bias(self, config, stack, shared):
        """This stage's copy of ``stack``'s bias table, and the groups tying the copies.

        Collective: every rank creates every (dp, tp) group, in the same order.
        """
        stages = self._stages_with(stack, config.num_layers)
        module = None
        if self.stage_id in stages:
            with init_rng(config.seed, f"t5_{stack}", "relative_bias"):  # = T5Model's table
                module = RelativePositionBias(config, bidirectional=stack == "encoder")
            self.add_module(f"{stack}_relative_bias", module)
            shared.module = module
            for param in module.parameters():
                param.ds_pipe_replicated = self.stage_id != stages[0]
        if len(stages) < 2:
            return
        for dp in range(self._topo.get_dim("data")):
            for tp in range(self._topo.get_dim("model")):
                ranks = [self._topo.get_rank(pipe=s, data=dp, model=tp) for s in stages]
                group = dist.new_group(ranks=ranks)
                if self.global_rank in ranks:
                    self._bias_groups.append((module, group))

    def get_tied_weights_and_groups(self):
        """DeepSpeed's tied embedding pairs plus the relative-bias copies (ReduceTiedGrads)."""
        pairs = super().get_tied_weights_and_groups()
        return pairs + [(module.weight, group) for module, group in self._bias_groups]

    def allreduce_tied_weight_gradients(self):
        super().allreduce_tied_weight_gradients()
        for module, group in self._bias_groups:
            dist.all_reduce(module.weight.grad, group=group)

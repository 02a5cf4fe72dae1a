"""A GPT-2 and a T5, serial and pipelined, written as CPM-1-Pretrain writes them.

Written here after CPM-1's API (not copied): ``from megatron import mpu`` became the line
below; ``mpu.LayerNorm``; ``ColumnParallelLinear(..., skip_bias_add=True)`` and
``RowParallelLinear`` unpacked as ``output, bias = layer(x)`` with the bias added in the
residual (CPM's bias-dropout-add); fused QKV per head (``[s, b, np, 3 hn]``);
``mpu.checkpoint(custom(l, l + n), hidden, mask)`` with
``mpu.reset_checkpointed_activations_memory_buffer()`` for ``--checkpoint-activations``;
logits against the word embedding through ``copy_to_model_parallel_region``; the pipeline
models are DeepSpeed's ``PipelineModule`` (``from deepspeed.pipe import ...``, as CPM-1)
built on ``mpu.get_topology()``, with CPM's ``_input_type`` declarations (T5's float masks
are declared ``'int'``, as CPM-1 declares them).

Every layer seeds its own construction (``seed``), so the serial model and every stage of
the pipelined one hold the same weights at any tensor-parallel size.
"""
import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

from megatron.mpu import cpm as mpu

GPT2_CONTRACT = (["float", "bool"], [True, False], [True, False])
T5_CONTRACT = (["float", "int", "float", "int", "int"], [True, False, True, False, False],
               [True, False, True, False, False])


def config(**overrides):
    """The model's hyper-parameters (CPM-1 reads the same names from ``get_args()``)."""
    values = dict(hidden_size=32, num_attention_heads=4, kv_hidden_size=8, ff_hidden_size=64,
                  num_layers=2, padded_vocab_size=64, max_position_embeddings=32,
                  init_method_std=0.2, layernorm_epsilon=1e-5, checkpoint_activations=False,
                  checkpoint_num_layers=1, seed=1234)
    values.update(overrides)
    return SimpleNamespace(**values)


def _normal(std):
    return lambda tensor: torch.nn.init.normal_(tensor, 0.0, std)


def gpt2_mask_func(scores, ltor_mask):  # bool mask, True = hidden
    return scores.masked_fill(ltor_mask, -10000.0)


def t5_mask_func(scores, mask):  # float mask, 1 = visible
    return scores * mask - 10000.0 * (1.0 - mask)


class Embedding(torch.nn.Module):
    """Word (vocab-parallel) + position embeddings: ids ``[b, s]`` -> ``[b, s, h]``."""

    def __init__(self, cfg, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.word_embeddings = mpu.VocabParallelEmbedding(
            cfg.padded_vocab_size, cfg.hidden_size, init_method=_normal(cfg.init_method_std))
        self.position_embeddings = torch.nn.Embedding(cfg.max_position_embeddings,
                                                      cfg.hidden_size)
        _normal(cfg.init_method_std)(self.position_embeddings.weight)

    @property
    def word_embeddings_weight(self):
        return self.word_embeddings.weight

    def forward(self, input_ids, position_ids):
        return self.word_embeddings(input_ids) + self.position_embeddings(position_ids)


def parallel_lm_logits(hidden, word_embeddings_weight):  # [b, s, h] -> [b, s, v/tp]
    return F.linear(mpu.copy_to_model_parallel_region(hidden), word_embeddings_weight)


class Attention(torch.nn.Module):
    """Self- or cross-attention; returns ``(output, bias)`` of its RowParallelLinear."""

    def __init__(self, cfg, mask_func, cross=False):
        super().__init__()
        tp = mpu.get_model_parallel_world_size()
        heads = cfg.num_attention_heads
        d_attn = cfg.kv_hidden_size * heads if cross or mask_func is t5_mask_func \
            else cfg.hidden_size
        self.heads_per_partition = mpu.divide(heads, tp)
        self.head_dim = mpu.divide(d_attn, heads)
        self.mask_func, self.cross = mask_func, cross
        init = _normal(cfg.init_method_std)
        if cross:
            self.query = mpu.ColumnParallelLinear(cfg.hidden_size, d_attn, gather_output=False,
                                                  init_method=init)
            self.key_value = mpu.ColumnParallelLinear(cfg.hidden_size, 2 * d_attn,
                                                      gather_output=False, init_method=init)
        else:
            self.query_key_value = mpu.ColumnParallelLinear(cfg.hidden_size, 3 * d_attn,
                                                            gather_output=False,
                                                            init_method=init)
        self.dense = mpu.RowParallelLinear(d_attn, cfg.hidden_size, input_is_parallel=True,
                                           init_method=init, skip_bias_add=True)

    def _per_head(self, x, parts):  # [s, b, np * parts * hn] -> parts x [b, np, s, hn]
        s, b = x.shape[:2]
        x = x.view(s, b, self.heads_per_partition, parts * self.head_dim)
        return [t.permute(1, 2, 0, 3) for t in mpu.split_tensor_along_last_dim(x, parts)]

    def forward(self, hidden, mask, memory=None):  # [s, b, h]
        if self.cross:
            (q,) = self._per_head(self.query(hidden)[0], 1)
            k, v = self._per_head(self.key_value(memory)[0], 2)
        else:
            q, k, v = self._per_head(self.query_key_value(hidden)[0], 3)
        scores = self.mask_func(q @ k.transpose(-1, -2) / math.sqrt(self.head_dim), mask)
        context = torch.softmax(scores, dim=-1) @ v  # [b, np, s, hn]
        b, np_, s, hn = context.shape
        context = context.permute(2, 0, 1, 3).reshape(s, b, np_ * hn)
        return self.dense(context)


class MLP(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        init = _normal(cfg.init_method_std)
        self.dense_h_to_4h = mpu.ColumnParallelLinear(cfg.hidden_size, cfg.ff_hidden_size,
                                                      gather_output=False, init_method=init,
                                                      skip_bias_add=True)
        self.dense_4h_to_h = mpu.RowParallelLinear(cfg.ff_hidden_size, cfg.hidden_size,
                                                   input_is_parallel=True, init_method=init,
                                                   skip_bias_add=True)

    def forward(self, hidden):
        intermediate, bias = self.dense_h_to_4h(hidden)
        return self.dense_4h_to_h(F.gelu(intermediate + bias))


class TransformerLayer(torch.nn.Module):
    """Pre-LN layer (CPM's): LN, attention, bias + residual, [cross attention], LN, MLP."""

    def __init__(self, cfg, mask_func, layer_number, decoder=False):
        super().__init__()
        torch.manual_seed(cfg.seed + 100 + layer_number)
        self.input_layernorm = mpu.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)
        self.attention = Attention(cfg, mask_func)
        self.decoder = decoder
        if decoder:
            self.cross_layernorm = mpu.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)
            self.cross_attention = Attention(cfg, mask_func, cross=True)
        self.post_attention_layernorm = mpu.LayerNorm(cfg.hidden_size,
                                                      eps=cfg.layernorm_epsilon)
        self.mlp = MLP(cfg)

    def forward(self, hidden, mask, memory=None, cross_mask=None):  # [s, b, h]
        out, bias = self.attention(self.input_layernorm(hidden), mask)
        hidden = hidden + out + bias  # CPM's bias_dropout_add, dropout 0
        if self.decoder:
            out, bias = self.cross_attention(self.cross_layernorm(hidden), cross_mask, memory)
            hidden = hidden + out + bias
        out, bias = self.mlp(self.post_attention_layernorm(hidden))
        return hidden + out + bias


def _run_layers(layers, cfg, hidden, *rest):
    """The layers in turn, ``checkpoint_num_layers`` at a time under mpu.checkpoint."""
    if not cfg.checkpoint_activations:
        for layer in layers:
            hidden = layer(hidden, *rest)
        return hidden

    def custom(start, end):
        def forward(x, *args):
            for layer in layers[start:end]:
                x = layer(x, *args)
            return x
        return forward

    mpu.reset_checkpointed_activations_memory_buffer()
    for start in range(0, len(layers), cfg.checkpoint_num_layers):
        hidden = mpu.checkpoint(custom(start, start + cfg.checkpoint_num_layers), hidden, *rest)
    return hidden


class GPT2Model(torch.nn.Module):
    """``(tokens, position_ids, attention_mask, labels)`` -> per-token losses ``[b, s]``."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embedding = Embedding(cfg, cfg.seed)
        self.layers = torch.nn.ModuleList(TransformerLayer(cfg, gpt2_mask_func, i)
                                          for i in range(cfg.num_layers))
        torch.manual_seed(cfg.seed + 1)
        self.final_layernorm = mpu.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)

    def forward(self, tokens, position_ids, attention_mask, labels):
        hidden = self.embedding(tokens, position_ids).transpose(0, 1)  # [s, b, h]
        hidden = _run_layers(self.layers, self.cfg, hidden, attention_mask)
        hidden = self.final_layernorm(hidden).transpose(0, 1)  # [b, s, h]
        logits = parallel_lm_logits(hidden, self.embedding.word_embeddings_weight)
        return mpu.vocab_parallel_cross_entropy(logits.float(), labels)


class T5Model(torch.nn.Module):
    """``(enc ids, enc pos, enc mask, dec ids, dec pos, dec mask, cross mask, labels)`` ->
    per-token losses ``[b, s_dec]``; masks are float (1 = visible), as CPM-1's."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embedding = Embedding(cfg, cfg.seed)
        self.encoder = torch.nn.ModuleList(TransformerLayer(cfg, t5_mask_func, i)
                                           for i in range(cfg.num_layers))
        self.decoder = torch.nn.ModuleList(
            TransformerLayer(cfg, t5_mask_func, cfg.num_layers + i, decoder=True)
            for i in range(cfg.num_layers))
        torch.manual_seed(cfg.seed + 1)
        self.final_layernorm = mpu.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)

    def forward(self, enc_ids, enc_pos, enc_mask, dec_ids, dec_pos, dec_mask, cross_mask,
                labels):
        enc = self.embedding(enc_ids, enc_pos).transpose(0, 1)  # [s_enc, b, h]
        dec = self.embedding(dec_ids, dec_pos).transpose(0, 1)  # [s_dec, b, h]
        enc = _run_layers(self.encoder, self.cfg, enc, enc_mask)
        dec = _run_layers(self.decoder, self.cfg, dec, dec_mask, enc, cross_mask)
        hidden = self.final_layernorm(dec).transpose(0, 1)
        logits = parallel_lm_logits(hidden, self.embedding.word_embeddings_weight)
        return mpu.vocab_parallel_cross_entropy(logits.float(), labels)


# ---------------------------------------------------------------- pipeline (DeepSpeed's)
class EmbeddingPipe(Embedding):
    """GPT-2: ``(ids, pos, mask)`` -> ``(hidden [b, s, h], mask)``."""

    def forward(self, args):
        return super().forward(args[0], args[1]), args[2]


class Seq2SeqEmbeddingPipe(Embedding):
    """T5: the 7 inputs -> ``(enc [b, s, h], enc_mask, dec [b, s, h], dec_mask, cross_mask)``."""

    def forward(self, args):
        enc_ids, enc_pos, enc_mask, dec_ids, dec_pos, dec_mask, cross_mask = args
        return (super().forward(enc_ids, enc_pos), enc_mask,
                super().forward(dec_ids, dec_pos), dec_mask, cross_mask)


class TransformerLayerPipe(TransformerLayer):
    def forward(self, args):
        if len(args) == 2:  # GPT-2
            return super().forward(args[0], args[1]), args[1]
        enc, enc_mask, dec, dec_mask, cross_mask = args
        if self.decoder:
            return enc, enc_mask, super().forward(dec, dec_mask, enc, cross_mask), dec_mask, \
                cross_mask
        return super().forward(enc, enc_mask), enc_mask, dec, dec_mask, cross_mask


def CrossEntropy(output, labels):  # noqa: N802  (CPM-1's name)
    labels, loss_mask = labels
    losses = mpu.vocab_parallel_cross_entropy(output.contiguous().float(), labels)
    loss_mask = loss_mask.view(-1)
    return torch.sum(losses.view(-1) * loss_mask) / loss_mask.sum()


def _final_specs(cfg, embedding_cls):
    def lm_head(embedding, hidden):
        return parallel_lm_logits(hidden, embedding.word_embeddings_weight)

    return [LayerSpec(_SeededLayerNorm, cfg),
            TiedLayerSpec("embed", embedding_cls, cfg, cfg.seed, forward_fn=lm_head,
                          tied_weight_attr="word_embeddings_weight")]


class _SeededLayerNorm(torch.nn.LayerNorm):
    def __init__(self, cfg):
        torch.manual_seed(cfg.seed + 1)
        super().__init__(cfg.hidden_size, eps=cfg.layernorm_epsilon)


def _pipe(specs, cfg, contract, partition_method):
    model = PipelineModule(layers=specs, loss_fn=CrossEntropy, topology=mpu.get_topology(),
                           partition_method=partition_method,
                           activation_checkpoint_interval=cfg.checkpoint_num_layers
                           if cfg.checkpoint_activations else 0)
    model._input_type, model._input_grad, model._input_pipe_partitioned = contract
    return model


def gpt2_model_pipe(cfg):
    """GPT2ModelPipe: embedding, [b s h] -> [s b h], layers, back, final LN, tied logits."""
    specs = [TiedLayerSpec("embed", EmbeddingPipe, cfg, cfg.seed,
                           tied_weight_attr="word_embeddings_weight"),
             lambda x: (x[0].transpose(0, 1).contiguous(), x[1])]
    specs += [LayerSpec(TransformerLayerPipe, cfg, gpt2_mask_func, i)
              for i in range(cfg.num_layers)]
    specs.append(lambda x: x[0].transpose(0, 1).contiguous())
    return _pipe(specs + _final_specs(cfg, EmbeddingPipe), cfg,
                 GPT2_CONTRACT, "type:transformer")


def t5_model_pipe(cfg):
    """T5ModelPipe: embedding, transpose, encoder then decoder layers, final LN, logits."""
    specs = [TiedLayerSpec("embed", Seq2SeqEmbeddingPipe, cfg, cfg.seed,
                           tied_weight_attr="word_embeddings_weight"),
             lambda x: (x[0].transpose(0, 1).contiguous(), x[1],
                        x[2].transpose(0, 1).contiguous(), x[3], x[4])]
    specs += [LayerSpec(TransformerLayerPipe, cfg, t5_mask_func, i)
              for i in range(cfg.num_layers)]
    specs += [LayerSpec(TransformerLayerPipe, cfg, t5_mask_func, cfg.num_layers + i,
                        decoder=True) for i in range(cfg.num_layers)]
    specs.append(lambda x: x[2].transpose(0, 1).contiguous())
    return _pipe(specs + _final_specs(cfg, Seq2SeqEmbeddingPipe), cfg,
                 T5_CONTRACT, "uniform")

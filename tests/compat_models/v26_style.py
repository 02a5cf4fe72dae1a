"""A small GPT written the way Megatron-LM v2.6 model code is written: v2.6's mpu names and
call shapes (3-argument initialize_model_parallel with v2.6's keyword names, linears that
return (output, bias), checkpoint(fn, distribute_saved_activations, *args)) and enums."""
import math

import torch
import torch.nn.functional as F
from torch import nn

from megatron import mpu
from megatron.model.enums import AttnMaskType, AttnType, LayerType


def init_normal(tensor):
    return nn.init.normal_(tensor, 0.0, 0.05)


class ParallelMLP(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.dense_h_to_4h = mpu.ColumnParallelLinear(hidden, 4 * hidden, gather_output=False,
                                                      init_method=init_normal, skip_bias_add=True)
        self.dense_4h_to_h = mpu.RowParallelLinear(4 * hidden, hidden, input_is_parallel=True,
                                                   init_method=init_normal, skip_bias_add=True)

    def forward(self, x):
        intermediate, bias = self.dense_h_to_4h(x)
        out, out_bias = self.dense_4h_to_h(F.gelu(intermediate + bias))
        return out + out_bias


class ParallelAttention(nn.Module):
    def __init__(self, hidden, heads, attention_type=AttnType.self_attn,
                 attn_mask_type=AttnMaskType.causal):
        super().__init__()
        assert attention_type == AttnType.self_attn
        world = mpu.get_tensor_model_parallel_world_size()
        self.attn_mask_type = attn_mask_type
        self.heads_per_partition = mpu.divide(heads, world)
        self.head_dim = hidden // heads
        self.query_key_value = mpu.ColumnParallelLinear(hidden, 3 * hidden, gather_output=False,
                                                        init_method=init_normal)
        self.dense = mpu.RowParallelLinear(hidden, hidden, input_is_parallel=True,
                                           init_method=init_normal)
        self.dropout = nn.Dropout(0.0)

    def forward(self, x):  # [s, b, h]
        s, b, _ = x.shape
        qkv, _ = self.query_key_value(x)
        qkv = qkv.view(s, b, self.heads_per_partition, 3 * self.head_dim)
        q, k, v = mpu.split_tensor_along_last_dim(qkv, 3)
        scores = torch.einsum("sbnd,tbnd->bnst", q, k) / math.sqrt(self.head_dim)
        if self.attn_mask_type == AttnMaskType.causal:
            causal = torch.ones(s, s, dtype=torch.bool).triu(1)
            scores = scores.masked_fill(causal, float("-inf"))
        with mpu.get_cuda_rng_tracker().fork():
            probs = self.dropout(scores.softmax(-1))
        context = torch.einsum("bnst,tbnd->sbnd", probs, v).reshape(s, b, -1)
        out, bias = self.dense(context)
        return out if bias is None else out + bias


class ParallelTransformerLayer(nn.Module):
    def __init__(self, hidden, heads, layer_type=LayerType.encoder):
        super().__init__()
        self.layer_type = layer_type
        self.input_layernorm = nn.LayerNorm(hidden)
        self.attention = ParallelAttention(hidden, heads)
        self.post_attention_layernorm = nn.LayerNorm(hidden)
        self.mlp = ParallelMLP(hidden)

    def forward(self, x):
        x = x + self.attention(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class GPTModel(nn.Module):
    def __init__(self, vocab, hidden, heads, layers, max_seq):
        super().__init__()
        if mpu.is_pipeline_first_stage():
            self.word_embeddings = mpu.VocabParallelEmbedding(vocab, hidden,
                                                              init_method=init_normal)
            self.position_embeddings = nn.Embedding(max_seq, hidden)
        self.layers = nn.ModuleList(ParallelTransformerLayer(hidden, heads)
                                    for _ in range(layers))
        self.final_layernorm = nn.LayerNorm(hidden)

    def forward(self, ids, labels):  # [b, s] -> scalar loss
        positions = torch.arange(ids.shape[1])[None]
        x = (self.word_embeddings(ids) + self.position_embeddings(positions)).transpose(0, 1)
        for layer in self.layers:
            # v2.6's shape: the bool is distribute_saved_activations (1/tp of x is kept).
            x = mpu.checkpoint(layer, True, x.contiguous())
        x = mpu.copy_to_tensor_model_parallel_region(self.final_layernorm(x))
        logits = F.linear(x, self.word_embeddings.weight)  # [s, b, v/tp]
        return mpu.vocab_parallel_cross_entropy(logits, labels.t()).mean()


def train(tp, seed, steps=3):
    """Rank body: losses of ``steps`` SGD steps at tensor-parallel size ``tp``."""
    mpu.initialize_model_parallel(tensor_model_parallel_size_=tp, pipeline_model_parallel_size_=1,
                                  virtual_pipeline_model_parallel_size_=None)
    mpu.model_parallel_cuda_manual_seed(seed)
    model = GPTModel(vocab=64, hidden=32, heads=4, layers=2, max_seq=16)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    data = torch.randint(0, 64, (steps, 2, 17), generator=torch.Generator().manual_seed(seed))
    losses = []
    for batch in data:
        loss = model(batch[:, :-1], batch[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses

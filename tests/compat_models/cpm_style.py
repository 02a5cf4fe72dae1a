"""A small GPT written the way CPM-Pretrain / Megatron-LM v1 model code is written.

Ported by changing only its import: it said ``import mpu`` (CPM) or
``from megatron import mpu`` (Megatron v1); it now says the line below.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn

from megatron.mpu import v1 as mpu


def init_normal(tensor):
    return nn.init.normal_(tensor, 0.0, 0.05)


class GPT2ParallelSelfAttention(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        world = mpu.get_model_parallel_world_size()
        self.hidden_per_partition = mpu.divide(hidden, world)
        self.heads_per_partition = mpu.divide(heads, world)
        self.head_dim = mpu.divide(hidden, heads)
        # [q | k | v] laid out one after the other: stride 3 gives each rank its heads of each.
        self.query_key_value = mpu.ColumnParallelLinear(hidden, 3 * hidden, stride=3,
                                                        gather_output=False,
                                                        init_method=init_normal)
        self.dense = mpu.RowParallelLinear(hidden, hidden, input_is_parallel=True,
                                           init_method=init_normal)

    def _heads(self, x):  # [b, s, hp] -> [b, n, s, d]
        return x.view(x.shape[0], x.shape[1], self.heads_per_partition, -1).permute(0, 2, 1, 3)

    def forward(self, x, ltor_mask):  # [b, s, h]
        mixed = self.query_key_value(x)
        q, k, v = (self._heads(t) for t in mpu.split_tensor_along_last_dim(mixed, 3))
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        scores = scores * ltor_mask - 10000.0 * (1.0 - ltor_mask)
        with mpu.get_cuda_rng_tracker().fork():
            probs = scores.softmax(-1)
        context = (probs @ v).permute(0, 2, 1, 3).reshape(x.shape[0], x.shape[1], -1)
        return self.dense(context)


class GPT2ParallelMLP(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.dense_h_to_4h = mpu.ColumnParallelLinear(hidden, 4 * hidden, gather_output=False,
                                                      init_method=init_normal)
        self.dense_4h_to_h = mpu.RowParallelLinear(4 * hidden, hidden, input_is_parallel=True,
                                                   init_method=init_normal)

    def forward(self, x):
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x)))


class GPT2ParallelTransformerLayer(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(hidden)
        self.attention = GPT2ParallelSelfAttention(hidden, heads)
        self.post_attention_layernorm = nn.LayerNorm(hidden)
        self.mlp = GPT2ParallelMLP(hidden)

    def forward(self, x, ltor_mask):
        x = x + self.attention(self.input_layernorm(x), ltor_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class GPT2Model(nn.Module):
    def __init__(self, vocab, hidden, heads, layers, max_seq):
        super().__init__()
        self.word_embeddings = mpu.VocabParallelEmbedding(vocab, hidden, init_method=init_normal)
        self.position_embeddings = mpu.ParallelEmbedding(max_seq, hidden, init_method=init_normal)
        self.layers = nn.ModuleList(GPT2ParallelTransformerLayer(hidden, heads)
                                    for _ in range(layers))
        self.final_layernorm = nn.LayerNorm(hidden)

    def forward(self, ids, labels):
        s = ids.shape[1]
        ltor_mask = torch.ones(s, s).tril()[None, None]
        x = self.word_embeddings(ids) + self.position_embeddings(torch.arange(s)[None])
        for layer in self.layers:
            x = mpu.checkpoint(layer, x, ltor_mask)
        x = mpu.copy_to_model_parallel_region(self.final_layernorm(x))
        logits_parallel = F.linear(x, self.word_embeddings.weight)
        return mpu.vocab_parallel_cross_entropy(logits_parallel, labels).mean()


def train(tp, seed, steps=3):
    """Rank body: losses of ``steps`` SGD steps at model-parallel (= tensor) size ``tp``."""
    mpu.initialize_model_parallel(tp)
    assert mpu.get_model_parallel_world_size() == tp
    mpu.model_parallel_cuda_manual_seed(seed)
    model = GPT2Model(vocab=64, hidden=32, heads=4, layers=2, max_seq=16)
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

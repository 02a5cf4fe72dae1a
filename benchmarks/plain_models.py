"""The baselines benchmarks/gpu_throughput.py times against: a plain PyTorch GPT-2 (SDPA
attention, ``[b, s, h]``, tied output, the usual ~150 lines) and transformers' T5."""
import torch
import torch.nn.functional as F
from torch import nn


class PlainBlock(nn.Module):
    """Pre-LN GPT-2 block with fused QKV and ``scaled_dot_product_attention``."""

    def __init__(self, hidden, heads, dropout):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln_1, self.ln_2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc, self.out = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x):  # [b, s, h]
        b, s, h = x.shape
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2)
                   for t in self.qkv(self.ln_1(x)).split(h, dim=-1))  # [b, n, s, d]
        p = self.dropout if self.training else 0.0
        context = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        x = x + F.dropout(self.proj(context.transpose(1, 2).reshape(b, s, h)), p, self.training)
        mlp = self.out(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))
        return x + F.dropout(mlp, p, self.training)


class PlainGPT2(nn.Module):
    """Embeddings, blocks, final LN, logits against the word embedding, mean loss."""

    def __init__(self, vocab, seq, hidden, heads, layers, dropout=0.0):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, hidden), nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(PlainBlock(hidden, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, ids, labels):  # [b, s]
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.wte(ids) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # [b, s, v]
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def hf_t5(vocab, layers, d_model, d_ff, heads, d_kv):
    """transformers' T5ForConditionalGeneration (v1.0 architecture, dropout 0), or None
    when transformers is not importable."""
    try:
        from transformers import T5Config, T5ForConditionalGeneration
    except ImportError:
        return None
    config = T5Config(vocab_size=vocab, d_model=d_model, d_kv=d_kv, d_ff=d_ff,
                      num_layers=layers, num_decoder_layers=layers, num_heads=heads,
                      dropout_rate=0.0, feed_forward_proj="relu", tie_word_embeddings=True)
    return T5ForConditionalGeneration(config)

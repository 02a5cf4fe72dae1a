"""Key/value cache for incremental decoding (generation)."""
import torch


class KVCache:
    """Per-layer ``[max_len, b, heads/tp, head_dim]`` key and value buffers.

    A forward over ``sq`` new tokens writes their keys/values at ``[offset, offset + sq)``
    and attends over ``[0, offset + sq)``; the model then calls :meth:`advance`.

    Args:
        num_layers: transformer layers (indexed by ``layer_number - 1``).
        max_len: longest sequence the cache holds.
        batch_size: sequences decoded together.
        heads: attention heads on this rank.
        head_dim: per-head size.
        dtype, device: of the buffers.
    """

    def __init__(self, num_layers, max_len, batch_size, heads, head_dim, dtype, device):
        shape = (num_layers, max_len, batch_size, heads, head_dim)
        self.keys = torch.empty(shape, dtype=dtype, device=device)
        self.values = torch.empty(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.offset = 0

    def update(self, layer, k, v):  # k, v: [sq, b, np, hn]
        end = self.offset + k.shape[0]
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} tokens, {end} requested; "
                             f"build it with a larger max_len")
        self.keys[layer, self.offset:end] = k
        self.values[layer, self.offset:end] = v
        return self.keys[layer, :end], self.values[layer, :end]  # [sk, b, np, hn]

    def advance(self, num_tokens):
        self.offset += num_tokens

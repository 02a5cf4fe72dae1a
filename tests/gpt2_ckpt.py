"""Test helper: a random full GPT-2 checkpoint (GPT2Model keys) of a given size."""
import torch

from megatron.checkpoint_conversion import FullCheckpoint, full_keys


def model_args(layers, hidden, heads, vocab, positions, tp=1, pp=1, true_vocab=None,
               divisible_by=64):
    """A saved-args dict with the sizes a checkpoint records."""
    return {"num_layers": layers, "hidden_size": hidden, "num_attention_heads": heads,
            "kv_channels": hidden // heads, "ffn_hidden_size": 4 * hidden,
            "padded_vocab_size": vocab, "max_position_embeddings": positions,
            "hidden_bias": True, "tensor_model_parallel_size": tp,
            "pipeline_model_parallel_size": pp, "make_vocab_size_divisible_by": divisible_by,
            "true_vocab_size": true_vocab}


def _shape(key, hidden, vocab, positions):
    if key.endswith("word_embeddings.weight"):
        return (vocab, hidden)
    if key.endswith("position_embeddings.weight"):
        return (positions, hidden)
    out = {"query_key_value": 3 * hidden, "dense_h_to_4h": 4 * hidden}
    rows = next((n for name, n in out.items() if f".{name}." in key), hidden)
    if key.endswith(".bias") or "layernorm" in key:
        return (rows,)
    return (rows, 4 * hidden if "dense_4h_to_h" in key else hidden)


def random_checkpoint(seed, layers=2, hidden=32, heads=4, vocab=200, positions=16, **args):
    """A :class:`FullCheckpoint` with random tensors (unpadded: ``vocab`` real rows)."""
    g = torch.Generator().manual_seed(seed)
    state = {k: torch.randn(_shape(k, hidden, vocab, positions), generator=g)
             for k in full_keys(layers)}
    args.setdefault("true_vocab", vocab)
    return FullCheckpoint(state, model_args(layers, hidden, heads, vocab, positions, **args))

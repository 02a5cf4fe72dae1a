"""Initialisers, per-module seeding, and GPT masks."""
import contextlib
import hashlib
import math

import torch


def init_method_normal(std):
    """``w ~ N(0, std)`` in place."""

    def init_(tensor):
        return torch.nn.init.normal_(tensor, mean=0.0, std=std)

    return init_


def scaled_init_method_normal(std, num_layers):
    """``N(0, std / sqrt(2 * num_layers))`` for the projections that feed the residual (GPT-2)."""
    return init_method_normal(std / math.sqrt(2.0 * num_layers))


def derive_seed(seed, *key):
    """A stable 63-bit seed from ``seed`` and a key (same in every process and run)."""
    text = "/".join(str(part) for part in (seed,) + key).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") % (2**63 - 1)


@contextlib.contextmanager
def init_rng(seed, *key):
    """Build a module's weights from a seed of its own, then restore the CPU generator.

    Each transformer layer (and the embedding) draws its initial weights on the CPU from
    ``derive_seed(seed, *key)``, so the weights of layer i are the same whether it sits in
    a serial model, on pipeline stage 3 of 4, or in any tensor-parallel layout.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(seed, *key))
        yield


def replicated_parameter(shape, init_method, device, dtype=torch.float32):
    """A parameter every tensor-parallel rank holds whole, drawn on the CPU generator."""
    weight = torch.empty(shape, dtype=torch.float32)
    init_method(weight)
    return torch.nn.Parameter(weight.to(device=device, dtype=dtype))


def causal_attention_mask(seq_length, device):
    """``[1, 1, s, s]`` bool, True above the diagonal (= may not attend; Megatron's convention)."""
    return torch.ones(seq_length, seq_length, dtype=torch.bool, device=device).triu_(1)[None, None]


def get_ltor_masks_and_position_ids(tokens, eod_token, eod_mask_loss):
    """Causal mask, loss mask and position ids for a left-to-right LM batch.

    Args:
        tokens: ``[b, s]`` input ids.
        eod_token: end-of-document id.
        eod_mask_loss: zero the loss on end-of-document tokens.

    Returns:
        ``attention_mask [1, 1, s, s]`` (bool, True = masked), ``loss_mask [b, s]`` (float),
        ``position_ids [b, s]``.
    """
    b, s = tokens.shape
    attention_mask = causal_attention_mask(s, tokens.device)
    loss_mask = torch.ones(b, s, dtype=torch.float, device=tokens.device)
    if eod_mask_loss:
        loss_mask.masked_fill_(tokens == eod_token, 0.0)
    position_ids = torch.arange(s, dtype=torch.long, device=tokens.device).unsqueeze(0).expand(b, s)
    return attention_mask, loss_mask, position_ids

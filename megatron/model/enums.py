"""Megatron-LM v2.6's model enums (same members and values), for model code written against v2.6."""
import enum


class LayerType(enum.Enum):
    """Which stack a transformer layer belongs to."""

    encoder = 1
    decoder = 2


class AttnType(enum.Enum):
    """Self-attention, or cross-attention over the encoder output."""

    self_attn = 1
    cross_attn = 2


class AttnMaskType(enum.Enum):
    """Padding mask (bidirectional) or causal mask."""

    padding = 1
    causal = 2

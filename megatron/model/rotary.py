"""Rotary position embeddings, at their path before issue 35: an mpu piece now
(:mod:`megatron.mpu.rotary`; ``mpu.RotaryEmbedding``, ``mpu.apply_rotary``), re-exported here."""
from ..mpu.rotary import RotaryEmbedding, apply_rotary, rotate_half  # noqa: F401

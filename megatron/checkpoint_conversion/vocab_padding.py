"""Moved to :mod:`megatron.checkpoint.vocab_padding`; this name is kept for earlier imports."""
from ..checkpoint.vocab_padding import *  # noqa: F401,F403

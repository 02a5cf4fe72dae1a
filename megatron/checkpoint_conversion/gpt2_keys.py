"""Moved to :mod:`megatron.checkpoint.gpt2_keys`; this name is kept for earlier imports."""
from ..checkpoint.gpt2_keys import *  # noqa: F401,F403

"""Moved to :mod:`megatron.checkpoint.t5_keys`; this name is kept for earlier imports."""
from ..checkpoint.t5_keys import *  # noqa: F401,F403

"""Moved to :mod:`megatron.checkpoint.native_reader`; this name is kept for earlier imports."""
from ..checkpoint.native_reader import *  # noqa: F401,F403

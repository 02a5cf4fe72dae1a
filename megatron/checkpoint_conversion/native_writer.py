"""Moved to :mod:`megatron.checkpoint.native_writer`; this name is kept for earlier imports."""
from ..checkpoint.native_writer import *  # noqa: F401,F403

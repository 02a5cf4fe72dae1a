"""Moved to :mod:`megatron.checkpoint.optimizer_names`; this name is kept for earlier imports."""
from ..checkpoint.optimizer_names import *  # noqa: F401,F403

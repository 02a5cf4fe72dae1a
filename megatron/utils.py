"""``megatron.utils`` as Megatron-LM users import it: the rank-aware helpers now live in
:mod:`megatron.common.utils`; this module re-exports them."""
from .common.utils import *  # noqa: F401,F403

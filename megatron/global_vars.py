"""``megatron.global_vars`` as Megatron-LM users import it (``get_args``, ``get_tokenizer``,
``get_timers``, ...): re-exported from :mod:`megatron.common.global_vars`."""
from .common.global_vars import *  # noqa: F401,F403

"""``megatron.text_generation`` as Megatron-LM users import it: re-exported from
:mod:`megatron.generation.text_generation`."""
from .generation.text_generation import *  # noqa: F401,F403

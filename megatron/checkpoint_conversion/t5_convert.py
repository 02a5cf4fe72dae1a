"""T5 conversions under their earlier names (tools/convert_checkpoint_t5.py's API).

The conversion itself is the generic :func:`~.convert.run_conversion` with a
:class:`~.convert.T5ConversionRequest`; HF reading/writing is :mod:`.t5_hf`; loading a model
for generation is :func:`megatron.generation.inference.load_t5_for_inference`.
"""
from ..checkpoint.native_reader import read_native
from .convert import FORMATS, T5ConversionRequest, run_conversion  # noqa: F401 (tool flags)
from .t5_hf import read_hf as read_hf_t5, write_hf as write_hf_t5  # noqa: F401

#: Megatron-style name of the generic conversion, for T5 requests.
run_t5_conversion = run_conversion


def read_native_t5(root, iteration=None):
    """A native T5 checkpoint as a :class:`~megatron.checkpoint.FullCheckpoint`."""
    return read_native(root, iteration, family="t5")

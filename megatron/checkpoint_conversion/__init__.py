"""Checkpoint conversion: Hugging Face <-> native, and resharding across (tp, pp).

Every conversion goes through a *full* state dict (whole-model key names, whole tensors):

- :func:`read_native` merges a native checkpoint of any (tp, pp) into a :class:`FullCheckpoint`;
- :func:`reshard` re-pads the vocabulary for a target tp and updates the saved args;
- :func:`write_native` splits it into (tp, pp) files, written atomically, weights only;
- :func:`read_hf` / :func:`write_hf` map HF directories through the model family's adapter
  (:mod:`.hf_gpt2`, :mod:`.t5_hf`);
- :func:`run_conversion` does a whole conversion (``tools/convert_checkpoint*.py``).

The native format and its readers and writers live in :mod:`megatron.checkpoint`; they are
re-exported here under the names the tools have always used. See docs/conversion.md.
"""
from ..checkpoint.gpt2_keys import full_keys, stage_spec_bounds, tp_split_dim
from ..checkpoint.native_reader import FullCheckpoint, merge_tensor_parallel, read_native
from ..checkpoint.native_writer import reshard, stage_state, write_native
from .convert import (ConversionRequest, T5ConversionRequest, detect_format, read_hf,
                      run_conversion, write_hf)

__all__ = ["ConversionRequest", "FullCheckpoint", "T5ConversionRequest", "detect_format",
           "full_keys", "merge_tensor_parallel", "read_hf", "read_native", "reshard",
           "run_conversion", "stage_spec_bounds", "stage_state", "tp_split_dim", "write_hf",
           "write_native"]

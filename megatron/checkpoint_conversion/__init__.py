"""GPT-2 checkpoint conversion: Hugging Face <-> native, and resharding across (tp, pp).

Every conversion goes through a *full* state dict (GPT2Model key names, whole tensors):

- :func:`read_native` merges a native checkpoint of any (tp, pp) into a :class:`FullCheckpoint`;
- :func:`reshard` re-pads the vocabulary for a target tp and updates the saved args;
- :func:`write_native` splits it into (tp, pp) files, written atomically, weights only;
- :func:`read_hf` / :func:`write_hf` map HF GPT-2 (``save_pretrained`` directories);
- :func:`run_conversion` does a whole conversion (``tools/convert_checkpoint.py``).

See docs/conversion.md for the formats and the key mapping.
"""
from .convert import ConversionRequest, detect_format, read_hf, run_conversion, write_hf
from .gpt2_keys import full_keys, stage_spec_bounds, tp_split_dim
from .native_reader import FullCheckpoint, merge_tensor_parallel, read_native
from .native_writer import reshard, stage_state, write_native

__all__ = ["ConversionRequest", "FullCheckpoint", "detect_format", "full_keys",
           "merge_tensor_parallel", "read_hf", "read_native", "reshard", "run_conversion",
           "stage_spec_bounds", "stage_state", "tp_split_dim", "write_hf", "write_native"]

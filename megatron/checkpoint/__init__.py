"""Checkpoints on disk: the format, native read and write at any layout, key maps, ZeRO state.

Everything about what a checkpoint holds and where, used by training (save/resume a run,
:mod:`megatron.training.checkpointing`) and by the conversion tools
(:mod:`megatron.checkpoint_conversion`):

- :mod:`.format`: folder and file names, the tracker, atomic publication, what must match;
- :mod:`.digest` / :mod:`.manifest` / :mod:`.verify`: each file's digest hashed as it is
  written, the manifest published with the folder, verification before every read and by
  ``tools/verify_checkpoint.py``;
- :mod:`.key_maps` (:mod:`.gpt2_keys`, :mod:`.t5_keys`): where each weight of a model lives;
- :mod:`.native_reader` / :mod:`.native_writer`: any (tp, pp) layout <-> one full state dict;
- :mod:`.sharding` / :mod:`.recorded_reshard`: the sharding record each rank file carries,
  and resharding by it for a model without a key map;
- :mod:`.vocab_padding`: re-pad the vocabulary rows for another tp;
- :mod:`.optimizer_names`, :mod:`.zero_state`: optimizer state by parameter name (torch's
  AdamW, DeepSpeed's ZeRO partitions);
- :mod:`.layout_change`: a rank's part of a checkpoint saved at another layout;
- :mod:`.megatron_lm`: Megatron-LM's own GPT checkpoints (versions 0-3) read whole, version 3
  written.
"""
from .format import (CHECKPOINT_FORMAT, TRACKER_FILENAME, check_compatible, checkpoint_name,
                     iteration_dir, read_tracker, resolve_iteration, uses_pipeline_engine,
                     write_tracker)
from .key_maps import key_map_for, key_map_named
from .native_reader import FullCheckpoint, merge_tensor_parallel, read_native
from .native_writer import reshard, stage_state, write_native

__all__ = ["CHECKPOINT_FORMAT", "FullCheckpoint", "TRACKER_FILENAME", "check_compatible",
           "checkpoint_name", "iteration_dir", "key_map_for", "key_map_named",
           "merge_tensor_parallel", "read_native", "read_tracker", "reshard",
           "resolve_iteration", "stage_state", "uses_pipeline_engine", "write_native",
           "write_tracker"]

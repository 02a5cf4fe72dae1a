"""DeepSpeed's engine's optimizer state in a checkpoint (``EngineBackend.state_io``,
``--deepspeed``).

Each data-parallel rank writes its own optimizer file (``optim_dp_rank_*.pt``): DeepSpeed's
ZeRO partitions and its fp16/bf16 flat buffers differ per rank. What loading does depends
on the optimizer the engine built:

- our AdamW (fp32, no ZeRO): every rank saved the same state; one file is read;
- ZeRO (stages 1-2): DeepSpeed's elastic format (``zero_optimization.elastic_checkpoint``,
  on by default in :func:`~.backend_engine.build_deepspeed_config`) reads every saved
  partition, merges them and cuts this rank's, master weights included, so the dp size may
  differ from the saved one; the rigid format reads this rank's own file at the saved size;
- DeepSpeed's fp16/bf16 optimizers without ZeRO: only at the saved dp size and layout.
"""
import inspect
from typing import Any, Dict, List, Optional

from .. import mpu
from ..checkpoint.format import saved_optimizer_files
from ..checkpoint.zero_state import load_engine_optimizer_file, load_named
from ..common.errors import CheckpointError
from .state_io import OptimizerStateIO, load_named_adam

_ENGINE_COUNTERS = ("global_steps", "global_samples", "skipped_steps", "micro_steps")


class EngineStateIO(OptimizerStateIO):
    """See the module docstring."""

    sharded = True

    @property
    def engine(self) -> Any:
        return self.backend.model

    @property
    def optimizer(self) -> Any:
        return self.backend.optimizer

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def named_optimizer(self) -> Optional[Any]:
        # fp32 without ZeRO: the engine steps our AdamW itself
        return self.optimizer if self.optimizer is self.engine.basic_optimizer else None

    def load_saved(self, state: dict, root: str, iteration: int, tp_rank: int,
                   pp_rank: int) -> None:
        """DeepSpeed's engine reads its own ``optim_dp_rank_*`` files (every saved
        data-parallel rank's, re-partitioned when the size changed)."""
        self.load_files(saved_optimizer_files(root, iteration, tp_rank, pp_rank))

    def counters(self) -> Dict[str, int]:
        return {k: int(getattr(self.engine, k, 0)) for k in _ENGINE_COUNTERS}

    def load_counters(self, counters: Dict[str, int]) -> None:
        for key, value in counters.items():
            setattr(self.engine, key, value)

    def after_weights_only_load(self) -> None:
        if hasattr(self.optimizer, "refresh_fp32_params"):
            self.optimizer.refresh_fp32_params()  # fp16/bf16: master weights from the model

    def load_scaler(self, scaler: dict) -> bool:
        if not self.backend.cfg.precision.fp16 or not hasattr(self.optimizer, "loss_scaler"):
            return True
        if scaler.get("deepspeed") is not None:
            self.optimizer.loss_scaler = scaler["deepspeed"]
            return True
        return not any(v is not None for v in scaler.values())

    def _load_named_state(self, state):
        adam = self.named_optimizer()
        if adam is not None:
            load_named_adam(adam, self.backend.module(), state)
            return
        if not hasattr(self.optimizer, "single_partition_of_fp32_groups"):
            raise CheckpointError(
                f"this run's optimizer ({type(self.optimizer).__name__}: DeepSpeed's fp16/bf16 "
                f"optimizer without ZeRO) cannot take optimizer state from another tensor- or "
                f"pipeline-parallel layout; add --zero-stage 1, or pass --no-load-optim")
        load_named(self.optimizer, self.backend.module(), state.named, state.step)

    def load_files(self, paths: List[str]) -> None:
        dp, dp_rank = mpu.get_data_parallel_world_size(with_context_parallel=True), \
            mpu.get_data_parallel_rank(with_context_parallel=True)  # ZeRO's partitions
        params = inspect.signature(self.optimizer.load_state_dict).parameters
        if "state_dict_list" not in params:
            if len(paths) != dp and self.named_optimizer() is None:
                raise CheckpointError(_other_dp_message(len(paths), dp, "this optimizer"))
            own = paths[dp_rank] if dp_rank < len(paths) else paths[0]  # replicated state
            self.optimizer.load_state_dict(load_engine_optimizer_file(own))
            return
        self._load_zero_files(paths, dp, dp_rank, params)

    def _load_zero_files(self, paths, dp, dp_rank, params):
        # Their fp32 master weights must come from the files, not be re-derived from the
        # fp16/bf16 weights.
        extra = {"load_from_fp32_weights": True} if "load_from_fp32_weights" in params else {}
        mine = min(dp_rank, len(paths) - 1)
        own = load_engine_optimizer_file(paths[mine])
        elastic = isinstance(own.get("base_optimizer_state"), list)
        if not elastic and len(paths) == dp:  # rigid: this rank's own partition is enough
            states = [None] * dp
            states[dp_rank] = own
        else:  # elastic: DeepSpeed merges every saved partition
            states = _SavedPartitions(own if r == mine else load_engine_optimizer_file(p)
                                      for r, p in enumerate(paths))
        if len(paths) != dp:
            what = None
            if not elastic:
                what = "a checkpoint saved with zero_optimization.elastic_checkpoint false"
            elif not getattr(self.optimizer, "elastic_checkpoint", False):
                what = "this run (its zero_optimization.elastic_checkpoint is false)"
            if what:
                raise CheckpointError(_other_dp_message(len(paths), dp, what))
        if elastic:
            # DeepSpeed's elastic format records the step only for optimizers that keep it
            # in their param groups; torch's AdamW keeps it in each parameter's state (which
            # the format carries), so there is no group step to restore.
            for state in states:
                state.setdefault("base_optimizer_state_step", None)
        self.optimizer.load_state_dict(states, **extra)
        for group in getattr(self.optimizer, "optimizer", self.optimizer).param_groups:
            if "step" in group and group["step"] is None:
                del group["step"]


def _other_dp_message(saved_dp, dp, what):
    return (f"the checkpoint's optimizer state was saved at data-parallel size {saved_dp}, "
            f"this run has {dp}, and {what} cannot be re-partitioned; resume at "
            f"data-parallel size {saved_dp}, or pass --no-load-optim to load the weights only")


class _SavedPartitions(list):
    """Every saved data-parallel rank's ZeRO state, for DeepSpeed's elastic load.

    DeepSpeed iterates over the list to merge the partitions, and also indexes it by the
    *new* data-parallel rank for values every rank saved alike (loss scaler, step, clip
    setting); a run grown past the saved size would index beyond it, so such an index gets
    rank 0's (identical) copy.
    """

    def __getitem__(self, index):
        if isinstance(index, int) and index >= len(self):
            index = 0
        return super().__getitem__(index)

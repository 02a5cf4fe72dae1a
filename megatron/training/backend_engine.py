"""``--deepspeed``: DeepSpeed's own engine at pp 1 (its ZeRO stages, its fp16/bf16).

For those who ask for DeepSpeed's engine by name: the config comes from the flags (and
``--deepspeed_config``), and DeepSpeed owns precision, ZeRO, clipping and the data-parallel
reduction; the optimizer (AdamW, no decay on biases and norms) and LR schedule come from the
same factory as the project's own step (megatron/training/backend_step.py), so both take the
same steps. Every other run, pipeline runs included, trains through the project's own step.
"""
import json
import os
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from .. import mpu
from ..common.errors import ConfigError, not_text
from ..config.run_config import RunConfig
from .backend import TrainingBackend, build_optimizer_and_scheduler
from .engine_state_io import EngineStateIO

BATCH_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
              "train_batch_size")


def _read_json(path):
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except UnicodeDecodeError as exc:
        raise not_text(path, exc, "--deepspeed_config must be a JSON file", ConfigError) from None
    except FileNotFoundError:
        raise ConfigError(f"DeepSpeed config {path} does not exist") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"DeepSpeed config {path} is not valid JSON: {exc}") from None


def _precision(config, cfg: RunConfig, path):
    precision = cfg.precision
    for key, flag in (("fp16", precision.fp16), ("bf16", precision.bf16)):
        enabled = bool(config.get(key, {}).get("enabled", False))
        if enabled and not flag:
            raise ConfigError(f"{path} enables {key} but --{key} is not given; pass --{key} "
                              f"or disable it in the JSON")
    if precision.fp16:
        block = {"loss_scale": precision.loss_scale,
                 "initial_scale_power": precision.initial_scale_power,
                 "loss_scale_window": precision.loss_scale_window,
                 "hysteresis": precision.hysteresis, "min_loss_scale": precision.min_loss_scale}
        config["fp16"] = {**block, **config.get("fp16", {}), "enabled": True}
    if precision.bf16:
        config["bf16"] = {**config.get("bf16", {}), "enabled": True}


def _quiet_timers(config):
    """DeepSpeed's timers off unless the JSON asks for them (pretrain() logs its own times).

    Its throughput timer is on by default and calls the accelerator's ``synchronize()`` in
    every ``forward()`` and ``step()`` from its third step on (4 device waits per step at gas
    2); its wall-clock breakdown syncs in every timer it reads. A JSON that sets
    ``timers.throughput``, ``wall_clock_breakdown: true`` or an enabled ``flops_profiler``
    asked for DeepSpeed's timing and keeps DeepSpeed's defaults for what it did not set.
    """
    config.setdefault("wall_clock_breakdown", False)
    asked = config["wall_clock_breakdown"] or "throughput" in config.get("timers", {}) or \
        bool(config.get("flops_profiler", {}).get("enabled", False))
    if not asked:
        config.setdefault("timers", {})["throughput"] = {"enabled": False}


def build_deepspeed_config(cfg: RunConfig) -> Dict[str, Any]:
    """DeepSpeed's config dict: ``--deepspeed_config`` (if any) checked against the flags.

    The batch sizes and clipping come from the flags (BATCHSIZE x GAS x dp, --clip-grad); a
    JSON value that disagrees is an error rather than a silent override. Precision follows
    the flags; the JSON's fp16 block supplies loss-scaler settings. DeepSpeed's timers are
    off unless the JSON asks for them (:func:`_quiet_timers`: they wait for the device).
    """
    path = cfg.parallel.deepspeed_config or "(flags)"
    config = _read_json(cfg.parallel.deepspeed_config) if cfg.parallel.deepspeed_config else {}
    b = cfg.batch
    batch = dict(zip(BATCH_KEYS, (b.micro_batch_size, b.gas, b.global_batch_size)))
    for key, value in batch.items():
        if key in config and config[key] != value:
            raise ConfigError(f"{path}: {key} is {config[key]} but the flags give {value} "
                              f"(batch size {b.micro_batch_size} x gas {b.gas} x "
                              f"data-parallel {cfg.parallel.dp}); make them agree")
    config.update(batch)
    if cfg.parallel.cp > 1:  # DeepSpeed's data axis is data x context: cp ranks per sample
        config["train_batch_size"] = b.global_batch_size * cfg.parallel.cp
    if config.get("gradient_clipping", cfg.optim.clip_grad) != cfg.optim.clip_grad:
        raise ConfigError(f"{path}: gradient_clipping is {config['gradient_clipping']} but "
                          f"--clip-grad is {cfg.optim.clip_grad}; make them agree")
    config["gradient_clipping"] = cfg.optim.clip_grad
    config.setdefault("steps_per_print", 10**9)  # pretrain() logs
    _quiet_timers(config)
    _precision(config, cfg, path)
    if cfg.parallel.zero_stage is not None:
        config["zero_optimization"] = {**config.get("zero_optimization", {}),
                                       "stage": cfg.parallel.zero_stage}
    stage = config.get("zero_optimization", {}).get("stage", 0)
    if stage in (1, 2):  # lets a checkpoint resume at another data-parallel size
        config["zero_optimization"].setdefault("elastic_checkpoint", True)
    return config


def attach_deepspeed_comm(cfg: RunConfig) -> None:
    """Attach DeepSpeed's communication layer to the default group (megatron.initialize
    started torch.distributed; this creates no other group).

    DeepSpeed's engine reads the local rank from ``LOCAL_RANK`` alone (an assertion without
    it); a launcher sets it, ``python pretrain_gpt2.py --deepspeed`` on one device does not.
    The local rank megatron.initialize chose (0 without a launcher) is exported for it.
    """
    import tds as deepspeed

    if "LOCAL_RANK" not in os.environ and "OMPI_COMM_WORLD_LOCAL_RANK" not in os.environ:
        os.environ["LOCAL_RANK"] = str(cfg.parallel.local_rank)
    deepspeed.init_distributed(dist_backend=cfg.parallel.dist_backend)


class DeepSpeedMpu:
    """megatron.mpu as DeepSpeed's engine reads it (``deepspeed.initialize(mpu=...)``):
    its data-parallel group is mpu's data x context group, which reduces the gradients and
    partitions ZeRO's state (a pipeline engine gets the same from its topology,
    :func:`megatron.families.pipeline_topology`); everything else is mpu's."""

    def get_data_parallel_group(self):
        return mpu.get_data_parallel_group(with_context_parallel=True)

    def get_data_parallel_rank(self):
        return mpu.get_data_parallel_rank(with_context_parallel=True)

    def get_data_parallel_world_size(self):
        return mpu.get_data_parallel_world_size(with_context_parallel=True)

    def __getattr__(self, name):
        return getattr(mpu, name)


class EngineBackend(TrainingBackend):
    """DeepSpeed's engine over the model (``--deepspeed``)."""

    name = "deepspeed"

    def __init__(self, model, optimizer, lr_scheduler, cfg: RunConfig):
        super().__init__(model, optimizer, lr_scheduler, cfg, EngineStateIO)

    @classmethod
    def build(cls, module: Any, cfg: RunConfig,
              batch_fn: Optional[Callable] = None) -> "EngineBackend":
        """``deepspeed.initialize`` the module with our optimizer and LR schedule."""
        import tds as deepspeed

        from .batch_draws import SeededBatchFn

        attach_deepspeed_comm(cfg)
        optimizer, lr_scheduler = build_optimizer_and_scheduler(module, cfg)
        engine, ds_optimizer, _, _ = deepspeed.initialize(
            model=module, optimizer=optimizer, lr_scheduler=lr_scheduler,
            config=build_deepspeed_config(cfg), dist_init_required=False, mpu=DeepSpeedMpu())
        backend = cls(engine, ds_optimizer, lr_scheduler, cfg)
        backend.batch_draws = batch_fn if isinstance(batch_fn, SeededBatchFn) else None
        return backend

    @property
    def loss_scale(self) -> float:
        return getattr(self.optimizer, "cur_scale", None) or \
            getattr(self.optimizer, "loss_scale", None) or 1.0

    def train_step(self, forward_step_func: Callable, data_iterator: Optional[Iterator]
                   ) -> Tuple[List[Dict[str, Any]], Any, Any]:
        engine = self.model
        per_micro_batch = []
        for i in range(self.cfg.batch.gas):
            with self.micro_batch(i):
                loss, stats = forward_step_func(data_iterator, engine)
            engine.backward(loss)  # DeepSpeed divides by gas itself
            engine.step()
            per_micro_batch.append(stats)
        updated = not getattr(engine.optimizer, "overflow", False)
        # a device tensor or a float (DeepSpeed's choice): the loop reads it at log time
        return per_micro_batch, updated, engine.get_global_grad_norm()

    def eval_step(self, forward_step_func: Callable,
                  data_iterator: Optional[Iterator]) -> List[Dict[str, Any]]:
        per_micro_batch = []
        for i in range(self.cfg.batch.gas):
            with self.micro_batch(i):
                per_micro_batch.append(forward_step_func(data_iterator, self.model)[1])
        return per_micro_batch

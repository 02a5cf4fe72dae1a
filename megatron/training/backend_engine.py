"""The DeepSpeed backend: config from flags, tds.initialize, engine train and eval steps.

Used for pipeline runs (``--pipe-parallel-size`` > 1, tds's pipeline engine) and for
``--deepspeed`` data parallelism (megatron/training/backend.py decides). DeepSpeed owns
precision (fp16 with fp32 master weights and its loss scaler, or bf16), ZeRO, clipping and
the data-parallel reduction; the optimizer (AdamW, no decay on biases and norms) and LR
schedule come from the same factory as the DDP backend's, so both take the same steps.
"""
import inspect
import json

from .. import mpu
from ..errors import CheckpointError, ConfigError, not_text
from .backend import TrainingBackend, build_optimizer_and_scheduler

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


def _precision(config, args, path):
    precision = args.precision
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


def build_deepspeed_config(args, pipeline):
    """DeepSpeed's config dict: ``--deepspeed_config`` (if any) checked against the flags.

    The batch sizes and clipping come from the flags (BATCHSIZE x GAS x dp, --clip-grad); a
    JSON value that disagrees is an error rather than a silent override. Precision follows
    the flags; the JSON's fp16 block supplies loss-scaler settings.
    """
    path = args.deepspeed_config or "(flags)"
    config = _read_json(args.deepspeed_config) if args.deepspeed_config else {}
    batch = dict(zip(BATCH_KEYS, (args.micro_batch_size, args.gas, args.global_batch_size)))
    for key, value in batch.items():
        if key in config and config[key] != value:
            raise ConfigError(f"{path}: {key} is {config[key]} but the flags give {value} "
                              f"(batch size {args.micro_batch_size} x gas {args.gas} x "
                              f"data-parallel {args.data_parallel_size}); make them agree")
    config.update(batch)
    if config.get("gradient_clipping", args.clip_grad) != args.clip_grad:
        raise ConfigError(f"{path}: gradient_clipping is {config['gradient_clipping']} but "
                          f"--clip-grad is {args.clip_grad}; make them agree")
    config["gradient_clipping"] = args.clip_grad
    config.setdefault("steps_per_print", 10**9)  # pretrain() logs
    config.setdefault("wall_clock_breakdown", False)
    _precision(config, args, path)
    if args.zero_stage is not None:
        config["zero_optimization"] = {**config.get("zero_optimization", {}),
                                       "stage": args.zero_stage}
    stage = config.get("zero_optimization", {}).get("stage", 0)
    if stage in (1, 2):  # lets a checkpoint resume at another data-parallel size
        config["zero_optimization"].setdefault("elastic_checkpoint", True)
    if pipeline and stage > 1:
        raise ConfigError(f"ZeRO stage {stage} cannot be combined with pipeline parallelism; "
                          f"use stage 0 or 1")
    return config


def attach_deepspeed_comm(cfg):
    """Attach DeepSpeed's communication layer to the default group (megatron.initialize
    started torch.distributed; this creates no other group)."""
    import tds as deepspeed

    deepspeed.init_distributed(dist_backend=cfg.parallel.dist_backend)


_ENGINE_COUNTERS = ("global_steps", "global_samples", "skipped_steps", "micro_steps")


class EngineBackend(TrainingBackend):
    """A DeepSpeed engine (tds's pipeline engine for a PipelineModule)."""

    shards_optimizer = True

    def __init__(self, model, optimizer, lr_scheduler, cfg, pipeline):
        super().__init__(model, optimizer, lr_scheduler, cfg)
        self.pipeline = pipeline
        self.name = "pipeline" if pipeline else "deepspeed"

    @classmethod
    def build(cls, module, cfg, pipeline):
        """``tds.initialize`` the module with our optimizer and schedule."""
        import tds as deepspeed

        attach_deepspeed_comm(cfg)
        optimizer, lr_scheduler = build_optimizer_and_scheduler(module, cfg, for_engine=True)
        engine, ds_optimizer, _, _ = deepspeed.initialize(
            model=module, optimizer=optimizer, lr_scheduler=lr_scheduler,
            config=build_deepspeed_config(cfg, pipeline), mpu=None if pipeline else mpu,
            dist_init_required=False)
        return cls(engine, ds_optimizer, lr_scheduler, cfg, pipeline)

    @property
    def loss_scale(self):
        return getattr(self.optimizer, "cur_scale", None) or \
            getattr(self.optimizer, "loss_scale", None) or 1.0

    def train_step(self, forward_step_func, data_iterator):
        engine = self.model
        if self.pipeline:
            loss = engine.train_batch(data_iter=data_iterator)
            per_micro_batch = [{"lm loss": loss.detach().float()}]
        else:
            per_micro_batch = []
            for _ in range(self.cfg.batch.gas):
                loss, stats = forward_step_func(data_iterator, engine)
                engine.backward(loss)  # DeepSpeed divides by gas itself
                engine.step()
                per_micro_batch.append(stats)
        updated = not getattr(engine.optimizer, "overflow", False)
        # a device tensor or a float (DeepSpeed's choice): the loop reads it at log time
        return per_micro_batch, updated, engine.get_global_grad_norm()

    def eval_step(self, forward_step_func, data_iterator):
        if self.pipeline:
            return [{"lm loss": self.model.eval_batch(data_iterator).detach().float()}]
        return [forward_step_func(data_iterator, self.model)[1]
                for _ in range(self.cfg.batch.gas)]

    def counters(self):
        return {k: int(getattr(self.model, k, 0)) for k in _ENGINE_COUNTERS}

    def load_counters(self, counters):
        for key, value in counters.items():
            setattr(self.model, key, value)

    def named_optimizer(self):
        # fp32 without ZeRO: the engine steps our AdamW itself
        return self.optimizer if self.optimizer is self.model.basic_optimizer else None

    def load_named_optimizer(self, named, step):
        from .zero_state import load_named

        if not hasattr(self.optimizer, "single_partition_of_fp32_groups"):
            raise CheckpointError(
                f"this run's optimizer ({type(self.optimizer).__name__}: DeepSpeed's fp16/bf16 "
                f"optimizer without ZeRO) cannot take optimizer state from another tensor- or "
                f"pipeline-parallel layout; add --zero-stage 1, or pass --no-load-optim")
        load_named(self.optimizer, self.module(), named, step)

    def load_scaler_state(self, scaler):
        if not self.cfg.precision.fp16 or not hasattr(self.optimizer, "loss_scaler"):
            return True
        if scaler.get("deepspeed") is not None:
            self.optimizer.loss_scaler = scaler["deepspeed"]
            return True
        return not any(v is not None for v in scaler.values())

    def load_optimizer_files(self, paths):
        """Load the optimizer from the saved data-parallel ranks' files (``paths``).

        - Our AdamW (fp32, no ZeRO): every rank saved the same state; read one.
        - ZeRO (stages 1-2): DeepSpeed's elastic format
          (``zero_optimization.elastic_checkpoint``, on by default in
          build_deepspeed_config) reads every saved partition, merges them and cuts this
          rank's, master weights included, so the dp size may differ from the saved one;
          the rigid format reads this rank's own file and needs the saved dp size.
        - DeepSpeed's fp16/bf16 optimizers without ZeRO: only at the saved dp size.
        """
        dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
        params = inspect.signature(self.optimizer.load_state_dict).parameters
        if "state_dict_list" not in params:
            if len(paths) != dp and self.named_optimizer() is None:
                raise CheckpointError(_other_dp_message(len(paths), dp, "this optimizer"))
            own = paths[dp_rank] if dp_rank < len(paths) else paths[0]  # replicated state
            self.optimizer.load_state_dict(load_engine_optimizer_file(own))
            return
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

    def after_weights_only_load(self):
        if hasattr(self.optimizer, "refresh_fp32_params"):
            self.optimizer.refresh_fp32_params()  # fp16/bf16: master weights from the model


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


def load_engine_optimizer_file(path):
    """weights_only load that also admits DeepSpeed's plain records in optimizer states.

    ZeRO and bf16 optimizer states pickle a few DeepSpeed objects: the loss scaler and
    fragment addresses. They are plain attribute holders (no ``__setstate__``, no
    ``__reduce__``), so allowing exactly these classes still executes no pickled code.
    """
    import torch
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    records = [fragment_address, LossScaler, DynamicLossScaler, ZeroStageEnum]
    try:
        with torch.serialization.safe_globals(records):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"cannot read optimizer shard {path}: {exc}") from None

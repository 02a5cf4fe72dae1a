"""The run configuration: flags, YAML files, the one validation pass, derived values.

    cfg, tokenizer = build_run_config(argv, family=get_family("gpt2"))
    cfg.parallel.dp          # a typed section (ParallelDims, ModelDims, ...): library code
    cfg.hidden_size          # a flag, Megatron style: users' providers

Nothing outside this package changes a configuration: a :class:`RunConfig` is frozen.
"""
from .parser import (CHECK_ONLY_ENV, args_to_dict, build_parser, build_run_config, parse_args,
                     read_flags, saved_run_config, settings_check_only)
from .run_config import (PIPELINE_SCHEDULES, SECTIONS, V_SCHEDULE, ZERO_BUBBLE_SCHEDULES,
                         BatchConfig, CheckpointConfig, DataConfig, FrozenConfigError,
                         KernelConfig, LoggingConfig, ModelDims, OptimizerConfig, ParallelDims,
                         PrecisionConfig, RunConfig, Section, uses_pipeline_engine)
from .validation import parse_data_path
from .yaml_file import config_file_flags

__all__ = ["CHECK_ONLY_ENV", "PIPELINE_SCHEDULES", "SECTIONS", "V_SCHEDULE",
           "ZERO_BUBBLE_SCHEDULES", "BatchConfig", "CheckpointConfig", "DataConfig",
           "FrozenConfigError", "KernelConfig", "LoggingConfig", "ModelDims", "OptimizerConfig", "ParallelDims",
           "PrecisionConfig", "RunConfig", "Section", "args_to_dict", "build_parser",
           "config_file_flags",
           "build_run_config", "parse_args", "parse_data_path", "read_flags", "saved_run_config",
           "settings_check_only", "uses_pipeline_engine"]

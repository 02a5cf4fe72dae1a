"""The run configuration: flags, YAML files, the one validation pass, derived values.

    cfg, tokenizer = build_run_config(argv, family="gpt2")
    cfg.hidden_size          # a flag, Megatron style
    cfg.parallel.dp          # a typed section (ParallelDims, PrecisionConfig, ...)

Nothing outside this package changes a configuration: a :class:`RunConfig` is frozen.
"""
from .parser import (args_to_dict, build_parser, build_run_config, parse_args,
                     saved_run_config)
from .run_config import (BatchConfig, CheckpointConfig, FrozenConfigError, LoggingConfig,
                         OptimizerConfig, ParallelDims, PrecisionConfig, RunConfig)
from .validation import parse_data_path

__all__ = ["BatchConfig", "CheckpointConfig", "FrozenConfigError", "LoggingConfig",
           "OptimizerConfig", "ParallelDims", "PrecisionConfig", "RunConfig", "args_to_dict",
           "build_parser", "build_run_config", "parse_args", "parse_data_path",
           "saved_run_config"]

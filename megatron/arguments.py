"""Every command-line flag, YAML config loading, one validation pass, and derived values.

Flag names are CPM-Pretrain's (``--model-parallel-size``, ``--batch-size``, ``--gas``, ...)
with Megatron-LM v2 spellings as aliases (``--tensor-model-parallel-size``,
``--micro-batch-size``, ...). Destinations use Megatron v2 names
(``args.tensor_model_parallel_size``, ``args.micro_batch_size``), plus ``args.gas``.

``--config file.yaml`` sets defaults from a file (keys are flag names, dashes or
underscores, plus a MindFormers-style ``parallel_config`` block); a flag given on the
command line overrides the file. :func:`parse_args` then validates everything at once and
raises :class:`~megatron.errors.ConfigError` listing every problem, before any process
group exists, so each rank fails the same way and none hangs.
"""
import argparse
import os

from .arguments_groups import ADD_GROUPS
from .config_file import apply_config_file
from .errors import ConfigError
from .validation import derive_and_validate


def build_parser(extra_args_provider=None):
    """The full parser: the built-in groups, then ``extra_args_provider(parser)``."""
    parser = argparse.ArgumentParser(description="megatron-tds pretraining",
                                     allow_abbrev=False)
    for add_group in ADD_GROUPS:
        add_group(parser)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser) or parser
    return parser


def parse_args(argv=None, extra_args_provider=None, defaults=None, world_size=None,
               rank=None, check_files=True):
    """Parse, merge the YAML config, validate and derive.

    Args:
        argv: command-line arguments (default: ``sys.argv[1:]``).
        extra_args_provider: ``f(parser) -> parser`` adding model-specific flags.
        defaults: dict of defaults the entry script sets (overridden by the config file
            and by the command line), e.g. ``{"tokenizer_type": "GPT2BPETokenizer"}``.
        world_size, rank: the launch's (default: ``$WORLD_SIZE`` / ``$RANK``, else 1 / 0).
        check_files: check that data, vocab and checkpoint paths exist.

    Returns:
        ``argparse.Namespace`` with derived values (``data_parallel_size``,
        ``global_batch_size``, ``params_dtype``, ...).

    Raises:
        ConfigError: listing every invalid or inconsistent setting.
    """
    parser = build_parser(extra_args_provider)
    if defaults:
        unknown = sorted(set(defaults) - {a.dest for a in parser._actions})
        if unknown:
            raise ConfigError(f"unknown default(s) {unknown} set by the entry script")
        parser.set_defaults(**defaults)
    pre, _ = parser.parse_known_args(argv)
    if pre.config:
        apply_config_file(parser, pre.config)
    args = parser.parse_args(argv)
    args.world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    args.rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    if args.local_rank is None:
        args.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    derive_and_validate(args, check_files=check_files)
    return args


def args_to_dict(args):
    """The namespace as a dict of plain values (safe for ``torch.load(weights_only=True)``)."""
    plain = (bool, int, float, str, type(None))
    out = {}
    for key, value in vars(args).items():
        if isinstance(value, plain):
            out[key] = value
        elif isinstance(value, (list, tuple)) and all(isinstance(v, plain) for v in value):
            out[key] = list(value)
        else:
            out[key] = str(value)
    return out

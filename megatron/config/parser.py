"""Build the run configuration: command line + YAML, one validation pass, derived values.

Flag names are CPM-Pretrain's (``--model-parallel-size``, ``--batch-size``, ``--gas``, ...)
with Megatron-LM v2 spellings as aliases (``--tensor-model-parallel-size``,
``--micro-batch-size``, ...). Destinations use Megatron v2 names
(``args.tensor_model_parallel_size``, ``args.micro_batch_size``), plus ``args.gas``.

``--config file.yaml`` sets defaults from a file (keys are flag names, dashes or
underscores, plus a MindFormers-style ``parallel_config`` block); a flag given on the
command line overrides the file. :func:`build_run_config` then validates everything at once
(the generic flags and the model family's) and raises :class:`~megatron.common.errors.ConfigError`
listing every problem, before any process group exists, so each rank fails the same way and
none hangs. Problems with the files that only this rank may see (a lost mount) are raised as
:class:`RankFileProblems` in a run of several processes, for the ranks to agree on once
torch.distributed starts. The result is a frozen :class:`~megatron.config.run_config.RunConfig`.
"""
import argparse
import os
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..common.errors import ConfigError, MegatronError
from .flags import ADD_GROUPS
from .run_config import ParallelDims, RunConfig
from .validation import derive_and_validate, derive_vocab, rank_file_problems
from .yaml_file import apply_config_file

#: ``f(parser) -> parser``: adds the flags of a user's own model (Megatron's hook).
ArgsProvider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]

#: Set by the launchers' settings check (:mod:`megatron.launch.check`): ``pretrain()`` builds
#: the run configuration (every check) and returns before torch.distributed starts.
CHECK_ONLY_ENV = "MEGATRON_TDS_CHECK_ONLY"


def settings_check_only() -> bool:
    """Whether this process only checks the settings (:data:`CHECK_ONLY_ENV`)."""
    return os.environ.get(CHECK_ONLY_ENV, "") not in ("", "0")


def build_parser(extra_args_provider: Optional[ArgsProvider] = None,
                 family: Optional[Any] = None) -> argparse.ArgumentParser:
    """The full parser: the built-in groups, the family's flags, then ``extra_args_provider``.

    Args:
        extra_args_provider: ``f(parser) -> parser`` adding flags of a user's model.
        family: a :class:`~megatron.families.ModelFamily` (``megatron.families.get_family``
            turns a name into one), or None.
    """
    parser = argparse.ArgumentParser(description="megatron-tds pretraining",
                                     allow_abbrev=False)
    for add_group in ADD_GROUPS:
        add_group(parser)
    if family is not None:
        family.add_flags(parser)
        parser.set_defaults(**family.flag_defaults)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser) or parser
    return parser


def _parse(argv, extra_args_provider, defaults, family):
    parser = build_parser(extra_args_provider, family)
    if defaults:
        unknown = sorted(set(defaults) - {a.dest for a in parser._actions})
        if unknown:
            raise ConfigError(f"unknown default(s) {unknown} set by the entry script")
        parser.set_defaults(**defaults)
    pre, _ = parser.parse_known_args(argv)
    if pre.config:
        apply_config_file(parser, pre.config)
    return parser.parse_args(argv)


def read_flags(argv: Sequence[str], family: Optional[Any] = None,
               defaults: Optional[Dict[str, Any]] = None) -> argparse.Namespace:
    """The flags and the YAML file's values as parsed, before any check or derived value
    (a tool reads the configured layout with it before choosing the world to validate for).

    Args:
        argv: command-line arguments (``--config`` included).
        family: the :class:`~megatron.families.ModelFamily` whose flags join the parser.
        defaults: defaults under the file's and the command line's values.
    """
    return _parse(argv, None, defaults, family)


class RankFileProblems(ConfigError):
    """The run's files as this rank alone sees them are wrong (missing, unreadable), while
    the flags are valid: raised by :func:`build_run_config` in a run of several processes.

    Another rank may see them fine (a mount lost on one node). Raising alone here would
    leave the others waiting in ``init_process_group`` until its timeout; so
    :func:`megatron.initialize.initialize_megatron` starts torch.distributed with
    :attr:`parallel` and agrees on every rank's problems first, then every rank raises the
    same error naming the rank and the file. A caller that does not start a process group
    sees a plain :class:`ConfigError`.

    Attributes:
        problems: this rank's problems, one message each.
        parallel: the run's :class:`~megatron.config.run_config.ParallelDims` (what
            starting torch.distributed needs).
    """

    def __init__(self, message: str, problems: List[str], parallel: ParallelDims):
        super().__init__(message)
        self.problems, self.parallel = problems, parallel


def build_run_config(argv: Optional[Sequence[str]] = None, family: Optional[Any] = None,
                     extra_args_provider: Optional[ArgsProvider] = None,
                     defaults: Optional[Dict[str, Any]] = None,
                     world_size: Optional[int] = None, rank: Optional[int] = None,
                     check_files: bool = True,
                     accelerator: Optional[Any] = None) -> Tuple[RunConfig, Optional[Any]]:
    """Parse, merge the YAML config, validate, build the tokenizer and freeze.

    Args:
        argv: command-line arguments (default: ``sys.argv[1:]``).
        family: the :class:`~megatron.families.ModelFamily` whose flags and checks join the
            pass, or None.
        extra_args_provider: ``f(parser) -> parser`` adding a user model's flags.
        defaults: dict of defaults the entry script sets (overridden by the config file
            and by the command line), e.g. ``{"tokenizer_type": "GPT2BPETokenizer"}``.
        world_size, rank: the launch's (default: ``$WORLD_SIZE`` / ``$RANK``, else 1 / 0).
        check_files: check that data, vocab and checkpoint paths exist and build the
            tokenizer (which derives the padded vocabulary size).
        accelerator: DeepSpeed's accelerator that ``--fp16`` / ``--bf16`` are checked against
            (default: this device's); tests pass a stand-in to emulate a device.

    Returns:
        ``(RunConfig, tokenizer)``; the tokenizer is None when ``check_files`` is False.

    Raises:
        ConfigError: listing every invalid or inconsistent setting.
        RankFileProblems: (a ``ConfigError``) the flags are valid but this rank finds
            files missing or unreadable, in a run of several processes: the caller agrees
            on it with the other ranks (:func:`megatron.initialize.initialize_megatron`).
    """
    ns = _parse(argv, extra_args_provider, defaults, family)
    ns.world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    ns.rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    if ns.local_rank is None:
        ns.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    problems = derive_and_validate(ns, family, check_files=check_files, accelerator=accelerator)
    label = f"{family.label} " if family is not None and family.label else ""
    own = rank_file_problems(ns) if check_files else []  # this rank's verdict
    tokenizer = None
    if check_files and not problems and not own:
        tokenizer = _tokenizer(ns, family, own)
    if problems or own:
        message = f"invalid {label}configuration:\n  - " + "\n  - ".join(problems + own)
        if problems or ns.world_size == 1:  # the flags' verdict is every rank's: raise now
            raise ConfigError(message)
        raise RankFileProblems(message, own, ParallelDims.from_values(vars(ns)))
    cfg = _freeze(vars(ns), family)
    # the features the family provides, read from the model config it builds for this run
    unprovided = family.provided_problems(cfg) if family is not None else []
    if unprovided:
        raise ConfigError(f"invalid {label}configuration:\n  - " + "\n  - ".join(unprovided))
    return cfg, tokenizer


def _tokenizer(ns, family, problems):
    """The tokenizer, and the checks that read the files through it (their verdict is this
    rank's, like the files': appended to ``problems``); None when it cannot be built."""
    from ..tokenizer import build_tokenizer

    try:
        tokenizer = build_tokenizer(ns)
    except MegatronError as exc:
        problems.append(str(exc))
        return None
    derive_vocab(ns, tokenizer.vocab_size)
    if family is not None:
        family.validate_with_tokenizer(ns, tokenizer, problems)
    return tokenizer


def parse_args(argv: Optional[Sequence[str]] = None,
               extra_args_provider: Optional[ArgsProvider] = None,
               defaults: Optional[Dict[str, Any]] = None, world_size: Optional[int] = None,
               rank: Optional[int] = None, check_files: bool = True,
               family: Optional[Any] = None, accelerator: Optional[Any] = None) -> RunConfig:
    """Megatron's name: :func:`build_run_config` without the tokenizer.

    Returns:
        The frozen :class:`RunConfig` (flags read as ``args.hidden_size``).
    """
    return build_run_config(argv, family, extra_args_provider, defaults, world_size, rank,
                            check_files, accelerator)[0]


def _freeze(values, family):
    if family is None:
        return RunConfig(values)
    return RunConfig(values, family.name, family.settings, family)


def saved_run_config(saved: Dict[str, Any], family: Optional[Any] = None) -> RunConfig:
    """A read-only view of a checkpoint's saved settings, missing ones at today's defaults.

    Checkpoints written by older versions lack newer flags; the parser's defaults fill
    them, so a default is defined once (in the flag) and nowhere else.

    Args:
        saved: the ``args`` dict stored in a checkpoint.
        family: the :class:`~megatron.families.ModelFamily` whose flags to default, or None.
    """
    parser = build_parser(family=family)
    values = {a.dest: a.default for a in parser._actions if a.dest != "help"}
    values.update(saved)
    for key in ("compute_dtype", "params_dtype"):
        if isinstance(values.get(key), str):  # saved as "torch.float32"
            import torch

            values[key] = getattr(torch, values[key].replace("torch.", ""))
    values.setdefault("compute_dtype", None)
    return _freeze(values, family)


def args_to_dict(args: Any) -> Dict[str, Any]:
    """Plain values (safe for ``torch.load(weights_only=True)``) of a RunConfig or namespace."""
    from .run_config import values_to_plain

    return args.to_dict() if isinstance(args, RunConfig) else values_to_plain(vars(args))

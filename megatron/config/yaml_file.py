"""YAML run configs: file values become parser defaults, so command-line flags win.

A config is a mapping of flag names (``num_layers`` or ``num-layers``, any alias) to
values, plus an optional MindFormers-style block::

    parallel_config:
      data_parallel: 2        # checked against world size / (tp * cp * pp)
      model_parallel: 2       # --model-parallel-size
      context_parallel: 2     # --context-parallel-size
      expert_parallel: 2      # --expert-model-parallel-size
      pipeline_stage: 2       # --pipe-parallel-size
      micro_batch_num: 4      # --gas
      recompute: true         # --checkpoint-activations
"""
import argparse
from typing import Any, Dict

from ..common.errors import ConfigError, not_text

PARALLEL_CONFIG_KEYS = {
    "data_parallel": "expected_data_parallel_size",
    "model_parallel": "tensor_model_parallel_size",
    "context_parallel": "context_parallel_size",
    "expert_parallel": "expert_model_parallel_size",
    "pipeline_stage": "pipeline_model_parallel_size",
    "micro_batch_num": "gas",
    "recompute": "checkpoint_activations",
}


def _option_index(parser):
    """Every option spelling (without dashes, '-' -> '_') and dest -> its action."""
    index = {}
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        index.setdefault(action.dest, action)  # the positive spelling of a --x/--no-x pair
        for opt in action.option_strings:
            index[opt.lstrip("-").replace("-", "_")] = action
    return index


def _did_you_mean(key, known):
    """`` (did you mean 'hidden_size'?)`` for the closest known key, or ``""``."""
    import difflib

    close = difflib.get_close_matches(key, [k for k in known if not k.startswith("no_")],
                                      n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _convert(action, key, value, path):
    """Type-check a YAML value for ``action``; returns the value to use as a default."""
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: {key!r} must be true or false, got {value!r}")
        # `no_x: true` means x = False.
        return value if isinstance(action, argparse._StoreTrueAction) else not value
    if action.nargs in ("*", "+"):
        items = value.split() if isinstance(value, str) else value
        if not isinstance(items, list):
            raise ConfigError(f"{path}: {key!r} must be a list, got {value!r}")
        return [str(v) for v in items]
    if value is None:
        return None
    _check_number(action.type, key, value, path)
    convert = action.type or str
    try:
        converted = convert(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{path}: {key!r} must be of type {convert.__name__}, "
                          f"got {value!r}") from None
    if action.choices is not None and converted not in action.choices:
        raise ConfigError(f"{path}: {key!r} must be one of {list(action.choices)}, "
                          f"got {value!r}")
    return converted


def _check_number(kind, key, value, path):
    """YAML gives typed values: refuse those ``int()`` / ``float()`` would silently change
    (``64.9`` -> 64, ``true`` -> 1) instead of converting them."""
    if kind not in (int, float):
        return
    if isinstance(value, bool):
        raise ConfigError(f"{path}: {key!r} must be a number ({kind.__name__}), got {value!r}")
    if kind is int and isinstance(value, float) and not value.is_integer():
        raise ConfigError(f"{path}: {key!r} must be a whole number, got {value!r}")


def _int_value(key, value, path):
    """An int config value (``parallel_config`` entries), with a clear error otherwise."""
    _check_number(int, key, value, path)
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{path}: {key!r} must be a whole number, got {value!r}") from None


def load_config_file(path: str) -> Dict[str, Any]:
    """Read ``path`` as a YAML mapping."""
    import yaml

    try:
        with open(path, encoding="utf-8") as handle:
            data = yaml.safe_load(handle)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except UnicodeDecodeError as exc:
        raise not_text(path, exc, "a --config file must be a UTF-8 YAML mapping of flag: value",
                       ConfigError) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must be a mapping of flag: value, "
                          f"got a {type(data).__name__}")
    return data


def config_defaults(parser: argparse.ArgumentParser, path: str) -> Dict[str, Any]:
    """The defaults (dest -> value) a YAML config file sets."""
    data = load_config_file(path)
    index = _option_index(parser)
    defaults = {}
    block = data.pop("parallel_config", None) or {}
    if not isinstance(block, dict):
        raise ConfigError(f"{path}: parallel_config must be a mapping")
    for key, value in block.items():
        if key not in PARALLEL_CONFIG_KEYS:
            raise ConfigError(f"{path}: unknown parallel_config key {key!r}"
                              f"{_did_you_mean(str(key), PARALLEL_CONFIG_KEYS)}; "
                              f"known: {sorted(PARALLEL_CONFIG_KEYS)}")
        dest = PARALLEL_CONFIG_KEYS[key]
        if dest == "expected_data_parallel_size":
            defaults[dest] = _int_value(key, value, path)
        else:
            defaults[dest] = _convert(index[dest], key, value, path)
    for key, value in data.items():
        norm = str(key).replace("-", "_")
        if norm == "config":
            raise ConfigError(f"{path}: a config file cannot name another config file")
        if norm not in index:
            raise ConfigError(f"{path}: unknown key {key!r}{_did_you_mean(norm, index)}; keys "
                              f"are flag names such as num_layers or model-parallel-size "
                              f"(see --help)")
        action = index[norm]
        defaults[action.dest] = _convert(action, key, value, path)
    return defaults


def _words(parser, action, value):
    """The command-line words that give ``action``'s dest the (converted) ``value``."""
    if isinstance(value, bool):
        wanted = argparse._StoreTrueAction if value else argparse._StoreFalseAction
        same = [a for a in parser._actions if a.dest == action.dest and isinstance(a, wanted)]
        return [same[0].option_strings[-1]] if same else []
    if value is None:
        return []
    option = next((o for o in action.option_strings if o.startswith("--")),
                  action.option_strings[0])
    values = value if isinstance(value, list) else [value]
    return [option, *(f"{v:g}" if isinstance(v, float) else str(v) for v in values)]


def config_file_flags(parser: argparse.ArgumentParser, path: str) -> Dict[str, list]:
    """The top-level settings of the YAML file at ``path`` as command-line words, by dest
    (``{"ffn_hidden_size": ["--ffn-hidden-size", "11008"], "fp16": ["--fp16"]}``), checked
    as :func:`config_defaults` checks them; the ``parallel_config`` block is left out (a
    layout).

    Args:
        parser: the run's parser (its family's flags included).
        path: the YAML file.
    """
    data = load_config_file(path)
    data.pop("parallel_config", None)
    config_defaults(parser, path)  # every key known and well typed
    index = _option_index(parser)
    out = {}
    for key, value in data.items():
        action = index[str(key).replace("-", "_")]
        out[action.dest] = _words(parser, action, _convert(action, key, value, path))
    return out


def apply_config_file(parser: argparse.ArgumentParser, path: str) -> None:
    """Set ``parser``'s defaults from the YAML file at ``path``."""
    parser.set_defaults(**config_defaults(parser, path), config=path)

"""A model family named on a command line: a registered name, ``package.module:OBJECT`` or
``path/to/file.py:OBJECT`` (what tools take as ``--family``)."""
import importlib
import importlib.util
import os
import sys
from typing import Any

from ..common.errors import ConfigError


def _module(where: str) -> Any:
    """The module ``where`` names: a dotted import path, or a ``.py`` file."""
    if where.endswith(".py") or os.sep in where:
        path = os.path.abspath(where)
        if not os.path.isfile(path):
            raise ConfigError(f"--family: no file {where}")
        name = f"_megatron_family_{os.path.splitext(os.path.basename(path))[0]}"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses and pickling look modules up by name
        sys.path.insert(0, os.path.dirname(path))  # its own imports of modules beside it
        spec.loader.exec_module(module)
        return module
    if os.getcwd() not in sys.path:  # a tool run as tools/x.py: the working directory too
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(where)
    except ImportError as exc:
        raise ConfigError(f"--family: cannot import {where!r} ({exc}); give an importable "
                          f"module (on PYTHONPATH) or a path to a .py file") from None


def import_family(spec: str) -> Any:
    """The :class:`~megatron.families.ModelFamily` at ``spec``.

    Args:
        spec: ``package.module:OBJECT`` or ``path/to/file.py:OBJECT`` (``OBJECT`` may be
            dotted: ``module:Class.FAMILY``; a callable is called, as ``register`` takes).

    Raises:
        ConfigError: nothing importable there, or not a ModelFamily.
    """
    from .base import ModelFamily

    where, _, attribute = spec.rpartition(":")
    found: Any = _module(where)
    for part in attribute.split("."):
        if not hasattr(found, part):
            raise ConfigError(f"--family {spec}: {where} has no {attribute!r}")
        found = getattr(found, part)
    if callable(found) and not isinstance(found, (ModelFamily, type)):
        found = found()  # a factory function, as register() takes (a class is not one)
    if not isinstance(found, ModelFamily):
        raise ConfigError(f"--family {spec}: {attribute} is not a megatron.families."
                          f"ModelFamily (its type: {type(found).__name__})")
    return found

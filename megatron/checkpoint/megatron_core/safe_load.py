"""Read Megatron-Core's pickled parts without executing pickled code, and without
megatron-core installed.

Three things in a Megatron-Core checkpoint are pickles:

- a legacy ``model_optim_rng.pt`` and a ``torch_dist`` checkpoint's common state
  (``common.pt``, or the ``common_state`` object inside the ``.distcp`` files): read with
  ``torch.load(weights_only=True)``. Besides what :mod:`..megatron_lm.safe_load` allows
  (``argparse.Namespace``, NumPy arrays) they hold ``io.BytesIO`` (TransformerEngine's extra
  state) and Megatron-Core's own data types (enums such as ``AttnBackend`` in the args, the
  rerun state machine's state). Those are allowed by name, for the duration of the call, as
  inert stand-ins (:class:`CoreValue`): the stand-in records the arguments it was given and
  runs nothing, so no Megatron-Core code is imported or run;
- a ``torch_dist`` checkpoint's ``.metadata`` (torch DCP's own index of the tensors), which
  DCP reads with plain ``pickle.load``: here it is read by :class:`MetadataUnpickler`, which
  builds only DCP's metadata and save-plan classes, ``torch.Size``, dtypes and paths.

Anything else is refused with a :class:`~megatron.common.errors.CheckpointError` naming it.
"""
import argparse
import codecs
import collections
import io
import pathlib
import pickle
from typing import Any, BinaryIO, Dict, List, Union

import torch

from ...common.errors import CheckpointError
from ..megatron_lm.safe_load import allowed_globals

#: Megatron-Core's data types that its files pickle (megatron/core/safe_globals.py's list).
CORE_TYPES = (
    "megatron.core.transformer.enums.AttnBackend",
    "megatron.core.transformer.enums.CudaGraphModule",
    "megatron.core.transformer.enums.CudaGraphScope",
    "megatron.core.transformer.enums.InferenceCudaGraphScope",
    "megatron.core.transformer.enums.AttnMaskType",
    "megatron.core.transformer.enums.LayerType",
    "megatron.core.enums.ModelType",
    "megatron.core.optimizer.optimizer_config.OptimizerConfig",
    "megatron.core.optimizer.OptimizerConfig",
    "megatron.core.rerun_state_machine.RerunDiagnostic",
    "megatron.core.rerun_state_machine.RerunMode",
    "megatron.core.rerun_state_machine.RerunState",
    "megatron.core.dist_checkpointing.strategies.torch.MCoreMetadata",
    "megatron.core.dist_checkpointing.strategies.torch.MCoreSavePlan",
    "types.SimpleNamespace",
    "signal.Signals",
    "torch._C.Generator",
)


class CoreValue:
    """An inert stand-in for a pickled Megatron-Core object: ``args`` are what the pickle
    called the type with (an enum's value), ``state`` what it set (a dataclass's fields)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.state = args, kwargs or None

    def __setstate__(self, state: Any) -> None:
        self.state = state

    @property
    def value(self) -> Any:
        """An enum's value (the first argument), else None."""
        return self.args[0] if self.args else None

    def __repr__(self) -> str:
        return f"{type(self).__name__}{self.args or ''}"


def _stand_ins():
    return [(type(name.rsplit(".", 1)[1], (CoreValue,), {}), name) for name in CORE_TYPES]


def load_core(source: Union[str, BinaryIO], mmap: bool = False) -> Any:
    """``torch.load(weights_only=True)`` of a Megatron-Core pickle (tensors on the CPU).

    Args:
        source: a path or a file object (a ``torch_dist`` common state's bytes).
        mmap: map the tensors instead of reading them (a quick look at a big file).

    Raises:
        CheckpointError: unreadable, or a type outside the allow-list (named).
    """
    name = source if isinstance(source, str) else "the checkpoint's common state"
    try:
        # io.BytesIO's pickle rebuilds its buffer with bytes() / _codecs.encode (data only)
        with torch.serialization.safe_globals(allowed_globals() + [io.BytesIO, bytes,
                                                                   codecs.encode] +
                                              _stand_ins()):
            return torch.load(source, map_location="cpu", weights_only=True,
                              mmap=mmap and isinstance(source, str))
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {name} is missing: the checkpoint is "
                              f"incomplete") from None
    except Exception as exc:
        lines = str(exc).strip().splitlines() or [type(exc).__name__]
        first = next((line.strip() for line in lines if "Unsupported global" in line), lines[0])
        raise CheckpointError(
            f"cannot read Megatron-Core checkpoint file {name}: {first}. megatron-tds reads "
            f"with torch.load(weights_only=True), allowing tensors, argparse.Namespace, NumPy "
            f"arrays, io.BytesIO and Megatron-Core's own enums and configs (as inert "
            f"stand-ins); re-save the checkpoint without the object named") from None


def value_of(item: Any) -> Any:
    """A setting read from saved args: a stand-in's enum value, anything else as it is."""
    return item.value if isinstance(item, CoreValue) else item


def _dcp_metadata_classes() -> Dict[tuple, Any]:
    from torch.distributed.checkpoint import filesystem, metadata, planner

    allowed = {("torch", "Size"): torch.Size,
               ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
               ("collections", "OrderedDict"): collections.OrderedDict,
               ("pathlib", "PosixPath"): pathlib.PosixPath,
               ("pathlib", "WindowsPath"): pathlib.PurePosixPath,  # a path string, never opened
               ("pathlib", "PurePosixPath"): pathlib.PurePosixPath}
    for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                 "ChunkStorageMetadata", "TensorProperties", "MetadataIndex", "StorageMeta",
                 "_MEM_FORMAT_ENCODING"):
        if hasattr(metadata, name):
            allowed[("torch.distributed.checkpoint.metadata", name)] = getattr(metadata, name)
    # megatron-core's planner keeps each rank's save plan in the metadata (planner_data)
    for name in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData",
                 "BytesIOWriteData"):
        if hasattr(planner, name):
            allowed[("torch.distributed.checkpoint.planner", name)] = getattr(planner, name)
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = \
        filesystem._StorageInfo
    for name, value in vars(torch).items():
        if isinstance(value, torch.dtype):
            allowed[("torch", name)] = value
    for stand_in, name in _stand_ins():
        allowed[tuple(name.rsplit(".", 1))] = stand_in
    return allowed


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP ``.metadata`` file, building only the types DCP's metadata holds."""

    _allowed = None

    def find_class(self, module: str, name: str) -> Any:
        if MetadataUnpickler._allowed is None:
            MetadataUnpickler._allowed = _dcp_metadata_classes()
        found = MetadataUnpickler._allowed.get((module, name))
        if found is None:
            raise CheckpointError(f"the torch_dist metadata pickles {module}.{name}, which is "
                                  f"not one of torch DCP's metadata types; it is not loaded")
        return found


def load_dcp_metadata(handle: BinaryIO, path: str) -> Any:
    """A DCP ``Metadata`` read from an open ``.metadata`` file."""
    try:
        return MetadataUnpickler(handle).load()
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"cannot read torch_dist metadata {path}: {exc}") from None


def namespace_dict(args: Any) -> Dict[str, Any]:
    """Saved args (a Namespace, a dict or None) as a dict with stand-ins' values."""
    if args is None:
        return {}
    if isinstance(args, argparse.Namespace):
        args = vars(args)
    if not isinstance(args, dict):
        raise CheckpointError(f"the checkpoint's args are a {type(args).__name__}, expected "
                              f"an argparse.Namespace")
    return {k: value_of(v) for k, v in args.items()}


__all__: List[str] = ["CORE_TYPES", "CoreValue", "MetadataUnpickler", "load_core",
                      "load_dcp_metadata", "namespace_dict", "value_of"]

"""A ``torch_dist`` checkpoint folder through torch DCP (``torch.distributed.checkpoint``).

Megatron-Core's ``dist_checkpointing.save`` with the ``torch_dist`` backend writes, per
iteration folder::

    metadata.json          {"sharded_backend": "torch_dist", "sharded_backend_version": 1, ...}
    .metadata              DCP's index: every tensor's global shape, dtype and stored chunks
    __<rank>_<i>.distcp    the chunks each rank wrote (and pickled objects, as bytes)
    common.pt              args, iteration, checkpoint_version (megatron-core < 0.19; later
                           releases keep them as the ``common_state`` object in the .distcp)

Tensors are stored under their global shape, so reading needs no layout: DCP assembles each
whole tensor from the chunks, whatever tp / pp saved them. Only the tensors asked for are
read (not the optimizer state). The ``.metadata`` pickle is read by
:class:`~.safe_load.MetadataUnpickler`, and objects are taken as bytes (:class:`BytesPlanner`:
DCP's own planner would unpickle them with ``weights_only=False``) and read with
``weights_only`` loads (:mod:`.safe_load`); DCP's own tensor reads are ``weights_only``.

Writing (:func:`save_chunks`) goes through ``dcp.save`` with a planner that stores each
tensor as the chunks the ranks of a (tp, pp) layout would hold, so the index is the one
Megatron-Core would write at that layout.
"""
import io
import json
import os
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata,
                                                   MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (SavePlan, TensorWriteData, WriteItem,
                                                  WriteItemType)

from ...common.errors import CheckpointError
from .safe_load import load_core, load_dcp_metadata

CONFIG_FILE = "metadata.json"
COMMON_FILE = "common.pt"
#: Where megatron-core >= 0.19 keeps the common state: one ShardedObject's unique key.
COMMON_STATE_KEY = "common_state/shard_0_1"
CONFIG = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
          "common_backend": "torch", "common_backend_version": 1}

#: (offsets, local chunk) of one stored piece of a tensor.
Chunk = Tuple[Tuple[int, ...], torch.Tensor]


def dist_config(folder: str) -> Optional[Dict[str, Any]]:
    """``metadata.json`` of a distributed-checkpoint folder, or None when it has none."""
    path = os.path.join(folder, CONFIG_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            config = json.load(handle)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is not a distributed checkpoint's metadata.json: "
                              f"{exc}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} should hold a JSON object, found {type(config).__name__}")
    return config


def check_torch_dist(folder: str) -> None:
    """Raise unless ``folder`` is a ``torch_dist`` checkpoint DCP can read."""
    config = dist_config(folder)
    backend = (config or {}).get("sharded_backend")
    if backend != "torch_dist":
        raise CheckpointError(f"{folder}/{CONFIG_FILE} names the sharded backend "
                              f"{backend!r}; megatron-tds reads 'torch_dist' checkpoints (save "
                              f"with --ckpt-format torch_dist, or convert in Megatron-LM)")
    if not os.path.isfile(os.path.join(folder, ".metadata")):
        raise CheckpointError(f"{folder} has metadata.json but no .metadata: the torch_dist "
                              f"checkpoint is incomplete (a save that did not finish?)")


class SafeReader(FileSystemReader):
    """DCP's file-system reader with its ``.metadata`` read without running pickled code."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        path = os.path.join(str(self.path), ".metadata")
        with open(path, "rb") as handle:
            metadata = load_dcp_metadata(handle, path)
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


def entries(folder: str) -> Dict[str, Any]:
    """``{key: DCP storage metadata}`` of every entry the checkpoint holds."""
    return dict(SafeReader(folder).read_metadata().state_dict_metadata)


class BytesPlanner(DefaultLoadPlanner):
    """DCP's load planner, except that an object is kept as its bytes: DCP's own
    ``load_bytes`` unpickles it with ``weights_only=False``; here :func:`.safe_load.load_core`
    reads it afterwards."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        self.state_dict[read_item.dest_index.fqn] = io.BytesIO(value.read())


def _load(folder: str, state: Dict[str, Any]) -> None:
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=SafeReader(folder), planner=BytesPlanner(),
                 no_dist=True)


def read_tensors(folder: str, keys: List[str]) -> Dict[str, torch.Tensor]:
    """The whole (global) tensors ``keys``, in their stored dtype, on the CPU."""
    stored = entries(folder)
    state = {}
    for key in keys:
        meta = stored.get(key)
        if not isinstance(meta, TensorStorageMetadata):
            raise CheckpointError(f"torch_dist checkpoint {folder} has no tensor {key}")
        state[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
    try:
        _load(folder, state)
    except CheckpointError:
        raise
    except Exception as exc:  # a missing or truncated .distcp file
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"cannot read the tensors of torch_dist checkpoint {folder}: "
                              f"{first}") from None
    return state


def read_common(folder: str) -> Dict[str, Any]:
    """The common state (``args``, ``iteration``, ``checkpoint_version``, ...)."""
    path = os.path.join(folder, COMMON_FILE)
    if os.path.isfile(path):
        common = load_core(path)
    else:
        if COMMON_STATE_KEY not in entries(folder):
            raise CheckpointError(f"torch_dist checkpoint {folder} has neither {COMMON_FILE} "
                                  f"nor a common_state object: not a Megatron-Core checkpoint")
        state = {COMMON_STATE_KEY: io.BytesIO()}
        _load(folder, state)
        buffer = state[COMMON_STATE_KEY]  # the pickled bytes, not yet unpickled
        buffer.seek(0)
        common = load_core(buffer)
        common = common[0] if isinstance(common, list) and common else common
    if not isinstance(common, dict):
        raise CheckpointError(f"the common state of {folder} is a {type(common).__name__}, "
                              f"not a dict")
    return common


def tensor_keys(folder: str) -> List[str]:
    """Names of the tensors (not the pickled objects) the checkpoint holds."""
    return sorted(k for k, v in entries(folder).items() if isinstance(v, TensorStorageMetadata))


def object_keys(folder: str) -> List[str]:
    return sorted(k for k, v in entries(folder).items() if isinstance(v, BytesStorageMetadata))


# ---------------------------------------------------------------- writing
class ChunkPlanner(DefaultSavePlanner):
    """Saves each tensor as given chunks (the pieces the ranks of a layout hold) and each
    object as bytes, from one process."""

    def __init__(self, chunks: Dict[str, List[Chunk]], sizes: Dict[str, torch.Size],
                 objects: Dict[str, io.BytesIO]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.chunks, self.sizes, self.objects = chunks, sizes, objects

    def create_local_plan(self) -> SavePlan:
        items = [WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO)
                 for key in self.objects]
        for key, pieces in self.chunks.items():
            for offsets, local in pieces:
                items.append(WriteItem(
                    index=MetadataIndex(key, offsets), type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=torch.Size(offsets),
                                                   sizes=local.size()),
                        properties=TensorProperties.create_from_tensor(local),
                        size=self.sizes[key])))
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> Any:
        index = write_item.index
        if write_item.type == WriteItemType.BYTE_IO:
            return self.objects[index.fqn]
        offsets = tuple(index.offset)
        return next(local for start, local in self.chunks[index.fqn] if start == offsets)


def save_chunks(folder: str, chunks: Dict[str, List[Chunk]], sizes: Dict[str, torch.Size],
                objects: Dict[str, io.BytesIO]) -> None:
    """Write a DCP checkpoint of the chunks and objects into the (new) ``folder``, with
    Megatron-Core's ``metadata.json``; DCP flushes its files (``sync_files``)."""
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({}, storage_writer=FileSystemWriter(folder, sync_files=True),
                 planner=ChunkPlanner(chunks, sizes, objects), no_dist=True)
    with open(os.path.join(folder, CONFIG_FILE), "w", encoding="utf-8") as handle:
        json.dump(CONFIG, handle)
        handle.flush()
        os.fsync(handle.fileno())

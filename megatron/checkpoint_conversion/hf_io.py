"""Hugging Face ``save_pretrained`` directories: read config + weights, write them atomically.

Reads ``config.json`` and the weights as ``model.safetensors``, a sharded
``model.safetensors.index.json``, ``pytorch_model.bin`` or its index (``.bin`` files with
``torch.load(weights_only=True)``). Writes ``config.json`` + ``model.safetensors`` (and the
GPT-2 tokenizer files when given), so ``GPT2LMHeadModel.from_pretrained(dir)`` loads it.
No ``transformers`` import: it is only a test reference.
"""
import json
import os
import shutil

import torch

from ..resilience import durable
from ..common.errors import CheckpointError
from . import safetensors_io

CONFIG = "config.json"
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")


def is_hf_dir(path):
    """True when ``path`` looks like a ``save_pretrained`` directory."""
    return os.path.isfile(os.path.join(path, CONFIG))


def read_config(path):
    """The ``config.json`` dict of an HF directory."""
    file = os.path.join(path, CONFIG)
    if not os.path.isfile(file):
        raise CheckpointError(f"{path} has no {CONFIG}: not a Hugging Face model directory")
    try:
        with open(file) as handle:
            return json.load(handle)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{file} is not valid JSON: {exc}") from None


def _load_one(path):
    if path.endswith(".safetensors"):
        return safetensors_io.load_file(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"cannot read {path}: {str(exc).splitlines()[0]}") from None


def read_weights(path):
    """``{name: tensor}`` of an HF directory (single file or sharded)."""
    for name in _WEIGHT_FILES:
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            continue
        if not name.endswith(".index.json"):
            return _load_one(file)
        with open(file) as handle:
            shards = sorted(set(json.load(handle)["weight_map"].values()))
        state = {}
        for shard in shards:
            shard_path = os.path.join(path, shard)
            if not os.path.isfile(shard_path):
                raise CheckpointError(f"{file} names {shard}, which is missing")
            state.update(_load_one(shard_path))
        return state
    raise CheckpointError(f"{path} has no weights ({' / '.join(_WEIGHT_FILES)})")


def write_hf_dir(path, config, state, extra_files=(), extra_json=None):
    """Write an HF directory atomically and durably (``<path>.tmp<pid>``, every file and the
    folder flushed, then renamed to ``path`` and its parent flushed: :mod:`megatron.resilience.durable`).

    Args:
        path: output directory; must not exist or be empty.
        config: ``config.json`` dict.
        state: ``{name: tensor}`` (no shared storage).
        extra_files: ``(source path, name in the directory)`` pairs to copy (tokenizer).
        extra_json: ``{name: dict}`` more JSON files (``generation_config.json``).
    """
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise CheckpointError(f"--output {path} exists and is not empty; choose another "
                              f"directory or remove it")
    tmp = f"{path.rstrip(os.sep)}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        with open(os.path.join(tmp, CONFIG), "w") as handle:
            json.dump(config, handle, indent=2, sort_keys=True)
        safetensors_io.save_file(state, os.path.join(tmp, "model.safetensors"),
                                 metadata={"format": "pt"})
        for source, name in extra_files:
            shutil.copyfile(source, os.path.join(tmp, name))
        for name, content in (extra_json or {}).items():
            with open(os.path.join(tmp, name), "w") as handle:
                json.dump(content, handle, indent=2, sort_keys=True)
        for name in os.listdir(tmp):
            durable.fsync_path(os.path.join(tmp, name))
        durable.fsync_path(tmp)
        if os.path.isdir(path):
            os.rmdir(path)  # empty (checked above)
        durable.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

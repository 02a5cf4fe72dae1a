"""Read the history of an offline W&B run back from its ``run-<id>.wandb`` file.

wandb >= 0.19 ships no Python reader for this file (the old ``wandb.sdk.internal.datastore``
is gone; its Go core writes it), so the tests read it here: the file is W&B's 7-byte header
(``:W&B``, magic 0xBEE1, version 0) followed by LevelDB-log framed records (32 KiB blocks;
each chunk: crc32 (4 bytes), length (2), type (1): full / first / middle / last), and each
record is a ``wandb.proto.wandb_internal_pb2.Record`` protobuf, decoded with wandb's own
schema.
"""
import glob
import json
import os
import struct

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _payloads(data):
    """Yield the reassembled record payloads of a LevelDB-style log."""
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < HEADER:  # trailer too small for a chunk header: zero padding
            pos += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        chunk = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind == 0 and length == 0:  # preallocated zeros at the end of the file
            break
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            yield pending + chunk
            pending = b""


def read_history(run_dir):
    """``{key: [(step, value), ...]}`` of every ``run.log`` in an offline run.

    Args:
        run_dir: the folder that holds one ``run-*.wandb`` file (a ``offline-run-*`` folder).
    """
    from wandb.proto import wandb_internal_pb2

    (path,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    with open(path, "rb") as handle:
        data = handle.read()
    assert data[:4] == b":W&B" and struct.unpack("<HB", data[4:7]) == (0xBEE1, 0), path
    history = {}
    for payload in _payloads(data):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") != "history":
            continue
        items = {"/".join(i.nested_key) or i.key: json.loads(i.value_json)
                 for i in record.history.item}
        step = record.history.step.num if record.history.HasField("step") else items["_step"]
        for key, value in items.items():
            if not key.startswith("_"):
                history.setdefault(key, []).append((step, value))
    return history


def read_config(run_dir):
    """The run's config as ``{key: value}`` (from its config records)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    with open(path, "rb") as handle:
        data = handle.read()
    config = {}
    for payload in _payloads(data):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        kind = record.WhichOneof("record_type")
        items = record.config.update if kind == "config" else \
            record.run.config.update if kind == "run" else ()
        for item in items:
            config["/".join(item.nested_key) or item.key] = json.loads(item.value_json)
    return config
